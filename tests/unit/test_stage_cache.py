"""Built parts kept in the runtime directory: the next process loads them instead of building."""

from __future__ import annotations

import fcntl
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blockflow.backend import parts, stage_cache
from blockflow.backend.runtime import BlockRunner
from blockflow.backend.stage_cache import StageCache
from blockflow.core import arch, env
from blockflow.core.errors import EnvironmentProblem
from blockflow.core.spec import ModelSpec, Part, WeightsSource

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def _spec(seed: int = 4, first: int = 1) -> ModelSpec:
    return ModelSpec(kind="block", name="head", arch="resnet18", cut_points=("layer2",), num_classes=10,
                     input_shape=(3, 32, 32), parts=(Part(block="head", first=first, last=1, weights=WeightsSource(seed=seed)),),
                     precision="fp32", cuda_graphs=False, max_batch_size=4, transport="triton-cpu",
                     in_shape=(128, 4, 4), out_shape=(10,))


def test_a_kept_part_is_loaded_instead_of_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = StageCache(tmp_path / "stages")
    x = torch.randn(2, 128, 4, 4)
    built = BlockRunner(_spec(), CPU, cache).run(x)
    (entry,) = (tmp_path / "stages").glob("*.pt")
    assert entry.stat().st_mode & 0o777 == 0o600
    with monkeypatch.context() as m:
        m.setattr(arch, "build_network", lambda *a, **k: pytest.fail("built although kept"))
        assert torch.equal(BlockRunner(_spec(), CPU, cache).run(x), built)
    # Other weights are another entry; without a cache nothing is kept.
    assert not torch.equal(BlockRunner(_spec(seed=5), CPU, cache).run(x), built)
    assert len(list((tmp_path / "stages").glob("*.pt"))) == 2
    assert torch.equal(BlockRunner(_spec(), CPU).run(x), built)


def test_an_entry_that_is_damaged_or_writable_by_others_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = StageCache(tmp_path / "stages", keeps_networks=False)
    spec = _spec()
    part = spec.parts[0]
    x = torch.randn(1, 128, 4, 4)
    want = BlockRunner(spec, CPU, cache).run(x)
    path = cache.path(spec, part)
    path.chmod(0o666)
    assert cache.load(cache.path(spec, part)) is None
    path.chmod(0o600)
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert cache.load(cache.path(spec, part)) is None
    calls = []
    real = parts._build_part
    monkeypatch.setattr(parts, "_build_part", lambda s, p: calls.append(1) or real(s, p))
    assert torch.equal(BlockRunner(spec, CPU, cache).run(x), want) and calls == [1]  # built again, and kept again
    assert cache.load(cache.path(spec, part)) is not None


def test_loading_a_kept_resnet_part_does_not_import_torchvision(tmp_path: Path) -> None:
    cache = StageCache(tmp_path / "stages")
    BlockRunner(_spec(), CPU, cache)
    code = (
        "import sys, pathlib\n"
        "from blockflow.backend.stage_cache import StageCache\n"
        "from blockflow.core.spec import ModelSpec\n"
        f"cache = StageCache(pathlib.Path({str(tmp_path / 'stages')!r}))\n"
        f"spec = ModelSpec.model_validate_json({_spec().to_json()!r})\n"
        "assert cache.load(cache.path(spec, spec.parts[0])) is not None\n"
        "print('torchvision' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_key_holds_the_thread_count_and_the_build_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # mobilenet_v3_small's batch-norm statistics, drawn at build time, differ between one and two threads:
    # a GPU block process builds on one, a CPU one on several, and neither may load the other's part.
    cache = StageCache(tmp_path / "stages")
    spec = _spec()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cache.path(spec, spec.parts[0])
        torch.set_num_threads(2)
        assert cache.path(spec, spec.parts[0]) != one
    finally:
        torch.set_num_threads(threads)
    before = cache.path(spec, spec.parts[0])
    monkeypatch.setattr(stage_cache, "build_code_digest", lambda: "other code")
    assert cache.path(spec, spec.parts[0]) != before
    code = cache.path(spec, spec.parts[0])
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "OTHER")  # AVX2 and AVX-512 round differently
    assert cache.path(spec, spec.parts[0]) != code


def test_a_part_is_kept_under_the_key_of_the_bytes_it_was_built_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights file replaced while its part builds: the part goes under the old bytes' key, never the new one's."""
    old, new = tmp_path / "old.pt", tmp_path / "new.pt"
    for seed, path in ((4, old), (5, new)):
        torch.save(parts.build_part(_spec(seed=seed), _spec(seed=seed).parts[0]).state_dict(), path)
    weights = tmp_path / "head.pt"
    weights.write_bytes(old.read_bytes())
    spec = _spec()
    spec = spec.model_copy(update={"parts": (spec.parts[0].model_copy(update={"weights": WeightsSource(file=str(weights))}),)})
    cache = StageCache(tmp_path / "stages", keeps_networks=False)
    real = parts._build_part

    def build_then_replace(s: ModelSpec, p: Part) -> torch.nn.Module:
        built = real(s, p)
        weights.write_bytes(new.read_bytes())  # a checkpoint written over the file meanwhile
        return built

    monkeypatch.setattr(parts, "_build_part", build_then_replace)
    x = torch.randn(1, 128, 4, 4)
    BlockRunner(spec, CPU, cache).run(x)
    monkeypatch.setattr(parts, "_build_part", real)
    assert cache.load(cache.path(spec, spec.parts[0])) is None  # nothing under the new bytes' key
    assert torch.equal(BlockRunner(spec, CPU, cache).run(x), BlockRunner(spec, CPU).run(x))


def test_the_cache_directory_is_the_settings_and_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.STAGE_CACHE, raising=False)
    monkeypatch.delenv(env.STAGE_CACHE_DIR_VAR, raising=False)
    monkeypatch.delenv(env.RUNTIME_DIR, raising=False)
    assert StageCache.configured() is None  # outside a server
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv(env.RUNTIME_DIR, str(runtime))
    cache = StageCache.configured()
    assert cache is not None and cache.directory == runtime / "stages"
    kept = tmp_path / "kept"
    monkeypatch.setenv(env.STAGE_CACHE_DIR_VAR, str(kept))
    cache = StageCache.configured()
    assert cache is not None and cache.directory == kept and kept.stat().st_mode & 0o777 == 0o700
    kept.chmod(0o755)
    with pytest.raises(EnvironmentProblem, match="open to other users"):
        StageCache.configured()
    link = tmp_path / "link"
    link.symlink_to(runtime)
    monkeypatch.setenv(env.STAGE_CACHE_DIR_VAR, str(link))
    with pytest.raises(EnvironmentProblem, match="not a directory"):
        StageCache.configured()
    monkeypatch.setenv(env.STAGE_CACHE_DIR_VAR, "relative/stages")
    with pytest.raises(EnvironmentProblem, match="absolute path"):
        StageCache.configured()
    monkeypatch.setenv(env.STAGE_CACHE, "0")
    assert StageCache.configured() is None
    # The runtime directory's cache is best effort: one that others can open keeps nothing, and the block still builds.
    monkeypatch.delenv(env.STAGE_CACHE)
    monkeypatch.delenv(env.STAGE_CACHE_DIR_VAR)
    runtime.chmod(0o755)
    assert StageCache.configured() is None


def test_an_entry_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    cache = StageCache(tmp_path / "stages")
    spec = _spec()
    part = spec.parts[0]
    BlockRunner(spec, CPU, cache)
    path = cache.path(spec, part)
    elsewhere = tmp_path / "elsewhere.pt"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)
    assert cache.load(cache.path(spec, part)) is None
    path.unlink()
    elsewhere.rename(path)
    assert cache.load(cache.path(spec, part)) is not None


def _reference(seed: int = 4) -> ModelSpec:
    """resnet18 whole, as three parts of one seed (a reference's blocks)."""
    return ModelSpec(kind="block", name="ref", arch="resnet18", cut_points=("layer1", "layer3"), num_classes=10,
                     input_shape=(3, 32, 32), parts=tuple(Part(block=f"b{i}", first=i, last=i, weights=WeightsSource(seed=seed))
                                                          for i in range(3)),
                     precision="fp32", cuda_graphs=False, max_batch_size=4, transport="triton-cpu",
                     in_shape=(3, 32, 32), out_shape=(10,))


def test_a_network_cut_into_several_parts_is_built_once_and_gives_the_parts_a_fresh_build_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _reference()
    fresh = [parts._build_part(parts.part_spec(spec, p), p) for p in spec.parts]
    calls: list[str] = []
    real = arch.build_network
    monkeypatch.setattr(arch, "build_network", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    x = torch.randn(2, 3, 32, 32)
    # In one process without a cache (a reference's blocks): once.
    got = parts.build_parts(spec)
    assert calls == ["resnet18"]
    for a, b in zip(got, fresh, strict=True):
        x_a, x = a(x), b(x)
        assert torch.equal(x_a, x)
    # Across processes, through the cache: the first keeps the network, the next cuts other parts from it.
    cache = StageCache(tmp_path / "stages")
    parts.build_part(spec, spec.parts[0], cache)
    (kept,) = (tmp_path / "stages" / "networks").glob("*.pt")
    assert kept.stat().st_size > 0 and kept.stat().st_mode & 0o777 == 0o600
    calls.clear()
    last = parts.build_part(spec, spec.parts[2], cache)
    assert calls == []
    y = torch.randn(2, 256, 2, 2)
    assert torch.equal(last(y), fresh[2](y))


def test_processes_needing_one_network_wait_for_the_first_to_build_it(tmp_path: Path) -> None:
    import threading

    from blockflow.core.arch import trace

    cache = StageCache(tmp_path / "stages")
    built: list[int] = []

    def build() -> arch.Traced:
        built.append(1)
        time.sleep(0.5)
        return trace(arch.build_network("resnet18", 10, 4, (3, 32, 32)))

    key = ("resnet18", 10, (3, 32, 32), 4)
    got: list[arch.Traced] = []
    threads = [threading.Thread(target=lambda: got.append(cache.network(key, build))) for _ in range(3)]
    for t in threads:  # each its own lock file descriptor, as separate processes would have
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 3 and built == [1]


def test_a_network_that_cannot_be_kept_says_so_and_nobody_waits_for_it_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from blockflow.core.arch import trace

    cache = StageCache(tmp_path / "stages")
    key = ("resnet18", 10, (3, 32, 32), 4)
    built: list[int] = []

    def build() -> arch.Traced:
        built.append(1)
        return trace(arch.build_network("resnet18", 10, 4, (3, 32, 32)))

    monkeypatch.setattr(stage_cache, "MAX_BYTES", 1000)  # too large to keep
    cache.network(key, build)
    path = cache.network_path(key)
    assert path.stat().st_size == 0  # "not kept"
    lock = path.with_suffix(".lock")
    fd = os.open(lock, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another process holds the lock: this one must not wait for it
    try:
        t0 = time.monotonic()
        cache.network(key, build)
        assert time.monotonic() - t0 < 5 and built == [1, 1]
    finally:
        os.close(fd)
    # A damaged entry is a miss: built again and kept again.
    monkeypatch.setattr(stage_cache, "MAX_BYTES", 512 << 20)
    path.write_bytes(b"not a pickle")
    cache.network(key, build)
    assert built == [1, 1, 1] and path.stat().st_size > 100
    cache.network(key, build)
    assert built == [1, 1, 1]


def test_keeping_networks_is_best_effort(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from blockflow.core.arch import trace

    key = ("resnet18", 10, (3, 32, 32), 4)
    built: list[int] = []

    def build() -> arch.Traced:
        built.append(1)
        return trace(arch.build_network("resnet18", 10, 4, (3, 32, 32)))

    # A networks/ that is not a private directory: parts are still kept, networks are not.
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "networks").write_text("")
    assert not StageCache(tmp_path / "a").keeps_networks
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "networks").symlink_to(tmp_path)
    assert not StageCache(tmp_path / "b").keeps_networks
    # A write that fails now (a full disk: torch.save raises a RuntimeError for it) says so in the lock file only:
    # the next processes build theirs at once, without waiting for each other, until NOT_KEPT_LATELY_S passed.
    cache = StageCache(tmp_path / "stages")
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("[enforce fail at inline_container.cc]")))
    cache.network(key, build)
    path = cache.network_path(key)
    assert not path.exists() and float(path.with_suffix(".lock").read_text()) <= time.time()
    monkeypatch.setattr(torch, "save", real_save)
    cache.network(key, build)
    assert built == [1, 1] and not path.exists()  # built at once, not kept: the failure was lately
    monkeypatch.setattr(stage_cache, "NOT_KEPT_LATELY_S", 0.0)
    cache.network(key, build)
    cache.network(key, build)
    assert built == [1, 1, 1] and path.stat().st_size > 100
    # A kept network loads without the lock (another process holding it to build something else waits nobody).
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        cache.network(key, build)
        assert time.monotonic() - t0 < 5 and built == [1, 1, 1]
    finally:
        os.close(fd)
    # An unpicklable network is never kept (the empty file says so); a marker that cannot be written is not settled.
    third = ("resnet18", 10, (3, 32, 32), 6)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(pickle.PicklingError("a local function")))
    assert stage_cache._store_network(cache.network_path(third), build()) is True
    assert cache.network_path(third).stat().st_size == 0
    real_write = stage_cache.write_private_file
    monkeypatch.setattr(stage_cache, "write_private_file", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    assert stage_cache._store_network(cache.network_path(("resnet18", 10, (3, 32, 32), 7)), build()) is False
    monkeypatch.setattr(stage_cache, "write_private_file", real_write)
    monkeypatch.setattr(torch, "save", real_save)
    # No room on the file system: nothing kept, no empty file.
    assert stage_cache.has_room(tmp_path, 0) and not stage_cache.has_room(tmp_path, 1 << 60)
    other = ("resnet18", 10, (3, 32, 32), 5)
    monkeypatch.setattr(stage_cache, "has_room", lambda d, n: False)
    cache.network(other, build)
    assert not cache.network_path(other).exists()
    # A temporary file of a process that died while saving goes (also in earlier versions' naming); a live
    # one's stays, and so do names this cache does not write.
    digest = "0123456789abcdef" * 2
    gone = subprocess.Popen(["true"])
    gone.wait()
    pid = gone.pid  # of a process that ended
    dead = [cache.directory / f".{digest}.pt.{n}" for n in (f"{pid}.0123abcd.tmp", f"{pid}.tmp", f"{pid}")]
    live = cache.directory / f".{digest}.pt.{os.getpid()}.0123abcd.tmp"
    others = [cache.directory / n for n in (f".backup.{pid}.0123abcd.tmp", f".notes.pt.{pid}.0123abcd.tmp",
                                            f".{digest}.lock.pt.{pid}.0123abcd.tmp", f".{digest}.pt.²³.0123abcd.tmp",
                                            f".{digest}.pt.20241130120000.0123abcd.tmp")]
    for f in (*dead, live, *others):
        f.write_bytes(b"x")
    StageCache(cache.directory)
    assert not any(f.exists() for f in dead) and live.exists() and all(f.exists() for f in others)
