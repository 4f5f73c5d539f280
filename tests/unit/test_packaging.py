"""The wheel is complete: one `blockflow` package, type hints (PEP 561), the license, the plans,
calibration and dashboard as package data; installed into a fresh virtual environment (no checkout in
reach), it validates its own default plan, passes `blockflow doctor` and serves a plan whose block
processes run from the wheel; its base install (the client) needs no torch."""

from __future__ import annotations

import fnmatch
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from blockflow.core.env import NGINX
from blockflow.triton.front_door import find_nginx
from blockflow.triton.options import free_port

from ..conftest import Served

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ["blockflow/data/plans/default.yaml", "blockflow/data/plans/bench_r50.yaml", "blockflow/data/plans/examples/skipnet.yaml",
           "blockflow/data/plans/examples/shared_backbone.yaml",
           "blockflow/data/calibration/h100.json", "blockflow/data/grafana/blockflow.json", "blockflow/clients/imagenet_classes.txt",
           "blockflow/triton/argv_key.c"]


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Whether .dockerignore's ``patterns`` leave ``rel`` out of the build context: a pattern that matches the
    path or any folder above it (Docker's rule; ``**`` matches any number of folders)."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        if any(fnmatch.fnmatchcase(p, pattern) for p in prefixes):
            return True
        if pattern.startswith("**/") and any(fnmatch.fnmatchcase(part, bare) for part in parts):
            return True
    return False


def docker_context(dest: Path) -> Path:
    """What the Dockerfile's last stage copies, as ``docker build`` would send it: the sources of its COPY lines
    (not those ``--from`` another stage), less what .dockerignore leaves out; links stay links. Returns ``dest``."""
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    last_stage = max(i for i, line in enumerate(lines) if line.startswith("FROM "))
    sources = [src for line in lines[last_stage:] if line.startswith("COPY ") and "--from=" not in line
               for src in line.split()[1:-1]]
    patterns = [p.strip().rstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    assert sources, "no COPY line in the Dockerfile's last stage"
    for src in sources:
        top = ROOT / src.rstrip("/")
        for path in [top, *sorted(top.rglob("*"))] if top.is_dir() and not top.is_symlink() else [top]:
            rel = path.relative_to(ROOT).as_posix()
            if _ignored(rel, patterns):
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if path.is_symlink():
                target.symlink_to(os.readlink(path))
            elif path.is_dir():
                target.mkdir(exist_ok=True)
            else:
                shutil.copy2(path, target)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The wheel built from exactly what the image's install step has: its build context (docker_context)."""
    context = docker_context(tmp_path_factory.mktemp("context"))
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(context)],
                         capture_output=True, text=True, timeout=300, cwd=out)
    assert res.returncode == 0, res.stderr[-2000:]
    (found,) = out.glob("blockflow-*.whl")
    yield found


def test_the_build_context_is_what_the_dockerfile_copies_less_dockerignore(tmp_path: Path) -> None:
    context = docker_context(tmp_path / "context")
    assert (context / "pyproject.toml").is_file() and (context / "blockflow" / "data" / "calibration" / "h100.json").is_file()
    assert not (context / "tests").exists() and not (context / "bench" / "results").exists()
    assert not list(context.rglob("__pycache__"))
    assert (context / "blockflow" / "backend").is_symlink()


def test_the_wheel_has_one_package_py_typed_the_license_and_the_shipped_files(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    # One top-level name in site-packages: the source folders backend/, bench/, ... install as blockflow.*.
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"blockflow"}
    assert "blockflow/py.typed" in names  # PEP 561: it covers the subpackages
    for package in ("blockflow/backend", "blockflow/backend/tensormq", "blockflow/ensemble_gen", "blockflow/clients", "blockflow/bench"):
        assert f"{package}/__init__.py" in names, package
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert set(SHIPPED) <= names
    assert "blockflow/bench/data/images/grace_hopper.jpg" in names  # perf_analyzer's real images for encoded tasks
    assert not [n for n in names if n.endswith((".pt2", ".safetensors", ".pyc"))], "built or generated files in the wheel"


@pytest.fixture
def fresh_venv(tmp_path: Path) -> Iterator[Path]:
    """A new virtual environment's bin/, removed afterwards (with torch it holds several GB)."""
    where = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(where)
    try:
        yield where / "bin"
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _user_env(bin_dir: Path) -> dict[str, str]:
    """A user's shell: this venv first on PATH, nothing of the checkout importable, and the machine's nginx (the
    HTTP front door; no wheel carries it): the one this checkout's setup installed."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    nginx = find_nginx()
    assert nginx is not None, "run ./scripts/setup.sh: it installs nginx"
    env[NGINX] = str(nginx)
    return env


def _run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = _user_env(bin_dir)
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, timeout=1200, cwd=cwd, env=env)


def _server_closure(wheel: Path) -> list[importlib.metadata.Distribution]:
    """The distributions ``wheel[server]`` requires, directly or not, as this checkout's environment has them
    (scripts/setup.sh installed it from the same pyproject); blockflow itself and what only ``dev`` needs are not among them."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    own = [Requirement(line.split(":", 1)[1].strip()) for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    todo = [(r, "server") for r in own]
    found: dict[str, importlib.metadata.Distribution] = {}
    wanted = {("blockflow", "server")}
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name == "blockflow":  # blockflow[client] inside blockflow[runtime]: its extras' requirements
            for e in req.extras - {x for n, x in wanted if n == name}:
                wanted.add((name, e))
                todo += [(r, e) for r in own]
            continue
        dist = found.get(name) or importlib.metadata.distribution(req.name)
        new_extras = [e for e in ["", *sorted(req.extras)] if (name, e) not in wanted]
        found[name] = dist
        for e in new_extras:
            wanted.add((name, e))
            todo += [(Requirement(r), e) for r in dist.requires or []]
    return list(found.values())


def _take_dependencies_from_this_environment(wheel: Path, bin_dir: Path, where: Path) -> None:
    """Make ``wheel[server]``'s dependencies, and only those, visible to the fresh venv without downloading
    them again (several GB with torch): links to their files in this environment's site-packages, in a
    folder the venv's site-packages names in a .pth file, and their non-Python programs (perf_analyzer) in its
    bin/. blockflow itself is not among them: the venv installs it from the wheel, and pip (with --no-index)
    must find every requirement of blockflow[server] among these or fail."""
    deps = where / "deps" / "site-packages"  # "site-packages" in its name: serve gives the block processes its roots
    deps.mkdir(parents=True)
    site_dir = Path(str(importlib.metadata.distribution("torch").locate_file("")))
    for dist in _server_closure(wheel):
        for f in dist.files or []:
            if f.parts[0] == "..":
                program = site_dir / f
                if f.parts[:4] == ("..", "..", "..", "bin") and program.is_file() and not (bin_dir / program.name).exists() \
                        and b"python" not in program.read_bytes()[:200].split(b"\n")[0]:
                    # The wheel's own binary: scripts/setup.sh moved perf_analyzer to libexec/ and wraps it.
                    shipped = Path(sys.prefix) / "libexec" / program.name
                    (bin_dir / program.name).symlink_to(shipped if shipped.is_file() else program.resolve())
            elif f.parts[0] != "__pycache__" and not (deps / f.parts[0]).exists():
                (deps / f.parts[0]).symlink_to(site_dir / f.parts[0])
    (site,) = (bin_dir.parent / "lib").glob("python*/site-packages")
    (site / "_blockflow_test_dependencies.pth").write_text(f"{deps}\n")
    # The venv's own setuptools (ensurepip's) is older than torch asks for and would hide the linked one:
    # pip would replace it from the index; here pip removes it, and the linked one counts.
    res = _run(bin_dir, "pip", "uninstall", "-q", "-y", "setuptools", cwd=where)
    assert res.returncode == 0, res.stderr[-3000:]


def test_installed_in_a_fresh_venv_it_validates_passes_doctor_and_serves(wheel: Path, fresh_venv: Path, tmp_path: Path) -> None:
    bin_dir = fresh_venv
    _take_dependencies_from_this_environment(wheel, bin_dir, tmp_path)
    res = _run(bin_dir, "pip", "install", "-q", "--no-index", f"{wheel}[server]", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _run(bin_dir, "blockflow", "--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("blockflow, version "), res.stdout + res.stderr
    where = _run(bin_dir, "python", "-c", "from blockflow.core.shipped import shipped; print(shipped('plans/default.yaml'))", cwd=tmp_path)
    default = Path(where.stdout.strip())
    assert str(tmp_path / "venv") in str(default) and default.is_file(), where.stdout + where.stderr
    res = _run(bin_dir, "blockflow", "validate", str(default), cwd=tmp_path)
    assert res.returncode == 0 and "is valid" in res.stdout, res.stdout + res.stderr
    res = _run(bin_dir, "blockflow", "doctor", cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    res = _run(bin_dir, "blockflow", "plan-memory", str(default), "--gpus", "1", cwd=tmp_path)
    assert res.returncode == 0 and "calibration: fitted to" in res.stdout, res.stdout + res.stderr  # the shipped calibration
    _serve_and_infer(bin_dir, tmp_path)


def _serve_and_infer(bin_dir: Path, where: Path) -> None:
    """`blockflow serve` from the venv: Triton's stubs import the block runtime from the wheel's blockflow.backend."""
    plan = where / "one_block.yaml"
    plan.write_text((ROOT / "tests" / "plans" / "one_block.yaml").read_text())
    http_port = free_port()
    env = _user_env(bin_dir)
    log = where / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([str(bin_dir / "blockflow"), "serve", "--plan", str(plan), "--http-port", str(http_port),
                                 "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--control-port", str(free_port()),
                                 "--repository", str(where / "repo")],
                                stdout=out, stderr=subprocess.STDOUT, cwd=where, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not _ready(http_port):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        res = _run(bin_dir, "blockflow", "infer", "only", "--random", "--url", f"127.0.0.1:{http_port}", cwd=where)
        # Nothing of the checkout is on the stubs' path (no PYTHONPATH, cwd elsewhere): they ran the wheel's code.
        assert res.returncode == 0 and "latency" in res.stdout, res.stdout + res.stderr
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready(http_port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.integration
def test_the_client_install_needs_no_torch_takes_numpy_2_and_answers(wheel: Path, fresh_venv: Path, tmp_path: Path,
                                                                    served: Served) -> None:
    bin_dir = fresh_venv
    res = _run(bin_dir, "pip", "install", "-q", f"{wheel}[client]", "numpy>=2", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _run(bin_dir, "python", "-c", "import numpy, tritonclient; print(numpy.__version__)", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.startswith("2."), res.stdout + res.stderr
    # A task of the session's server answers this client, over HTTP and gRPC.
    for url, protocol in ((served.http, "http"), (served.grpc, "grpc")):
        res = _run(bin_dir, "blockflow", "infer", "p_one", "--random", "--url", url, "--protocol", protocol, cwd=tmp_path)
        assert res.returncode == 0 and "latency" in res.stdout, res.stdout + res.stderr
    res = _run(bin_dir, "python", "-c", "import importlib.util as u; print(u.find_spec('torch') is None)", cwd=tmp_path)
    assert res.stdout.strip() == "True"
    code = ("from blockflow.clients.client import TaskClient; from blockflow.clients.images import class_names; "
            "assert len(class_names(1000)) == 1000; print('client ok')")
    res = _run(bin_dir, "python", "-c", code, cwd=tmp_path)
    assert res.stdout.strip() == "client ok", res.stderr
    res = _run(bin_dir, "blockflow", "infer", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    where = _run(bin_dir, "python", "-c", "from blockflow.core.shipped import shipped; print(shipped('plans/default.yaml'))", cwd=tmp_path)
    res = _run(bin_dir, "blockflow", "validate", where.stdout.strip(), cwd=tmp_path)
    assert res.returncode == 3 and "pip install 'blockflow[runtime]'" in res.stderr, res.stdout + res.stderr


def test_one_python_range_everywhere() -> None:
    """pyproject's requires-python, the versions scripts/setup.sh accepts, the install doc's words and the stub's hint agree."""
    found = re.search(r'^requires-python = ">=3\.(\d+),<3\.(\d+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found is not None, "requires-python is not of the form >=3.X,<3.Y"
    low, high = found.groups()
    minors = list(range(int(low), int(high)))
    span = f"3.{minors[0]}-3.{minors[-1]}"
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert f"case \"$PYVER\" in {'|'.join(f'3.{m}' for m in minors)})" in setup
    assert f"needs Python {span}" in setup
    assert f"Python {span.replace('-', '–')}" in (ROOT / "docs" / "serving.md").read_text()  # *Setting up*
    assert f"use Python {span}" in (ROOT / "blockflow" / "triton" / "install.py").read_text()
    assert all(f"3.{m}" in {"3.8", "3.9", "3.10", "3.11", "3.12", "3.13"} for m in minors)  # stubs nvidia-pytriton ships


def test_results_are_data_and_investigations_stay_out_of_the_wheel(wheel: Path) -> None:
    """bench/results holds results, not code (git keeps the scripts of past experiments); bench/lab holds investigations,
    run from a checkout. The build context has both packages' sources; the wheel ships neither."""
    tracked = subprocess.run(["git", "ls-files", "bench/results"], capture_output=True, text=True, cwd=ROOT, check=False)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    code = [f for f in tracked.stdout.splitlines() if f.endswith((".py", ".sh", ".diff", ".patch", ".ipynb"))]
    assert code == [], f"code in bench/results (results are data; experiments live in git history): {code[:10]}"
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if "/results/" in n]
    assert (ROOT / "bench" / "lab" / "__init__.py").is_file() and "blockflow/bench/suite.py" in names
    assert not [n for n in names if n.startswith("blockflow/bench/lab/")], "an investigation in the wheel"


def _cited_results(results: Path, pages: str) -> tuple[list[str], set[str]]:
    """Every ``<machine>/<folder>`` under ``results``, and those a page cites, directly or through the
    markdown of a cited folder (a summary such as ``memory_scenarios.md`` names the runs it rests on)."""
    folders = sorted(f"{m.name}/{d.name}" for m in results.iterdir() if m.is_dir() for d in m.iterdir())

    def markdown(folder: str) -> str:
        p = results / folder
        files = [p] if p.is_file() else sorted(p.rglob("*.md"))
        return "".join(f.read_text(errors="replace") for f in files if f.suffix == ".md")

    def cites(text: str, folder: str) -> bool:
        return folder in text or re.search(rf"(?<![\w-]){re.escape(folder.split('/', 1)[1])}(?![\w-])", text) is not None

    cited = {f for f in folders if f in pages}
    while True:
        text = "".join(markdown(f) for f in cited)
        more = {f for f in folders if f not in cited and cites(text, f)}
        if not more:
            return folders, cited
        cited |= more


def test_every_results_folder_backs_a_published_figure() -> None:
    """bench/results keeps what a reader needs to check a figure that docs/ or the CHANGELOG publish (directly or
    through a cited summary; the README's figures are performance.md's); anything else lives in git history."""
    pages = "".join(p.read_text() for p in [ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))])
    folders, cited = _cited_results(ROOT / "bench" / "results", pages)
    assert folders, "no results folders found"
    uncited = [f for f in folders if f not in cited]
    assert uncited == [], f"results no page cites (cite them or let git keep them): {uncited[:10]}"


# A result's folder named by its date (``bench/results/h100/tail_ab-2026-11-26-b42c2d1/``).
DATED_RESULTS = re.compile(r"bench/results/\w+/\S+-20\d\d-")


def dated_citations(text: str) -> list[int]:
    """The lines of ``text`` that cite a dated folder under bench/results."""
    return [i for i, line in enumerate(text.splitlines(), 1) if DATED_RESULTS.search(line)]


def test_the_finder_sees_a_dated_folder_and_nothing_else() -> None:
    text = ("# measured there (bench/results/h100/warm_cores_ab-2026-11-26-b42c2d1/)\n"
            "# docs/performance.md, *Where the time goes*\n"
            "    python -m blockflow.bench.memory --out bench/results/h100\n"
            "    python -m blockflow.bench.precision --out bench/results/h100/precision-DATE-COMMIT\n")
    assert dated_citations(text) == [1]


def test_code_cites_docs_not_dated_result_folders() -> None:
    """Code outside the tests and the investigations cites the docs for a finding: the docs say what was measured
    and keep up with it, a dated folder holds one run."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"], capture_output=True, text=True,
                            cwd=ROOT, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    files = [f for f in listed.stdout.splitlines() if not f.startswith(("tests/", "bench/lab/")) and (ROOT / f).is_file()]
    assert "blockflow/triton/warm_cores.py" in files
    found = [f"{f}:{lines}" for f in files if (lines := dated_citations((ROOT / f).read_text()))]
    assert found == [], f"cite a docs section instead of a dated bench/results folder: {found}"
