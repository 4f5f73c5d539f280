"""Benchmarks (not tests): they write reports under bench/results/. Investigations, whose findings the docs hold, are in
:mod:`blockflow.bench.lab` (a checkout's only: the wheel leaves them out)."""
