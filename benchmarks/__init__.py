"""Benchmarks: `python -m benchmarks.run` (see README.md in this folder)."""
