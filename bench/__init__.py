"""Benchmarks (not tests): they write reports under bench/results/."""
