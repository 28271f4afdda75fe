"""Which implementation of the hand-written kernels a model runs.

Every kernel with a hand-written backward (the attention core, the LoRA
layers, the expert dispatch) sits next to its plain definition in its own
module:

* 'reference': the readable definition, plain `jnp` differentiated by JAX's
  autodiff, batched by JAX's own `vmap` rules. What the fast path is tested
  against (and, through it, against PyTorch's gradients).
* 'fast': the same functions with custom VJPs, `custom_vmap` rules that fold
  records into one batch, and `optimization_barrier` layout pins. Each was
  measured faster on XLA:CPU (2 cores); none has been measured on a GPU or
  TPU.
* 'auto': 'fast' on CPU, where it was measured, 'reference' on every other
  backend until a benchmark there says otherwise; except the expert
  dispatch, which stays 'fast' everywhere (`resolve_expert`).

Both compute the same function and the same gradients up to float rounding
(`tests/test_grad_parity.py`): the choice changes speed, never what a run
releases.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax

from raptor_jax import _validate

KERNELS = ("auto", "fast", "reference")
KERNELS_FIX = (
    "pass kernels= to from_pretrained / with_options (or set "
    "--config.model.kernels); 'auto' is fast on CPU, reference elsewhere"
)


# The backend whose defaults 'auto' takes; None: `jax.default_backend()`.
_DEFAULTS_OF: list[str] = []


@contextlib.contextmanager
def defaults_of(backend: str) -> Iterator[None]:
  """Within the block, every 'auto' resolves as on `backend` when traced.

  `resolve` here and `dispatch.resolve_dispatch` read it, so
  `with defaults_of('gpu'):` traces and compiles on a CPU the programs a GPU
  run builds by default: how the tests read a GPU step's optimised HLO
  (`tests/test_gpu_defaults.py`). It acts when a function is traced, not
  when it runs: trace inside the block. Process-wide (compile threads see
  it too).
  """
  _DEFAULTS_OF.append(backend)
  try:
    yield
  finally:
    _DEFAULTS_OF.pop()


def default_backend() -> str:
  """The backend 'auto' resolves for: `defaults_of`'s, else JAX's default."""
  return _DEFAULTS_OF[-1] if _DEFAULTS_OF else jax.default_backend()


def resolve(kernels: str, backend: str | None = None) -> str:
  """'fast' or 'reference': `kernels` with 'auto' resolved for `backend`.

  Args:
    kernels: one of `KERNELS`.
    backend: 'cpu', 'gpu', 'tpu'...; default `default_backend()`.

  Returns:
    'fast' or 'reference'.
  """
  _validate.one_of("kernels", kernels, KERNELS, KERNELS_FIX)
  if kernels != "auto":
    return kernels
  backend = backend or default_backend()
  return "fast" if backend == "cpu" else "reference"


def resolve_expert(kernels: str) -> str:
  """'fast' or 'reference' for the expert dispatch: 'auto' is 'fast'.

  The expert dispatch's plain twin is its definition, every expert on every
  row and then a select (`moe.dense_linear`): E times the expert FLOPs. A
  plain autodiff of the sorted dispatch itself is no alternative: under the
  per-record `vmap` it keeps every block's gathered weights for every record
  (one expert linear of the `vs_opacus` model at 32 records: 4.6 GB of
  temporaries, against 39 MB fast and 157 MB dense). So 'auto' keeps the
  sorted dispatch and its record folding on every backend rather than make
  a GPU run dense by default; 'reference' asks for the definition.

  Args:
    kernels: one of `KERNELS`.

  Returns:
    'fast' or 'reference'.
  """
  _validate.one_of("kernels", kernels, KERNELS, KERNELS_FIX)
  return "reference" if kernels == "reference" else "fast"
