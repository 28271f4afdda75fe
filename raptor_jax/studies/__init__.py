"""The experiments: sweeps of the paper's tables and the controlled study.

They stand above the trainer (`raptor_jax.train`) and `raptor_jax.diagnostics`
and use only their public names; nothing in the library imports a study.

* :mod:`raptor_jax.studies.sweep` / :mod:`raptor_jax.studies.sweep_report`:
  variants of one config over epsilons and seeds, and their tables and plots.
* :mod:`raptor_jax.studies.controlled` / :mod:`raptor_jax.studies.controlled_data`
  / :mod:`raptor_jax.studies.controlled_report`: the controlled study's cells,
  its generated data and its report.
* :mod:`raptor_jax.studies.theory`: Theorem 1's terms and their Monte Carlo
  check.
* :mod:`raptor_jax.studies.audit`: the one-run privacy audit of a trained
  run (canaries from :mod:`raptor_jax.canaries`, per stream) and membership
  inference.

Import the modules directly (``from raptor_jax.studies import sweep``).
"""
