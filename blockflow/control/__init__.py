"""Keeping a running server in step with its plan: live updates (``apply``), the REST control
service, the supervisor that ``blockflow serve`` runs, and ``status``."""
