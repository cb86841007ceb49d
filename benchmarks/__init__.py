"""Benchmark suite: `python benchmarks/run.py --config CONFIG` (or `make bench`). See docs/benchmarks.md."""
