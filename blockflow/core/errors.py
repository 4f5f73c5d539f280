"""The BlockFlow exception tree.

Every error BlockFlow raises on purpose derives from :class:`BlockFlowError`,
so a caller can catch one class; the CLI turns each into one line (never a
traceback) and an exit code.

::

    BlockFlowError
    ├── PlanError            a plan is malformed; lists every problem with its key path
    ├── GenerateError        the model repository could not be written or is stale
    ├── EnvironmentProblem   something BlockFlow needs is missing (server, stub, library) or a switch is set wrong
    ├── CalibrationError     memory-model constants do not fit this version of the model
    ├── ServerError          tritonserver failed to start, stopped, or a model did not load
    │   ├── PortInUseError   a requested port is taken
    │   ├── TritonApiError   a call to Triton's model-repository API failed or reached no server
    │   └── ModelReloadError a block whose process died could not be loaded again
    ├── ApplyError           a live plan update failed (and was rolled back) or could not start
    ├── BlockError           a block failed to build or run (raised inside a block process)
    │   └── RequestError     one request is invalid; it fails alone
    └── ClientError          an inference call through the client failed
        └── Unreachable      a server (Triton, its metrics, the control service) did not answer

The CLI's exit codes (:data:`EXIT_CODES`) follow the tree; 2 stays click's, for bad flags and arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class BlockFlowError(Exception):
    """Base class of every error BlockFlow raises on purpose."""

    exit_code = 1


@dataclass(frozen=True)
class PlanIssue:
    """One problem in a plan: where it is, what is wrong, how to fix it."""

    loc: str
    message: str

    def __str__(self) -> str:
        return f"{self.loc}: {self.message}" if self.loc else self.message


class PlanError(BlockFlowError):
    """A plan failed validation. ``issues`` holds every problem found."""

    exit_code = 7

    def __init__(self, issues: Sequence[PlanIssue], source: str = "") -> None:
        self.issues = list(issues)
        self.source = source
        head = f"invalid plan {source}" if source else "invalid plan"
        if len(self.issues) == 1:
            super().__init__(f"{head}: {self.issues[0]}")
        else:
            lines = "\n".join(f"  {issue}" for issue in self.issues)
            super().__init__(f"{head} ({len(self.issues)} problems):\n{lines}")


class GenerateError(BlockFlowError):
    """The model repository could not be generated, or differs from the plan."""


class EnvironmentProblem(BlockFlowError):
    """A binary, library or package BlockFlow needs is missing or unusable, or a switch (`env.SWITCHES`) has a value it does not take."""

    exit_code = 3


class CalibrationError(BlockFlowError):
    """A memory calibration file cannot be used (fitted for another version of the memory model)."""


class ServerError(BlockFlowError):
    """tritonserver did not start, died, or did not load every model."""

    exit_code = 4


class PortInUseError(ServerError):
    """A port BlockFlow was asked to bind is already taken."""


class TritonApiError(ServerError):
    """A call to Triton's model-repository API (index, config, load, unload) failed or reached no server."""


class ModelReloadError(ServerError):
    """A block whose process died could not be loaded again; ``model`` names it."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message)
        self.model = model


class ApplyError(BlockFlowError):
    """A plan could not be applied to a running server; the message says what was rolled back."""

    exit_code = 6


class BlockError(BlockFlowError):
    """A block could not be built or failed while running."""


class RequestError(BlockError):
    """One inference request is invalid; only that request fails."""


class ClientError(BlockFlowError):
    """An inference call made through :mod:`clients` failed.

    ``status``: the HTTP status code (``"503"``) or gRPC status (``"UNAVAILABLE"``) the server
    answered with, None when none came back; ``retryable``: whether the same call may succeed
    later (the server was busy, unreachable or out of time) rather than being wrong as sent.
    """

    exit_code = 5

    def __init__(self, message: str, status: str | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retryable = retryable


class Unreachable(ClientError):
    """A server BlockFlow was pointed at did not answer (nothing listens, or the network refused)."""

    exit_code = 8

    def __init__(self, message: str, status: str | None = None, retryable: bool = True) -> None:
        super().__init__(message, status, retryable)


# What each exit status of the `blockflow` command means (listed in `blockflow --help`).
EXIT_CODES: dict[int, str] = {
    0: "success",
    1: "an error not listed below",
    2: "bad flags or arguments (usage)",
    3: "something needed is missing: a binary, a library, an extra, a GPU",
    4: "tritonserver did not start, stopped, or a model did not load",
    5: "an inference request failed",
    6: "a plan change was not applied (the previous plan was kept)",
    7: "the plan is invalid or cannot be read",
    8: "a server did not answer",
    130: "interrupted (Ctrl-C)",
}
