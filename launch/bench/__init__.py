"""Benchmark scripts and their measurement helpers (`harness`, `profiling`).

Run them from the repository root as modules, e.g. `python -m launch.bench.benchmark`.
"""
