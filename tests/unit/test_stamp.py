"""The stamp that names a copied tree's commit: believed only while every tracked file matches."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from blockflow.bench import harness, stamp
from blockflow.core import env


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\n")
    os.symlink("pkg", root / "link")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.delenv(env.BUNDLE, raising=False)
    return root


def test_blob_ids_are_gits_own(tree: Path) -> None:
    listed = [line.split("\t") for line in _git(tree, "ls-files", "-s").splitlines()]
    assert len(listed) == 2
    for meta, path in listed:
        assert stamp.blob_id(tree / path) == meta.split()[1]


def test_a_stamp_names_its_commit_only_while_the_tree_matches(tree: Path) -> None:
    _, commit = stamp.write(tree)
    assert commit == _git(tree, "rev-parse", "--short=7", "HEAD")
    assert stamp.verified(tree) == commit

    (tree / "pkg" / "a.py").write_text("x = 2\n")
    assert stamp.verified(tree) is None
    assert stamp.differing(tree) == (commit, ["pkg/a.py"])

    (tree / "pkg" / "a.py").write_text("x = 1\n")
    (tree / "link").unlink()
    assert stamp.differing(tree) == (commit, ["link"])


def test_a_dirty_tree_is_stamped_dirty_and_a_missing_stamp_is_none(tree: Path) -> None:
    assert stamp.differing(tree) is None
    (tree / "pkg" / "a.py").write_text("x = 3\n")
    _, commit = stamp.write(tree)
    assert commit.endswith("-dirty")
    assert stamp.verified(tree) == commit


def test_the_variable_outranks_the_stamp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BLOCKFLOW_COMMIT", "abc1234")
    assert harness.commit() == "abc1234"
