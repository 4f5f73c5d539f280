"""bench.timeline's request anatomy, from hand-made trace records."""

from __future__ import annotations

from blockflow.bench.timeline import anatomy


def _exec(t: list[int], laps: list[tuple[str, int]] | None = None) -> dict[str, object]:
    return {"kind": "execute", "t": t, "laps": laps or []}


def test_a_hop_starts_where_the_block_answered() -> None:
    """A block that answered with its tickets before queuing its work (a *run:reply* lap) hands on
    from that lap, not from its return; the next block may enter before that return."""
    traces = {"a": [_exec([100_000, 110_000, 300_000, 310_000], [("run:reserve", 120_000), ("run:reply", 150_000)])],
              "b": [_exec([250_000, 260_000, 400_000, 410_000])],
              "c": [_exec([600_000, 610_000, 700_000, 710_000])]}
    res = anatomy([(0, 800_000)], ["a", "b", "c"], traces)
    m = res["median_ms"]
    assert res["matched"] == 1
    assert m["a.hop"] == 0.1  # 150 us (reply) -> 250 us (b's entry)
    assert m["b.hop"] == 0.19  # no early answer: b's return -> c's entry
    assert m["a.run:reply"] == 0.03 and m["a.execute"] == 0.21 and m["last_to_client"] == 0.09
