"""Benchmarks: `python -m zrw.bench NAME [--json]`.

Every benchmark prints a readable table of figures measured in one run (times as ratios against a
baseline timed in the same process), and with --json one JSON object holding the same figures.
Timings live here, never in tests.
"""
