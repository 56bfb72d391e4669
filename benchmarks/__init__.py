"""Scripts run from the checkout, not part of the installed package: the benchmark suite (`python benchmarks/run.py`),
the numbers the docs quote (`quoted.py`), research experiments (`experiments/`) and the GPU checks (`gpu/`,
`python -m benchmarks.gpu`). A package so that `benchmarks.gpu` imports from the checkout's root ahead of any
installed module of the same name, and so that its import contract (pyproject.toml) covers it.
"""
