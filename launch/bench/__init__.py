"""Benchmark scripts (run from the repository root as modules, e.g.
`python -m launch.bench.benchmark`) and their helpers: `harness`, `builders`.
"""
