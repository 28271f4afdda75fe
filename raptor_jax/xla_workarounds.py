"""Routes around a known XLA:CPU miscompile: YNNPACK reduce fusions (jaxlib 0.10.2+).

From jaxlib 0.10.2, XLA:CPU sends reductions, and the products feeding them,
to YNNPACK (`__ynn_fusion`, fusion type `reduce`, on by default). Such a
fusion whose dot has a broadcast constant operand reads memory it never
wrote: the smallest case, which must return zeros,

    jnp.sum((y @ jnp.zeros((32, 128))).reshape(32, 2, 128), axis=1)

returned values up to 1e+30 (or NaN) under `jax.jit` in 9 of 10 fresh
compiles of the same HLO (y float32 [64, 32]; eager: exactly 0). The
pattern is the MoE layer's: the dense dispatch's expert products, with the
l* expert `lora_b` zeroed inside the program (the residual weights' "model
without the expert adapters"), summed over a token's k routed slots
(`moe.combine`). The error changed from one compile to the next (2e-7 to
1e+25 on an OLMoE block), which is issue 44's "jit differs from eager"; it
is not a routing near-tie (with the flag below, jit equals eager to 1.4e-6
in every compile, and bfloat16 differs only by XLA's documented excess
precision, 0 with `--xla_allow_excess_precision=false`).

Upstream: the same fusion's wrong results and crashes on jaxlib 0.10.2 and
0.11.0, https://github.com/jax-ml/jax/issues/39103 and
https://github.com/jax-ml/jax/issues/39257 (their workaround, the flag
below, is also the one of https://github.com/jax-ml/jax/issues/37465).

`apply` adds `--xla_cpu_experimental_ynn_fusion_type=-reduce` to
`XLA_FLAGS` (XLA reads it when its CPU backend starts), on the jaxlib
versions `AFFECTED` names, unless the user already set that flag. Importing
`raptor_jax` calls it, so it holds for every program that imports
raptor_jax before its first JAX computation. It changes which kernels run a
reduction, never what it computes.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import warnings

FLAG = "--xla_cpu_experimental_ynn_fusion_type"
WORKAROUND = f"{FLAG}=-reduce"
# jaxlib versions [first, last) that have the fusion on by default and parse
# the flag (XLA aborts the process on a flag it does not know, so the range
# is closed above: extend it after checking a newer jaxlib with
# tests/test_jit_eager.py).
AFFECTED = ((0, 10, 2), (0, 12, 0))


def _version(text: str) -> tuple[int, ...]:
  parts = []
  for piece in text.split(".")[:3]:
    digits = "".join(c for c in piece if c.isdigit())
    parts.append(int(digits or 0))
  return tuple(parts)


def jaxlib_affected(version: str | None = None) -> bool:
  """Whether `version` (default: the installed jaxlib) is in `AFFECTED`."""
  if version is None:
    try:
      version = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
      return False
  first, last = AFFECTED
  return first <= _version(version) < last


def with_workaround(xla_flags: str) -> str:
  """`xla_flags` plus `WORKAROUND`, unless it already sets `FLAG`."""
  flags = xla_flags.split()
  if any(f == FLAG or f.startswith(FLAG + "=") for f in flags):
    return xla_flags
  return " ".join(flags + [WORKAROUND])


def _backends_started() -> bool:
  if "jax" not in sys.modules:
    return False
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top

  return xla_bridge.backends_are_initialized()


def apply() -> bool:
  """Adds `WORKAROUND` to `XLA_FLAGS` on an affected jaxlib. Idempotent.

  Warns (once) when JAX's backends already started, so that the flag comes
  too late for this process.

  Returns:
    Whether `XLA_FLAGS` now carries the workaround (or the user's own value
    of the flag).
  """
  if not jaxlib_affected():
    return False
  before = os.environ.get("XLA_FLAGS", "")
  after = with_workaround(before)
  if after != before:
    if _backends_started():
      warnings.warn(
          "JAX started before raptor_jax was imported, so XLA:CPU's YNNPACK"
          " reduce fusions stay on and can return wrong values (see"
          " raptor_jax.xla_workarounds); import raptor_jax first, or set"
          f" XLA_FLAGS={WORKAROUND}",
          RuntimeWarning,
          stacklevel=2,
      )
    os.environ["XLA_FLAGS"] = after
  return True
