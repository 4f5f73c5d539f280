"""The failed points of a bench run, as ``report.md`` lists them."""

from __future__ import annotations

from typing import Any


def failures_section(res: dict[str, Any]) -> list[str]:
    """Each failed perf_analyzer point with what perf_analyzer said (its output's last lines and the server log's
    lines of that point are in results.json: ``detail``, ``server_errors``). ``blockflow load``'s rows (``clients``)
    count their failed requests in their own column instead."""
    named = {"batch": " b{}", "concurrency": " c{}", "rate": " {}× the peak"}  # how each section names a point
    # The pipeline section's point is the batch section's b1, where that section ran.
    points: list[tuple[str, dict[str, Any]]] = [] if res.get("batch") else [
        (f"pipeline {label}", r) for label, r in res.get("pipeline", {}).items()]
    for section, name in named.items():
        for label, rows in res.get(section, {}).items():
            if isinstance(rows, dict):  # not the rate section's peak_per_s
                points += [(f"{section} {label}{name.format(point)}", r) for point, r in rows.items()]
    for gpus, by_label in res.get("gpus", {}).items():
        if isinstance(by_label, dict):  # not its "skipped" reason
            points += [(f"{gpus} GPUs {label} c{c}", r) for label, rows in by_label.items() for c, r in rows.items()]
    return failed_points(points)


def failed_points(points: list[tuple[str, Any]]) -> list[str]:
    """The "Failed points" section of a report: each ``(where, figures)`` that failed, with its whole message;
    nothing when none did."""
    failed = [f"- {where}: {r.get('message', 'no message')}" for where, r in points if isinstance(r, dict) and "error" in r]
    if not failed:
        return []
    return ["## Failed points", "", *failed, "",
            "`results.json` holds each one's `detail` (perf_analyzer's last lines) and, where the bench read the server's "
            "log, `server_errors` (its lines of that point).", ""]


def failure_cell(r: dict[str, Any], width: int = 80) -> str:
    """A failed point in a Markdown table's cell: ``failed:`` and the start of its message (``|`` escaped;
    the whole message is in the report's "Failed points" and in results.json)."""
    message = str(r.get("message", ""))
    cut = message[:width].replace("|", "\\|")  # escaped after the cut: no half of an escape at its end
    return f"failed: {cut}{'…' if len(message) > width else ''}" if message else "failed"
