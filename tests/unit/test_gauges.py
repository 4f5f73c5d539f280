"""backend/gauges.py: a gauge set through increments reads what was last set, and sends nothing unchanged."""

from __future__ import annotations

from blockflow.backend.gauges import Gauge


class Counter:
    """What Triton keeps for a metric: the sum of the increments it was sent."""

    def __init__(self) -> None:
        self.value = 0.0
        self.calls = 0

    def increment(self, delta: float) -> None:
        self.value += delta
        self.calls += 1


def test_a_gauge_reads_the_last_value_set_up_or_down() -> None:
    metric = Counter()
    gauge = Gauge(metric)
    for value in (5, 3, 3, 0, 2.5, 1e12, 7):
        gauge.set(value)
        assert metric.value == value
    assert metric.calls == 6  # the repeated 3 sent nothing


def test_a_gauge_set_to_zero_first_sends_nothing() -> None:
    metric = Counter()
    Gauge(metric).set(0)
    assert metric.calls == 0
