"""The argv-key library, built with the machine's C compiler and preloaded into a real process
(python3 standing in for tritonserver: both take their arguments from glibc's argv)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from blockflow.core.errors import EnvironmentProblem
from blockflow.triton import argv_key

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")

# Prints what main got, what /proc shows of the command line, and what its children would inherit.
SHOW = ("import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
        "'cmdline': open('/proc/self/cmdline', 'rb').read().decode().split(chr(0))[3:-1], "
        "'env': {k: v for k, v in os.environ.items() if k in ('LD_PRELOAD', "
        f"{argv_key.KEY_FILE_VAR!r}, {argv_key.PRELOAD_VAR!r})}}}}))")


@pytest.fixture
def lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    argv_key.shim.cache_clear()
    built = argv_key.shim()
    assert built is not None and built.parent == tmp_path / "cache" / "blockflow" / "argv-key"
    yield built
    argv_key.shim.cache_clear()


def run(lib: Path, key_file: Path | None, *args: str, base: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = argv_key.server_env(dict(base if base is not None else os.environ), lib, key_file)
    return subprocess.run([sys.executable, "-c", SHOW, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def test_the_key_reaches_main_and_never_the_command_line(lib: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text("s3cret-key_0123\n")
    key_file.chmod(0o600)
    res = run(lib, key_file, f"--http-restricted-api=model-repository:h={argv_key.PLACEHOLDER}", "--other=1")
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen["argv"] == ["--http-restricted-api=model-repository:h=s3cret-key_0123", "--other=1"]
    assert seen["cmdline"] == [f"--http-restricted-api=model-repository:h={argv_key.PLACEHOLDER}", "--other=1"]
    assert seen["env"] == {}  # neither the library nor the key file's name goes on to the server's children


def test_without_a_key_file_a_random_key_nobody_has(lib: Path) -> None:
    keys = []
    for _ in range(2):
        res = run(lib, None, f"--k={argv_key.PLACEHOLDER}", f"--g={argv_key.PLACEHOLDER}")
        assert res.returncode == 0, res.stderr
        a, g = json.loads(res.stdout)["argv"]
        assert a[4:] == g[4:] and len(a[4:]) == 64 and argv_key.PLACEHOLDER not in a  # one key per process
        keys.append(a)
    assert keys[0] != keys[1]


def test_the_users_own_preload_goes_on_to_the_children(lib: Path) -> None:
    theirs = str(lib)  # any library that loads; what matters is that it is given back
    res = run(lib, None, "--x", base={**os.environ, "LD_PRELOAD": theirs})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["env"] == {"LD_PRELOAD": theirs}


@pytest.mark.parametrize("content", [None, "", "\n", argv_key.PLACEHOLDER])
def test_a_key_that_cannot_be_read_stops_the_process_before_main(lib: Path, tmp_path: Path, content: str | None) -> None:
    key_file = tmp_path / "admin.key"
    if content is not None:
        key_file.write_text(content)
    res = run(lib, key_file, f"--k={argv_key.PLACEHOLDER}")
    assert res.returncode == 78 and res.stdout == ""
    assert "blockflow argv-key:" in res.stderr and "tritonserver does not start" in res.stderr


def test_the_library_and_blockflow_spell_the_placeholder_and_variables_alike() -> None:
    source = argv_key.SOURCE.read_text()
    for name in (argv_key.PLACEHOLDER, argv_key.KEY_FILE_VAR, argv_key.PRELOAD_VAR):
        assert f'"{name}"' in source


def test_arguments_without_the_placeholder_need_no_key(lib: Path, tmp_path: Path) -> None:
    res = run(lib, tmp_path / "absent.key", "--plain")
    assert res.returncode == 0 and json.loads(res.stdout)["argv"] == ["--plain"]


def test_a_library_another_user_could_replace_is_refused(lib: Path) -> None:
    lib.chmod(0o777)
    argv_key.shim.cache_clear()
    with pytest.raises(Exception, match="not private"):
        argv_key.shim()


def test_the_cache_is_made_private_whatever_the_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "blockflow").mkdir(parents=True, mode=0o777)
    (tmp_path / "cache" / "blockflow").chmod(0o777)
    argv_key.shim.cache_clear()
    try:
        assert argv_key.shim() is not None
    finally:
        argv_key.shim.cache_clear()
    for d in (tmp_path / "cache" / "blockflow", tmp_path / "cache" / "blockflow" / "argv-key"):
        assert d.stat().st_mode & 0o777 == 0o700


def test_without_a_compiler_the_key_stays_on_the_command_line_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.delenv("CC", raising=False)
    argv_key.shim.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert argv_key.shim() is None
        assert "other local users can read in /proc" in caplog.text
    finally:
        argv_key.shim.cache_clear()


def dockerfile_build_line() -> str:
    """The shell command the image's argv-key stage builds the library with."""
    text = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    lines = [line.removeprefix("RUN ") for line in text.splitlines() if line.startswith("RUN ") and "argv_key.so" in line]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def prebuilt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The library built ahead of time as the image builds it (its RUN line, in bash), named by BLOCKFLOW_ARGV_KEY_LIB."""
    if shutil.which("gcc") is None:
        pytest.skip("the image's stage builds with gcc")
    build = tmp_path / "build"
    build.mkdir()
    shutil.copy(argv_key.SOURCE, build / "argv_key.c")
    res = subprocess.run(["bash", "-o", "pipefail", "-c", dockerfile_build_line()], cwd=build, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    monkeypatch.setenv(argv_key.LIB_VAR, str(build / "argv_key.so"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-cache"))  # nothing is built or read there
    argv_key.shim.cache_clear()
    yield build / "argv_key.so"
    argv_key.shim.cache_clear()


def test_a_library_built_as_the_image_builds_it_is_preloaded(prebuilt: Path, tmp_path: Path) -> None:
    lib = argv_key.shim()
    assert lib == prebuilt.resolve() and not (tmp_path / "no-cache").exists()
    key_file = tmp_path / "admin.key"
    key_file.write_text("image-key\n")
    res = run(lib, key_file, f"--k={argv_key.PLACEHOLDER}")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["argv"] == ["--k=image-key"]


def test_a_named_library_built_from_another_source_is_refused(prebuilt: Path) -> None:
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(prebuilt), str(argv_key.SOURCE)], check=True, timeout=120)
    with pytest.raises(EnvironmentProblem, match=r"another argv_key.c \(ID unversioned\).*build it with: cc .*-DARGV_KEY_ID="):
        argv_key.shim()


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_named_library_other_users_could_replace_is_refused(prebuilt: Path, what: str) -> None:
    (prebuilt if what == "file" else prebuilt.parent).chmod(0o777)
    with pytest.raises(EnvironmentProblem, match="writable by other users"):
        argv_key.shim()


def test_a_named_library_that_is_missing_is_refused(prebuilt: Path) -> None:
    prebuilt.unlink()
    with pytest.raises(EnvironmentProblem, match=f"{argv_key.LIB_VAR}=.*No such file"):
        argv_key.shim()
