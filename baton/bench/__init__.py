"""Benchmarks: each a command that prints figures, writes JSON and a PNG, and ends with a RESULT line."""
