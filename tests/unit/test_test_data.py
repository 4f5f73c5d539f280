"""The tests' own data: small fixtures under tests/fixtures, never bench/results or the README.

bench/results and the README are rewritten as runs come and prose changes; a test that read them
would pin them. A test reads a trimmed copy under tests/fixtures (tests/fixtures/results/README.md
says where each came from).
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FIXTURES = TESTS / "fixtures"
# test_packaging.py checks what ships: bench/results holds no code and stays out of the image and the wheel.
NAMES_RESULTS = {"test_packaging.py"}
LARGEST_FIXTURE = 16_000  # bytes; a fixture holds what its test reads, not a run


def _joins(tree: ast.AST) -> list[int]:
    """Lines that join "bench" and "results" into a path: ``x / "bench" / "results"``, ``Path("bench", "results")``."""
    def word(node: ast.AST | None) -> str | None:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            node = node.right
        return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and word(node.right) == "results" and word(node.left) == "bench":
            lines.append(node.lineno)
        if isinstance(node, ast.Call):
            args = [word(a) for a in node.args]
            if ("bench", "results") in pairwise(args):
                lines.append(node.lineno)
    return lines


def mentions(source: str) -> dict[str, list[int]]:
    """Where a test's code names bench/results or the README: string constants and path joins (comments aside)."""
    tree = ast.parse(source)
    strings = [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return {"bench/results": sorted({line for line, s in strings if "bench/results" in s} | set(_joins(tree))),
            "README.md": sorted({line for line, s in strings if "README.md" in s})}


def test_the_finder_sees_each_way_of_naming_them() -> None:
    seen = mentions('ROOT / "bench" / "results" / "h100"\nPath("bench", "results")\nopen("bench/results/x.json")\n'
                    'p = ROOT / "README.md"\n# bench/results in a comment\nROOT / "bench" / "runs"\n')
    assert seen == {"bench/results": [1, 2, 3], "README.md": [4]}


def test_no_test_reads_bench_results_or_the_readme() -> None:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path == Path(__file__).resolve():
            continue
        for what, lines in mentions(path.read_text()).items():
            if lines and not (what == "bench/results" and path.name in NAMES_RESULTS):
                found.append(f"{path.relative_to(TESTS)}:{lines} names {what}")
    assert found == [], "tests read a trimmed copy under tests/fixtures instead: " + "; ".join(found)


def test_the_fixtures_are_small() -> None:
    files = [f for f in FIXTURES.rglob("*") if f.is_file()]
    assert files, "tests/fixtures is empty"
    big = [f"{f.relative_to(FIXTURES)} ({f.stat().st_size} B)" for f in files if f.stat().st_size > LARGEST_FIXTURE]
    assert big == [], f"fixtures over {LARGEST_FIXTURE} B (trim them to what their test reads): {big}"
