"""The ``blockflow`` group, its consoles and shared arguments, and the entry point.

Every failure BlockFlow expects (bad plan, missing file, port in use, server
that does not start, bad arguments) ends in a clear message on stderr and a
non-zero exit code, never a traceback.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

import click
from rich.console import Console

from blockflow.core import env
from blockflow.core.errors import EXIT_CODES, BlockFlowError, EnvironmentProblem, PlanError
from blockflow.core.shipped import shipped

DEFAULT_PLAN = shipped("plans/default.yaml")

# Piped output (files, CI logs) gets wide tables instead of 80 columns of wrapped cells.
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 220)
out_console = out  # for commands with an `out` parameter
err = Console(stderr=True, soft_wrap=True)


# "\b" keeps click from rewrapping the table.
_EPILOG = "\b\nExit codes:\n" + "\n".join(f"  {code:<4} {what}" for code, what in EXIT_CODES.items())


LOG_LEVELS = ("debug", "info", "warning", "error")


@click.group(name="blockflow", context_settings={"help_option_names": ["-h", "--help"]}, epilog=_EPILOG)
@click.version_option(package_name="blockflow", prog_name="blockflow")
@click.option("-v", "--verbose", count=True, help="More log lines: -v BlockFlow's debug lines, -vv every library's too.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default=None, envvar=env.LOG_LEVEL, show_envvar=True,
              help="The lowest level of BlockFlow's log lines on stderr (default: info).")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", envvar=env.LOG_FORMAT, show_envvar=True,
              help="text: a line with time, level and message; json: one JSON object a line (time, level, logger, message), for log collectors.")
def app(verbose: int, log_level: str | None, log_format: str) -> None:
    """Serve DNNs cut into shared blocks on NVIDIA Triton."""
    # Log lines (serve's progress, the supervisor, apply) on stderr, one line each with its time
    # and level, never wrapped (logs are grepped); other libraries' only from warnings up unless
    # -vv (httpx alone logs every request at info).
    level = "debug" if verbose else (log_level or "info")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else
                         logging.Formatter("%(asctime)s %(levelname)-7s %(message)s", datefmt="%Y-%m-%dT%H:%M:%S%z"))
    logging.basicConfig(level=logging.DEBUG if verbose > 1 else logging.WARNING, handlers=[handler])
    logging.getLogger("blockflow").setLevel(level.upper())


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["traceback"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


PLAN = click.argument("plan", type=click.Path(path_type=Path))
PORT = click.IntRange(0, 65535)


def _set_triton_home(ctx: click.Context, param: click.Parameter, value: Path | None) -> None:
    if value is not None:
        # Read by blockflow.triton.install.locate, in this process and in those it starts.
        os.environ[env.TRITON_HOME] = str(value)


TRITON_HOME = click.option(
    "--triton-home", type=click.Path(path_type=Path, file_okay=False, exists=True), envvar=env.TRITON_HOME,
    expose_value=False, callback=_set_triton_home,
    help=f"The Triton directory to use: NVIDIA's container layout (/opt/tritonserver) or the nvidia-pytriton wheel's "
         f"(default: tritonserver on PATH if it is a container's, else the wheel; also ${env.TRITON_HOME}).")


JSON = click.option("--json", "as_json", is_flag=True,
                    help="Print one JSON document instead of tables (its schema: docs/cli-json.md).")


def emit(doc: object) -> None:
    """A command's ``--json`` output: one document on stdout, nothing else there (NaN and infinities as null)."""
    click.echo(json.dumps(_finite(doc), indent=1, default=str, allow_nan=False))


def _finite(doc: object) -> object:
    if isinstance(doc, float):
        return doc if math.isfinite(doc) else None
    if isinstance(doc, dict):
        return {k: _finite(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v) for v in doc]
    return doc


def read_secret(path: Path, flag: str) -> str:
    """A secret from a file, or a usage error that names ``flag``."""
    from blockflow.triton.access import read_secret

    try:
        return read_secret(path)
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint=flag) from None


# Top-level modules of the optional dependencies (pyproject.toml), and the extra that brings each.
_EXTRAS = {**dict.fromkeys(("torch", "torchvision", "zmq", "fastapi", "uvicorn", "psutil", "pynvml", "safetensors",
                            "prometheus_client", "matplotlib", "google"), "runtime"),
           "pytriton": "server", "cuda": "client"}


def _extra_for(module: str) -> str | None:
    return _EXTRAS.get(module.split(".")[0])


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the app, turning every expected error into one clear message."""
    if argv is None and len(sys.argv) == 1:
        argv = ["--help"]
    try:
        rv = app.main(args=argv, prog_name="blockflow", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.Abort:
        err.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        ctx = getattr(exc, "ctx", None)
        where = f" (see: blockflow {ctx.info_name} --help)" if ctx is not None and ctx.info_name != "blockflow" else " (see: blockflow --help)"
        err.print(f"blockflow: error: {exc.format_message()}{where}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
    except PlanError as exc:
        err.print(f"blockflow: {exc}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
    except BlockFlowError as exc:
        err.print(f"blockflow: error: {exc}", markup=False, highlight=False)
        sys.exit(exc.exit_code)
    except ModuleNotFoundError as exc:
        extra = _extra_for(exc.name or "")
        if extra is None:
            raise  # not an optional dependency: a bug, keep its traceback
        err.print(f"blockflow: error: this needs {exc.name}, which comes with the {extra!r} extra: "
                  f"pip install 'blockflow[{extra}]'", markup=False, highlight=False)
        sys.exit(EnvironmentProblem.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)

