"""A compiled program equals the same program run eagerly (issue 44).

The dense expert dispatch gave different outputs under `jax.jit` than
eagerly when the l* expert adapters were zeroed inside the program, and the
error changed from one compile to the next. The cause is XLA's, not ours:
jaxlib 0.10.2's YNNPACK reduce fusions read uninitialised memory when a
fused dot has a broadcast constant operand (`raptor_jax.xla_workarounds`,
which turns them off). Here:

* the minimal reproduction, compiled afresh several times;
* every family x dispatch x kernels setting, jit against eager and both
  against the Hugging Face PyTorch model, with the expert adapters nonzero,
  zeroed outside the program and zeroed inside it.

The other places that zero parameters inside a program (the residual
weights, the `D_e = B` ablation, diagnostics) have their jit-versus-eager
tests next to their code's tests (tests/test_methods.py,
tests/test_diagnostics.py).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import xla_workarounds

from helpers import fresh_compiles


def test_minimal_reproduction_is_exact_in_every_compile():
  """sum over k of (y @ 0): exactly zero, in every fresh compile.

  Without the workaround, jaxlib 0.10.2 returned values up to 1e+30 or NaN
  in 9 of 10 compiles (the OLMoE layer's pattern: expert products with a
  zeroed factor, summed over a token's k slots).
  """
  y = jnp.asarray(np.random.RandomState(0).randn(64, 32), jnp.float32)

  def f(y):
    return jnp.sum((y @ jnp.zeros((32, 128))).reshape(32, 2, 128), axis=1)

  assert not np.any(np.asarray(f(y)))  # eager
  for out in fresh_compiles(f, y, times=5):
    assert not np.any(out), np.nanmax(np.abs(out))


def test_the_workaround_is_applied_on_an_affected_jaxlib():
  flags = os.environ.get("XLA_FLAGS", "").split()
  if xla_workarounds.jaxlib_affected():
    assert any(f.startswith(xla_workarounds.FLAG + "=") for f in flags)
  assert xla_workarounds.jaxlib_affected("0.10.2")
  assert xla_workarounds.jaxlib_affected("0.11.0")
  assert not xla_workarounds.jaxlib_affected("0.10.1")
  assert not xla_workarounds.jaxlib_affected("0.12.0")
  assert not xla_workarounds.jaxlib_affected("0.6.0")


def test_the_users_own_flag_value_is_kept():
  user = f"--xla_foo=1 {xla_workarounds.FLAG}=reduce"
  assert xla_workarounds.with_workaround(user) == user
  added = xla_workarounds.with_workaround("--xla_foo=1")
  assert added == f"--xla_foo=1 {xla_workarounds.WORKAROUND}"
  assert xla_workarounds.with_workaround(added) == added
