"""Triton's model-repository API (index, config, load, unload), over gRPC, with the admin key.

Why gRPC: Triton's HTTP front end answers a load or unload on one of its few event-loop
threads and holds that thread until the load returns (Triton 2.51; upstream issue
triton-inference-server/server#8958). Every inference connection served by that thread waits
too, so parallel block loads over HTTP stopped a busy server for the whole load (measured: no
request answered for 5–8 s of a 6–9 s plan change). The gRPC front end runs each load on a
thread of its own, away from the inference threads.

Each call makes its own client: calls run in parallel threads, and a client is cheap next to
the loads it makes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from blockflow.core.errors import TritonApiError
from blockflow.triton import access


@dataclass(frozen=True)
class ModelState:
    """One entry of the repository index."""

    name: str
    state: str  # READY, UNAVAILABLE, LOADING, UNLOADING, or "" for a model never loaded
    reason: str = ""


class TritonControl:
    """The restricted model-repository API of the Triton whose gRPC endpoint is ``grpc_url`` (host:port)."""

    def __init__(self, grpc_url: str, admin_key: str = "", timeout: float = 900.0) -> None:
        self.url = grpc_url.removeprefix("grpc://")
        self._headers = access.grpc_admin_headers(admin_key) if admin_key else None
        # A load starts processes that import torch and build a network: minutes on a slow machine.
        self.timeout = timeout

    @contextmanager
    def _client(self, what: str) -> Iterator[grpcclient.InferenceServerClient]:
        """A client for one call; every failure becomes a :class:`TritonApiError` that says ``what`` failed."""
        client = grpcclient.InferenceServerClient(self.url)
        try:
            yield client
        except InferenceServerException as exc:
            raise TritonApiError(f"{what} failed: {exc.message()}") from None
        except Exception as exc:  # the channel itself: address, DNS, a closed port
            raise TritonApiError(f"{what} failed: cannot reach Triton's gRPC endpoint at {self.url} "
                                 f"({type(exc).__name__}: {exc or 'no answer'})") from None
        finally:
            client.close()

    def index(self) -> list[ModelState]:
        """Every model of the repository, loaded or not."""
        with self._client(f"reading the model index of {self.url}") as client:
            answer: Any = client.get_model_repository_index(headers=self._headers, as_json=True,
                                                            client_timeout=self.timeout)
        return [ModelState(str(m["name"]), str(m.get("state", "")), str(m.get("reason", "")))
                for m in answer.get("models", [])]

    def config(self, model: str) -> dict[str, Any]:
        """The model's configuration as Triton holds it (JSON form of ``ModelConfig``)."""
        with self._client(f"reading the configuration of {model}") as client:
            answer: Any = client.get_model_config(model, headers=self._headers, as_json=True,
                                                  client_timeout=self.timeout)
        return dict(answer.get("config", {}))

    def load(self, model: str) -> None:
        """Load ``model`` (again) from the repository; returns once Triton says it is ready, or raises."""
        with self._client(f"loading {model}") as client:
            client.load_model(model, headers=self._headers, client_timeout=self.timeout)

    def unload(self, model: str) -> None:
        with self._client(f"unloading {model}") as client:
            client.unload_model(model, headers=self._headers, client_timeout=self.timeout)
