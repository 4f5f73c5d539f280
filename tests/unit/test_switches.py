"""The behaviour switches (``blockflow.core.env.SWITCHES``): a value one does not take stops the server's start,
naming the variable, instead of running the default without a word."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockflow.core import env
from blockflow.core.errors import EnvironmentProblem

ROOT = Path(__file__).resolve().parents[2]


def test_every_switch_says_which_values_it_takes() -> None:
    assert set(env.SWITCH_VALUES) == set(env.SWITCHES)
    assert all(len(values) >= 2 and len(set(values)) == len(values) for values in env.SWITCH_VALUES.values())


def test_unset_empty_and_listed_values_are_fine_and_any_other_is_named() -> None:
    assert env.switch_problems({}) == []
    assert env.switch_problems({name: values[-1] for name, values in env.SWITCH_VALUES.items()}) == []
    assert env.switch_problems({env.TMQ_EARLY: "", env.CUDA_SCHEDULE: "blocking", "BLOCKFLOW_OTHER": "x"}) == []
    assert env.switch_problems({env.TMQ_EARLY: "off", env.CUDA_SCHEDULE: "Blocking"}) == [
        "BLOCKFLOW_TMQ_EARLY='off' is not one of 1, 0 (its default: 1)",
        "BLOCKFLOW_CUDA_SCHEDULE='Blocking' is not one of auto, spin, yield, blocking (its default: auto)",
    ]


def test_the_server_refuses_to_start_before_it_starts_anything(tmp_path: Path) -> None:
    from blockflow.triton.server import ServerOptions, TritonServer

    server = TritonServer(ServerOptions(repositories=[tmp_path], env={env.TMQ_RELEASE: "messages"}), runtime_dir=tmp_path,
                          install=object())  # type: ignore[arg-type]  # never reached
    with pytest.raises(EnvironmentProblem, match="BLOCKFLOW_TMQ_RELEASE='messages' is not one of table, message"):
        server.start()
    assert not server.log_path.exists()


def test_serve_says_so_in_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "blockflow", "serve", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
                         env={**os.environ, env.GRAPH_BUCKETS: "quarters"})
    assert res.returncode == EnvironmentProblem.exit_code and "Traceback" not in res.stderr, res.stderr
    assert "BLOCKFLOW_GRAPH_BUCKETS='quarters' is not one of pow2, quarter (its default: pow2)" in res.stderr
