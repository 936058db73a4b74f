"""Benchmarks: `python -m benchmarks.<name>`; each prints a table and, last, one JSON line."""
