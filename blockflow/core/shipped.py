"""Files BlockFlow ships besides code from folders outside the package: the plans, the Grafana dashboard.

A source checkout has them at the repository's root (``plans/default.yaml``); the wheel carries
them inside the package, under ``blockflow/data/`` (``pyproject.toml`` maps each folder there), and
they are found through :mod:`importlib.resources`. Data that lives inside the package in a checkout too
(``blockflow/data/calibration/``) is read with :mod:`importlib.resources` directly.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# Where each shipped folder of the checkout lives inside the wheel's blockflow/data/.
FOLDERS = {"plans": "plans", "monitoring/grafana": "grafana"}
CHECKOUT = Path(__file__).resolve().parents[2]


def shipped(rel: str) -> Path:
    """The shipped file ``rel``, named as in a checkout (``plans/default.yaml``), wherever it is installed.

    Returns the checkout's path when the package carries no copy (a checkout, or an editable install).
    """
    folder, _, name = rel.rpartition("/")
    for src, dst in FOLDERS.items():
        if folder == src or folder.startswith(src + "/"):
            packaged = resources.files("blockflow") / "data" / (dst + folder[len(src):]) / name
            if packaged.is_file():
                return Path(str(packaged))  # wheels install unzipped: a real file
    return CHECKOUT / rel
