"""The one client BlockFlow uses for Triton's own API, built on ``tritonclient``.

Two kinds of call, on two endpoints:

- open (HTTP, what a task client may also call): readiness, the statistics extension, model
  configurations. ``blockflow status`` and the server's start-up wait use these.
- restricted (gRPC, with the admin key of :mod:`blockflow.triton.access`): the repository
  index, load and unload. The applier, the heal loop and the benchmarks use these.

Why model control goes over gRPC: Triton's HTTP front end answers a load or unload on one of its
few event-loop threads and holds that thread until the load returns (Triton 2.51; upstream
issue triton-inference-server/server#8958). Every inference connection served by that thread
waits too, so parallel block loads over HTTP stopped a busy server for the whole load (measured:
no request answered for 5–8 s of a 6–9 s plan change). The gRPC front end runs each load on a
thread of its own, away from the inference threads.

Each call makes its own client: calls come from parallel threads (tritonclient's HTTP client is
gevent-based and must stay on the thread that made it), and a client is cheap next to the calls.
Every failure is a :class:`~blockflow.core.errors.TritonApiError` that says what failed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from blockflow.core.errors import TritonApiError
from blockflow.triton import access


@dataclass(frozen=True)
class ModelState:
    """One entry of the repository index."""

    name: str
    state: str  # READY, UNAVAILABLE, LOADING, UNLOADING, or "" for a model never loaded
    reason: str = ""


class TritonApi:
    """Triton at ``http_url`` and/or ``grpc_url`` (host:port); ``admin_key`` opens the restricted calls."""

    def __init__(self, http_url: str = "", grpc_url: str = "", admin_key: str = "", timeout: float = 900.0) -> None:
        self.http_url = http_url.removeprefix("http://")
        self.grpc_url = grpc_url.removeprefix("grpc://")
        self._grpc_headers = access.grpc_admin_headers(admin_key) if admin_key else None
        # A load starts processes that import torch and build a network: minutes on a slow machine.
        self.timeout = timeout

    @property
    def url(self) -> str:
        return self.grpc_url or self.http_url

    @contextmanager
    def _failing_as(self, what: str, where: str) -> Iterator[None]:
        try:
            yield
        except InferenceServerException as exc:
            raise TritonApiError(f"{what} failed: {exc.message()}") from None
        except TritonApiError:
            raise
        except Exception as exc:  # sockets, DNS, time-outs, a closed port
            raise TritonApiError(f"{what} failed: cannot reach Triton at {where} "
                                 f"({type(exc).__name__}: {exc or 'no answer'})") from None

    @contextmanager
    def _grpc(self, what: str) -> Iterator[grpcclient.InferenceServerClient]:
        if not self.grpc_url:
            raise TritonApiError(f"{what} needs Triton's gRPC endpoint, and none was given")
        with self._failing_as(what, self.grpc_url):
            client = grpcclient.InferenceServerClient(self.grpc_url)
            try:
                yield client
            finally:
                client.close()

    @contextmanager
    def _http(self, what: str, timeout: float | None = None) -> Iterator[httpclient.InferenceServerClient]:
        if not self.http_url:
            raise TritonApiError(f"{what} needs Triton's HTTP endpoint, and none was given")
        t = timeout if timeout is not None else self.timeout
        with self._failing_as(what, self.http_url):
            client = httpclient.InferenceServerClient(self.http_url, connection_timeout=t, network_timeout=t)
            try:
                yield client
            finally:
                client.close()

    # ------------------------------------------------------------------ open

    def ready(self, timeout: float = 2.0) -> bool:
        """Whether the server answers and says it is ready (False while it starts or when it is gone).

        Over HTTP when that endpoint was given, else over gRPC.
        """
        what = "asking whether the server is ready"
        try:
            if self.http_url:
                with self._http(what, timeout) as client:
                    return bool(client.is_server_ready())
            with self._grpc(what) as gclient:
                return bool(gclient.is_server_ready(client_timeout=timeout))
        except TritonApiError:
            return False

    def statistics(self) -> dict[str, dict[str, Any]]:
        """Each loaded model's statistics entry (``inference_stats``, ``batch_stats``, counts), by name.

        The statistics extension lists every loaded model: what runs, without the admin key.
        """
        if self.http_url:
            with self._http("reading the model statistics") as client:
                answer: Any = client.get_inference_statistics()
        else:
            with self._grpc("reading the model statistics") as client:
                answer = client.get_inference_statistics(as_json=True, client_timeout=self.timeout)
        return {str(s["name"]): dict(s) for s in answer.get("model_stats", [])}

    def config(self, model: str) -> dict[str, Any]:
        """The model's configuration as Triton holds it (JSON form of ``ModelConfig``)."""
        what = f"reading the configuration of {model}"
        if self.grpc_url:
            with self._grpc(what) as client:
                answer: Any = client.get_model_config(model, as_json=True, client_timeout=self.timeout)
            return dict(answer.get("config", {}))
        with self._http(what) as client:
            return dict(client.get_model_config(model))

    # ------------------------------------------------------------------ restricted (gRPC + admin key)

    def index(self) -> list[ModelState]:
        """Every model of the repository, loaded or not."""
        with self._grpc(f"reading the model index of {self.grpc_url}") as client:
            answer: Any = client.get_model_repository_index(headers=self._grpc_headers, as_json=True,
                                                            client_timeout=self.timeout)
        return [ModelState(str(m["name"]), str(m.get("state", "")), str(m.get("reason", "")))
                for m in answer.get("models", [])]

    def load(self, model: str) -> None:
        """Load ``model`` (again) from the repository; returns once Triton says it is ready, or raises."""
        with self._grpc(f"loading {model}") as client:
            client.load_model(model, headers=self._grpc_headers, client_timeout=self.timeout)

    def unload(self, model: str) -> None:
        with self._grpc(f"unloading {model}") as client:
            client.unload_model(model, headers=self._grpc_headers, client_timeout=self.timeout)

    def ensembles(self, models: list[str]) -> set[str]:
        """Which of ``models`` are ensembles (their configs, over gRPC)."""
        out = set()
        with self._grpc("reading model configs") as client:
            for m in models:
                cfg: Any = client.get_model_config(m, as_json=True, client_timeout=self.timeout)
                if cfg.get("config", {}).get("platform") == "ensemble":
                    out.add(m)
        return out
