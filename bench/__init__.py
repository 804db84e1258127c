"""Benchmarks of the patched trainer: `python -m bench.run --list` names every measurement."""
