"""Plain checks that keep the house readable: the sizes the layers and pages were given."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_modules_stay_small() -> None:
    """The presentation layer only parses, calls and prints: each of its modules fits ~250 lines."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in sorted((ROOT / "blockflow" / "cli").glob("*.py"))}
    assert sizes, "no CLI modules found"
    assert {n: s for n, s in sizes.items() if s > 250} == {}


def test_performance_page_says_where_the_time_goes_in_150_lines() -> None:
    """docs/performance.md is the present state, not a history (git and the CHANGELOG keep that)."""
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) <= 150
