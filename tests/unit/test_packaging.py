"""The wheel carries what a user of the packages needs: type hints (PEP 561) and the license."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_has_py_typed_in_every_package_and_the_license(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                          str(ROOT)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    (wheel,) = tmp_path.glob("blockflow-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package in ("blockflow", "backend", "ensemble_gen", "clients", "bench"):
        assert f"{package}/py.typed" in names, package
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
