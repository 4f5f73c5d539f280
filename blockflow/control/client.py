"""A client of one `blockflow serve` control service (``blockflow apply``, one server or a fleet)."""

from __future__ import annotations

from typing import Any

import httpx

from blockflow.core.errors import ApplyError, PlanError, PlanIssue, Unreachable


class ControlClient:
    """``GET /plan``, ``POST /plan`` and ``GET /status`` on the control service at ``url``, with its bearer token."""

    def __init__(self, url: str, token: str, timeout: float = 1800.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout)

    def _call(self, method: str, path: str, source: str, **kwargs: Any) -> dict[str, Any]:
        try:
            r = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise Unreachable(f"cannot reach the control service at {self.url}: {exc}") from None
        body: dict[str, Any] = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"error": r.text}
        if r.status_code == 422 and body.get("issues"):
            raise PlanError([PlanIssue(i["loc"], i["message"]) for i in body["issues"]], source)
        if r.status_code != 200:
            raise ApplyError(f"{body.get('error') or body.get('detail') or r.text} (HTTP {r.status_code})")
        return body

    def current(self) -> dict[str, Any]:
        """The plan the server serves: its ``name`` and ``text``, and the history."""
        return self._call("GET", "/plan", self.url)

    def post(self, text: str, dry_run: bool = False, source: str = "") -> dict[str, Any]:
        """Apply (or check) the plan ``text``: the server's report (``lines``, ``steps``, ``seconds``).

        A plan the server refuses raises :class:`PlanError` naming ``source``; a failed apply, :class:`ApplyError`."""
        return self._call("POST", "/plan", source or f"the plan (refused by {self.url})",
                          params={"dry_run": str(dry_run).lower()}, content=text.encode(), headers={"Content-Type": "application/yaml"})

    def status(self) -> dict[str, Any]:
        """Each task and block of the server's plan: ready or not; a task's succeeded and failed requests."""
        return self._call("GET", "/status", self.url)

    def progress(self) -> dict[str, Any]:
        """The server's plan change in progress (``running``, ``done`` of ``total``, ``steps``)."""
        return self._call("GET", "/plan/progress", self.url)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
