"""The scenarios of `benchmarks/run.py`, one module per kind of measurement (run.py's docstring lists them)."""
