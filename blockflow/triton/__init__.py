"""The Triton server BlockFlow runs and talks to: where it is installed, the server process, its
API (one client, built on ``tritonclient``), its restricted-API key, MPS, and ``doctor``."""
