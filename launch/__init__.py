"""Entry points, run from the repository root: `python launch/main.py ...`.

A package so that a script is importable too (`launch.main`, `launch.bench`).
"""
