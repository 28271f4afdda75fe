"""Benchmark scripts and their shared helpers (`harness`: timing, tables and
compiled-program costs; `builders`: models, records and the trainer's steps).

Run them from the repository root as modules, e.g. `python -m launch.bench.benchmark`.
"""
