"""The commit a copy of the checkout holds, where git cannot tell: a stamp carried with ``.bundle``.

The GPU machines get a copy of the working tree whose git metadata is not the development
machine's, so ``git describe`` there names an old commit. Before each device call, write a stamp
on the development machine (``python -m blockflow.bench.stamp``): the commit as ``git describe
--always --dirty`` names it, and the git blob id of every tracked file as it is in the working tree.
On the copy, :func:`verified` recomputes those ids and gives the stamp's commit only if every file
matches, so a stamp left from an earlier commit is never believed; it says which files differ.

``BLOCKFLOW_BUNDLE`` (as for ``scripts/gpu_env.sh``) moves the stamp's directory.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from blockflow.core import env

ROOT = Path(__file__).resolve().parents[1]
STAMP_FILE = "stamp.json"


def stamp_path(root: Path = ROOT) -> Path:
    return Path(os.environ.get(env.BUNDLE) or root / ".bundle") / STAMP_FILE


def blob_id(path: Path) -> str | None:
    """Git's blob id of ``path`` as it is now (a link's target for a symlink), None if absent."""
    if path.is_symlink():
        data = os.readlink(path).encode()
    elif path.is_file():
        data = path.read_bytes()
    else:
        return None
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def describe(root: Path | None = None) -> str:
    """The commit as reports name it: git's, marked ``-dirty`` when the tree differs from it; ""
    outside a git checkout (of ``root``, else of the working directory)."""
    where = [] if root is None else ["-C", str(root)]
    cmd = ["git", *where, "describe", "--always", "--dirty", "--abbrev=7"]
    return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()


def write(root: Path = ROOT) -> tuple[Path, str]:
    """Stamp ``root``'s tree: its commit and every tracked file's blob id. Returns (stamp, commit)."""
    commit = describe(root)
    if not commit:
        raise SystemExit(f"{root} is not a git checkout: nothing to stamp")
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True, check=True).stdout
    paths = [p for p in listed.split("\0") if p]
    stamp = {"commit": commit, "files": {p: blob_id(root / p) for p in paths}}
    out = stamp_path(root)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(stamp, indent=0, sort_keys=True) + "\n")
    return out, commit


def differing(root: Path = ROOT) -> tuple[str, list[str]] | None:
    """(the stamp's commit, the files that differ from it), or None without a stamp."""
    path = stamp_path(root)
    if not path.is_file():
        return None
    stamp = json.loads(path.read_text())
    files: dict[str, str | None] = stamp["files"]
    return str(stamp["commit"]), [p for p, blob in sorted(files.items()) if blob_id(root / p) != blob]


def verified(root: Path = ROOT) -> str | None:
    """The stamp's commit if the tree is the one it stamped, else None."""
    found = differing(root)
    return found[0] if found is not None and not found[1] else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blockflow.bench.stamp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="say whether this tree is the stamped one (on the copy)")
    args = parser.parse_args(argv)
    if not args.check:
        out, commit = write()
        print(f"stamped {commit} in {out}")
        return 0
    found = differing()
    if found is None:
        print(f"no stamp at {stamp_path()}: reports name git's commit (or $BLOCKFLOW_COMMIT)", file=sys.stderr)
        return 1
    commit, changed = found
    if changed:
        shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
        print(
            f"the stamp names {commit}, but this tree differs in {len(changed)} files ({shown}): "
            "run `python -m blockflow.bench.stamp` where the tree was copied from",
            file=sys.stderr,
        )
        return 1
    print(f"reports will name {commit} (the stamp matches this tree)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
