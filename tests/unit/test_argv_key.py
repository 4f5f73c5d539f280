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
        f"{argv_key.ADMIN_KEY_FILE_VAR!r}, {argv_key.SHM_KEY_FILE_VAR!r}, {argv_key.PRELOAD_VAR!r})}}}}))")


@pytest.fixture
def lib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    clear()
    built = argv_key.library()
    assert built is not None and built.parent == tmp_path / "cache" / "blockflow" / "argv-key"
    yield built
    clear()


def clear() -> None:
    """Forget the library found (both lookups are cached for the process's life)."""
    argv_key.find.cache_clear()
    argv_key.library.cache_clear()


def run(lib: Path, key_file: Path | None, *args: str, base: dict[str, str] | None = None,
        shm_key_file: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = argv_key.preload_env(dict(base if base is not None else os.environ), lib, key_file, shm_key_file)
    return subprocess.run([sys.executable, "-c", SHOW, *args], capture_output=True, text=True, env=env, timeout=60, check=False)


def test_the_key_reaches_main_and_never_the_command_line(lib: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "admin.key"
    key_file.write_text("s3cret-key_0123\n")
    key_file.chmod(0o600)
    res = run(lib, key_file, f"--http-restricted-api=model-repository:h={argv_key.ADMIN_PLACEHOLDER}", "--other=1")
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen["argv"] == ["--http-restricted-api=model-repository:h=s3cret-key_0123", "--other=1"]
    assert seen["cmdline"] == [f"--http-restricted-api=model-repository:h={argv_key.ADMIN_PLACEHOLDER}", "--other=1"]
    assert seen["env"] == {}  # neither the library nor the key file's name goes on to the server's children


def test_each_key_replaces_its_own_placeholder(lib: Path, tmp_path: Path) -> None:
    for name, text in (("admin.key", "the-admin-key"), ("shm.key", "the-shm-key")):
        (tmp_path / name).write_text(text + "\n")
    res = run(lib, tmp_path / "admin.key", f"--a=h:{argv_key.ADMIN_PLACEHOLDER}", f"--s=h:{argv_key.SHM_PLACEHOLDER}",
              f"--a2={argv_key.ADMIN_PLACEHOLDER}", shm_key_file=tmp_path / "shm.key")
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    assert seen["argv"] == ["--a=h:the-admin-key", "--s=h:the-shm-key", "--a2=the-admin-key"]
    assert seen["env"] == {}  # neither key file's name goes on to the children


def test_without_a_key_file_a_random_key_nobody_has(lib: Path) -> None:
    keys = []
    for _ in range(2):
        res = run(lib, None, f"--k={argv_key.ADMIN_PLACEHOLDER}", f"--g={argv_key.ADMIN_PLACEHOLDER}")
        assert res.returncode == 0, res.stderr
        a, g = json.loads(res.stdout)["argv"]
        assert a[4:] == g[4:] and len(a[4:]) == 64 and argv_key.ADMIN_PLACEHOLDER not in a  # one key per process
        keys.append(a)
    assert keys[0] != keys[1]
    res = run(lib, None, f"--k={argv_key.ADMIN_PLACEHOLDER}", f"--k={argv_key.SHM_PLACEHOLDER}")
    admin, shm = json.loads(res.stdout)["argv"]
    assert len(shm[4:]) == 64 and admin != shm  # the shared-memory key is not the admin key


def test_the_users_own_preload_goes_on_to_the_children(lib: Path) -> None:
    theirs = str(lib)  # any library that loads; what matters is that it is given back
    res = run(lib, None, "--x", base={**os.environ, "LD_PRELOAD": theirs})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["env"] == {"LD_PRELOAD": theirs}


@pytest.mark.parametrize("content", [None, "", "\n", argv_key.ADMIN_PLACEHOLDER])
def test_a_key_that_cannot_be_read_stops_the_process_before_main(lib: Path, tmp_path: Path, content: str | None) -> None:
    key_file = tmp_path / "admin.key"
    if content is not None:
        key_file.write_text(content)
    res = run(lib, key_file, f"--k={argv_key.ADMIN_PLACEHOLDER}")
    assert res.returncode == 78 and res.stdout == ""
    assert "blockflow argv-key:" in res.stderr and "tritonserver does not start" in res.stderr


def test_the_library_and_blockflow_spell_the_placeholder_and_variables_alike() -> None:
    source = argv_key.SOURCE.read_text()
    for name in (argv_key.ADMIN_PLACEHOLDER, argv_key.SHM_PLACEHOLDER, argv_key.ADMIN_KEY_FILE_VAR,
                 argv_key.SHM_KEY_FILE_VAR, argv_key.PRELOAD_VAR):
        assert f'"{name}"' in source


def test_arguments_without_the_placeholder_need_no_key(lib: Path, tmp_path: Path) -> None:
    res = run(lib, tmp_path / "absent.key", "--plain")
    assert res.returncode == 0 and json.loads(res.stdout)["argv"] == ["--plain"]


def test_a_library_another_user_could_replace_is_refused(lib: Path) -> None:
    lib.chmod(0o777)
    clear()
    with pytest.raises(EnvironmentProblem, match="not private"):
        argv_key.library()


def test_the_cache_is_made_private_whatever_the_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "cache" / "blockflow").mkdir(parents=True, mode=0o777)
    (tmp_path / "cache" / "blockflow").chmod(0o777)
    clear()
    try:
        assert argv_key.library() is not None
    finally:
        clear()
    for d in (tmp_path / "cache" / "blockflow", tmp_path / "cache" / "blockflow" / "argv-key"):
        assert d.stat().st_mode & 0o777 == 0o700


@pytest.fixture
def no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.delenv(argv_key.ALLOW_VAR, raising=False)
    monkeypatch.setattr(argv_key, "hides_other_users", lambda mountinfo: False)  # this machine's /proc may hide them
    clear()
    yield
    clear()


def test_without_a_library_the_key_is_refused_the_command_line(no_compiler: None) -> None:
    with pytest.raises(EnvironmentProblem, match=r"no C compiler .* every local user can read .*fix: install a C compiler"
                       rf".*{argv_key.LIB_VAR}.*hidepid=2.*{argv_key.ALLOW_VAR}=1 accepts it"):
        argv_key.library()


def test_the_operator_may_accept_the_key_on_the_command_line(no_compiler: None, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(argv_key.ALLOW_VAR, "1")
    with caplog.at_level(logging.WARNING):
        assert argv_key.library() is None
    assert "other local users can read in /proc" in caplog.text


# /proc/self/mountinfo lines: the fields before " - " end with the mount point's options, after it the
# file system, its source and the superblock's options (where hidepid is).
MOUNT = "25 30 0:23 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw{}\n"
OTHER = "26 25 0:24 / /sys rw,nosuid shared:7 - sysfs sysfs rw\n"


@pytest.mark.parametrize(("options", "hidden"), [("", False), (",hidepid=0", False), (",hidepid=off", False),
                                                  (",hidepid=2", True), (",hidepid=invisible", True),
                                                  (",hidepid=1", True), (",hidepid=ptraceable,subset=pid", True)])
def test_proc_hides_other_users_only_with_hidepid(options: str, hidden: bool) -> None:
    assert argv_key.hides_other_users(OTHER + MOUNT.format(options)) is hidden


def test_of_two_proc_mounts_the_last_counts() -> None:
    assert argv_key.hides_other_users(MOUNT.format("") + OTHER + MOUNT.format(",hidepid=2"))
    assert not argv_key.hides_other_users(MOUNT.format(",hidepid=2") + MOUNT.format(""))


def test_where_proc_hides_other_users_the_key_may_go_on_the_command_line(no_compiler: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(argv_key, "hides_other_users", lambda mountinfo: "/proc" in mountinfo)  # the real mount table
    assert argv_key.library() is None


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
    for source in argv_key.SOURCES:
        shutil.copy(source, build / source.name)
    res = subprocess.run(["bash", "-o", "pipefail", "-c", dockerfile_build_line()], cwd=build, capture_output=True, text=True,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    monkeypatch.setenv(argv_key.LIB_VAR, str(build / "argv_key.so"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-cache"))  # nothing is built or read there
    clear()
    yield build / "argv_key.so"
    clear()


def test_a_library_built_as_the_image_builds_it_is_preloaded(prebuilt: Path, tmp_path: Path) -> None:
    lib = argv_key.library()
    assert lib == prebuilt.resolve() and not (tmp_path / "no-cache").exists()
    key_file = tmp_path / "admin.key"
    key_file.write_text("image-key\n")
    res = run(lib, key_file, f"--k={argv_key.ADMIN_PLACEHOLDER}")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["argv"] == ["--k=image-key"]


def test_a_named_library_built_from_another_source_is_refused(prebuilt: Path) -> None:
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", str(prebuilt), *map(str, argv_key.SOURCES)], check=True, timeout=120)
    with pytest.raises(EnvironmentProblem, match=r"other sources \(ID unversioned\).*build it with: cc .*-DARGV_KEY_ID="):
        argv_key.library()


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_named_library_other_users_could_replace_is_refused(prebuilt: Path, what: str) -> None:
    (prebuilt if what == "file" else prebuilt.parent).chmod(0o777)
    with pytest.raises(EnvironmentProblem, match="writable by other users"):
        argv_key.library()


def test_a_named_library_that_is_missing_is_refused(prebuilt: Path) -> None:
    prebuilt.unlink()
    with pytest.raises(EnvironmentProblem, match=f"{argv_key.LIB_VAR}=.*No such file"):
        argv_key.library()


# What the guard lets a process do with /dev/shm, seen from python3 with the library preloaded: shm_open through
# _posixshmem (as Triton's shared-memory manager calls it), fchmod as Boost.Interprocess calls it after creating.
GUARD = """
import _posixshmem, json, os, sys, tempfile
out = {}
for name in sys.argv[1:]:
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
        os.close(fd)
        out[name] = "opened"
    except PermissionError:
        out[name] = "refused"
fd = _posixshmem.shm_open("/blockflow-guard-" + str(os.getpid()), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
os.fchmod(fd, 0o644)
out["created"] = oct(os.fstat(fd).st_mode & 0o777)
os.close(fd)
_posixshmem.shm_unlink("/blockflow-guard-" + str(os.getpid()))
with tempfile.NamedTemporaryFile() as f:
    os.fchmod(f.fileno(), 0o644)
    out["plain file"] = oct(os.fstat(f.fileno()).st_mode & 0o777)
print(json.dumps(out))
"""


def test_the_guard_keeps_server_regions_out_of_reach_and_private(lib: Path) -> None:
    from multiprocessing import shared_memory

    from blockflow.triton.access import SERVER_SHM_PREFIXES

    names = [f"{p}guard-test-{os.getpid()}" for p in SERVER_SHM_PREFIXES] + [f"client-region-{os.getpid()}"]
    regions = [shared_memory.SharedMemory(n, create=True, size=4096) for n in names]
    try:
        res = subprocess.run([sys.executable, "-c", GUARD, *names, f"//{names[0]}"], capture_output=True, text=True,
                             env=argv_key.preload_env(dict(os.environ), lib, None), timeout=60, check=False)
    finally:
        for r in regions:
            r.close()
            r.unlink()
    assert res.returncode == 0, res.stderr
    seen = json.loads(res.stdout)
    # A server's regions (any name with one of its prefixes, however many slashes lead) cannot be opened, a client's can.
    assert [seen[n] for n in names] == ["refused"] * len(SERVER_SHM_PREFIXES) + ["opened"]
    assert seen[f"//{names[0]}"] == "refused"
    assert seen["created"] == "0o600" and seen["plain file"] == "0o644"  # only /dev/shm files lose group and other bits


def test_the_guard_and_blockflow_spell_the_server_prefixes_alike() -> None:
    from blockflow.core import env
    from blockflow.triton.access import SERVER_SHM_PREFIXES

    source = argv_key.SOURCES[1].read_text()
    assert "{" + ", ".join(f'"{p}"' for p in SERVER_SHM_PREFIXES) + "}" in source
    # Every region BlockFlow makes starts with one of them.
    assert env.stub_shm_prefix(1, Path("/r")).startswith(SERVER_SHM_PREFIXES) and env.pool_shm_prefix(Path("/r")).startswith(
        SERVER_SHM_PREFIXES)
