"""Measurement helpers for the benchmark scripts next to it in ``launch/bench/``.

Small, model-agnostic tools for what a compiled program costs (its timing,
in rounds, medians and ratios, is ``harness.py``):

* ``compile_timed``: lowering and compilation times and the compiled object.
* ``flops`` / ``memory_stats``: XLA's cost and memory analysis, read the same
  way across JAX versions (``cost_analysis()`` returned a list of dicts before
  it returned a dict; either may be missing on some backends).
* ``loop_corrected_flops``: XLA's cost analysis counts the body of a
  ``while`` loop (so of every ``lax.scan``) ONCE, whatever its trip count.
  This adds the missing ``length - 1`` copies of each scan body, with the
  body's cost also taken from XLA (each body compiled on its own).
* ``largest_buffers``: the biggest buffers of a compiled program, read from
  its optimized HLO, to see which one grows when a size changes.
"""

import re
import time
from typing import Any, Callable, Mapping, NamedTuple, Optional

import jax
from jax.extend import core as jax_core
import numpy as np


class Compiled(NamedTuple):
  """A compiled program and how long it took to get it."""

  compiled: Any  # jax.stages.Compiled
  lower_s: float  # tracing + lowering to StableHLO
  compile_s: float  # XLA compilation


def compile_timed(fn: Callable, *args, **jit_kwargs) -> Compiled:
  """``jax.jit(fn, **jit_kwargs).lower(*args).compile()``, timed.

  ``args`` may be arrays or ``jax.ShapeDtypeStruct``s. Call the returned
  ``compiled`` with arrays of the same shapes; it never recompiles.
  """
  start = time.perf_counter()
  lowered = jax.jit(fn, **jit_kwargs).lower(*args)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  return Compiled(
      compiled, lowered_at - start, time.perf_counter() - lowered_at
  )


def _cost_dict(compiled) -> Optional[Mapping[str, float]]:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None  # some backends do not implement it
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else None
  return cost or None


def flops(compiled) -> float:
  """XLA's FLOP count of a compiled program (NaN where unavailable).

  Loop bodies are counted once; see ``loop_corrected_flops``.
  """
  cost = _cost_dict(compiled)
  if cost is None or 'flops' not in cost:
    return float('nan')
  return float(cost['flops'])


def memory_stats(compiled) -> Optional[dict[str, int]]:
  """XLA's buffer sizes in bytes of a compiled program, or None.

  Keys: ``temp`` (scratch buffers live during the call: activations,
  intermediate gradients; never the arguments), ``argument``, ``output``,
  ``alias`` (outputs that reuse a donated argument), ``generated_code``.
  """
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if stats is None:
    return None
  names = {
      'temp': 'temp_size_in_bytes',
      'argument': 'argument_size_in_bytes',
      'output': 'output_size_in_bytes',
      'alias': 'alias_size_in_bytes',
      'generated_code': 'generated_code_size_in_bytes',
  }
  return {key: int(getattr(stats, attr, 0) or 0) for key, attr in names.items()}


def _closed_jaxpr_flops(closed: jax_core.ClosedJaxpr, cache: dict) -> float:
  text = str(closed)  # shapes included: equal text, equal program
  if text not in cache:
    args = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
        for v in closed.jaxpr.invars
    ]
    cache[text] = flops(
        jax.jit(jax_core.jaxpr_as_fun(closed)).lower(*args).compile()
    )
  return cache[text]


def _scans(jaxpr: jax_core.Jaxpr):
  """Yields every scan equation not nested inside another scan."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'scan':
      yield eqn
      continue
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from _scans(sub)


def _scan_extra_flops(jaxpr: jax_core.Jaxpr, cache: dict) -> float:
  extra = 0.0
  for eqn in _scans(jaxpr):
    body = eqn.params['jaxpr']
    counted_once = _closed_jaxpr_flops(body, cache)
    true_body = counted_once + _scan_extra_flops(body.jaxpr, cache)
    extra += eqn.params['length'] * true_body - counted_once
  return extra


def loop_corrected_flops(
    fn: Callable, *args, compiled=None
) -> tuple[float, float]:
  """XLA's FLOPs of ``jax.jit(fn)(*args)``, raw and with scans counted fully.

  The raw count is ``flops`` of the compiled program. The corrected count
  adds, for every ``lax.scan`` in ``fn``'s jaxpr (also inside ``jit``,
  ``custom_vjp``, ``custom_vmap``, ...), ``length - 1`` more copies of the
  scan body, whose FLOPs XLA counts on the body compiled alone; nested scans
  are corrected recursively. This assumes XLA keeps each scan a loop (it
  does on CPU and GPU for the trip counts here); a loop XLA unrolls, or
  removes because its results are unused (e.g. the grouped dispatch's
  adapter-gradient scans where the adapters are frozen), is over-counted. ``while_loop``s with a data-dependent trip count cannot be
  corrected and stay counted once.

  Args:
    fn: the function, called as ``fn(*args)``.
    *args: arrays or ``jax.ShapeDtypeStruct``s.
    compiled: ``jax.jit(fn).lower(*args).compile()`` if already at hand.

  Returns:
    ``(raw, corrected)`` FLOPs.
  """
  if compiled is None:
    compiled = jax.jit(fn).lower(*args).compile()
  raw = flops(compiled)
  closed = jax.make_jaxpr(fn)(*args)
  return raw, raw + _scan_extra_flops(closed.jaxpr, {})


_HLO_COMPUTATION = re.compile(r'^(ENTRY )?%([\w.\-]+) .*\{$')
_HLO_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[([\d,]*)\][^ ]* ([\w\-]+)\('
)
_HLO_OP_NAME = re.compile(r'op_name="([^"]*)"')
_HLO_CALLS = re.compile(r'calls=%([\w.\-]+)')
_NOT_A_BUFFER = {
    'parameter',
    'get-tuple-element',
    'bitcast',
    'tuple',
    'constant',
}


def _dtype_bytes(name: str) -> int:
  if name == 'pred':
    return 1
  bits = re.search(r'\d+', name)
  return int(bits.group()) // 8 if bits else 4


class Buffer(NamedTuple):
  """One materialized buffer of a compiled program."""

  nbytes: int
  shape: str  # e.g. 'f32[32,128,64,8]'
  opcode: str  # HLO opcode that produces it, e.g. 'fusion', 'dot'
  op_name: str  # JAX's name for the op (source-level path), if recorded


def largest_buffers(compiled, count: int = 10) -> list[Buffer]:
  """The ``count`` largest array results of a compiled program's HLO.

  Reads the optimized HLO text and lists the results of the instructions of
  every computation that is not a fusion body (the values XLA materializes,
  including inside loop bodies), skipping parameters, tuples, aliases and
  constants. A diagnostic, not a memory model: XLA may reuse one allocation
  for several of these, and arguments are not listed.
  """
  text = compiled.as_text()
  fused = set()
  for line in text.splitlines():
    if ' fusion(' in line:
      fused.update(_HLO_CALLS.findall(line))
  buffers = []
  inside = None
  for line in text.splitlines():
    header = _HLO_COMPUTATION.match(line)
    if header:
      inside = header.group(2)
      continue
    if line.startswith('}'):
      inside = None
      continue
    if inside is None or inside in fused:
      continue
    match = _HLO_INSTRUCTION.match(line)
    if not match or match.group(3) in _NOT_A_BUFFER:
      continue
    dtype, dims, opcode = match.groups()
    size = int(np.prod([int(d) for d in dims.split(',') if d] or [1]))
    op_name = _HLO_OP_NAME.search(line)
    buffers.append(
        Buffer(
            size * _dtype_bytes(dtype),
            f'{dtype}[{dims}]',
            opcode,
            op_name.group(1) if op_name else '',
        )
    )
  buffers.sort(key=lambda b: -b.nbytes)
  return buffers[:count]
