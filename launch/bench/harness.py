"""The benchmarks' one harness: calls taking turns, medians, ratios, costs.

In one process (`interleaved_times`, `interleaved_medians`) the compiled
variants of a step are called in turns (A, B, A, B, ...) after warm-up; a
column gets its median and a pair its `paired_ratio` (the median of the
per-round ratios, so load that changes during the run hits both alike).
Side-by-side comparisons (`vs_opacus`, `epoch_time`) time each framework
in its own worker process (the script run with `--serve`: `serve`), asked
for one call at a time, column after column, round after round
(`worker_times`); round r calls each column with r, so a benchmark may
time a different input per round while still pairing the columns.

What a compiled program costs, read the same way across JAX versions:
`compile_timed`, `flops` and `memory_stats` (XLA's analyses; NaN or None
where a backend lacks them), `loop_corrected_flops` (XLA counts a scan's
body once: this adds the other `length - 1` copies), `largest_buffers` and
`while_loops` (its loops and their trip counts).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import jax
from jax.extend import core as jax_core
import numpy as np

_READY = '{"ready"'


def interleaved_times(fns, *, repeats: int = 5, warmup: int = 1):
  """{name: [seconds of round 0, 1, ...]}: each round calls every function
  once, in order, outputs waited for, after `warmup` untimed rounds."""
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}.")
  for _ in range(warmup):
    for fn in fns.values():
      jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  return times


def call_times(call: Callable[[], Any], repeats: int, warmup: int = 1):
  """Seconds of each of `repeats` calls of `call` after `warmup` untimed
  ones, outputs waited for (`interleaved_times` of one function)."""
  return interleaved_times({0: call}, repeats=repeats, warmup=warmup)[0]


def median(samples: list[float]) -> float:
  return float(statistics.median(samples))


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
  """Median over rounds of ``numerator[i] / denominator[i]``."""
  if len(numerator) != len(denominator) or not numerator:
    raise ValueError("need two non-empty lists of the same length.")
  return median([a / b for a, b in zip(numerator, denominator)])


def device_memory(key: str) -> int | None:
  """`key` of the first device's `memory_stats()` ('bytes_limit',
  'peak_bytes_in_use'), or None where it reports none (a CPU)."""
  return (jax.devices()[0].memory_stats() or {}).get(key)


def fmt(value, spec: str = "") -> str:
  """`format(value, spec)`; '-' for None or NaN."""
  return "-" if value is None or value != value else format(value, spec)


def format_table(header: list[str], rows: list[list[Any]]) -> str:
  """Left-aligned plain-text table (floats as given; format them first)."""
  cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  lines = [
      "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells
  ]
  lines.insert(1, "  ".join("-" * w for w in widths))
  return "\n".join(lines)


def dict_table(columns, rows: Sequence[Mapping[str, Any]]) -> str:
  """`format_table` of dict rows: one column per (header, key, format spec)
  (`fmt`); a tuple of keys makes one cell of their values, 'a, b'."""

  def cell(row, keys, spec):
    keys = (keys,) if isinstance(keys, str) else keys
    return ", ".join(fmt(row.get(k), spec) for k in keys)

  return format_table(
      [header for header, _, _ in columns],
      [[cell(r, keys, spec) for _, keys, spec in columns] for r in rows],
  )


def interleaved_medians(calls, *, repeats: int, pairs=()):
  """({column: median ms}, {(a, b): `paired_ratio` a / b}) of `calls`
  timed in interleaved rounds after one warm-up round."""
  times = interleaved_times(calls, repeats=repeats)
  ms = {c: median(t) * 1e3 for c, t in times.items()}
  return ms, {(a, b): paired_ratio(times[a], times[b]) for a, b in pairs}


def serve(calls, failed=None, warmup: Callable[[], None] | None = None):
  """The worker loop: `warmup` (default: two calls of every column with
  round 0), one JSON line {'ready': [columns], 'failed': {column: error}},
  then each input line 'column<TAB>round' answered with the seconds one
  call `calls[column](round)` took, outputs waited for."""
  if warmup is not None:
    warmup()
  for call in calls.values() if warmup is None else ():
    jax.block_until_ready(call(0))
    jax.block_until_ready(call(0))
  ready = {"ready": sorted(calls), "failed": dict(failed or {})}
  print(json.dumps(ready), flush=True)
  for line in sys.stdin:
    column, _, round_index = line.rstrip("\n").partition("\t")
    start = time.perf_counter()
    jax.block_until_ready(calls[column](int(round_index or 0)))
    print(time.perf_counter() - start, flush=True)


def worker_command(module: str, side: str, keep: bool, *args: str) -> list[str]:
  """`python -m module --serve=side` with host memory kept or not
  (`--[no]keep_host_memory`), then `args`: a timing worker's command."""
  keep_flag = "--keep_host_memory" if keep else "--nokeep_host_memory"
  return [sys.executable, "-m", module, f"--serve={side}", keep_flag, *args]


def worker_times(workers, *, repeats: int, by_column: bool = False):
  """({column: [seconds per round]}, {column: error}) from workers.

  `workers`: (command line running `serve`, `name` mapping a worker's
  column to the table's). Round r calls every column of every worker once,
  with r: worker by worker, or with `by_column` the columns of one name
  back to back (A/B pairs of workers serving the same columns).
  """
  procs, order, failed = [], [], {}
  try:
    for argv, name in workers:
      proc = subprocess.Popen(
          list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
      )
      procs.append(proc)
      # The JSON line, after anything a library prints before it.
      lines = (json.loads(l) for l in proc.stdout if l.startswith(_READY))
      ready = next(lines, None)
      if ready is None:
        raise RuntimeError(f"a timing worker failed (see stderr): {argv}")
      failed.update({name(c): e for c, e in ready["failed"].items()})
      order += [(proc, c, name(c)) for c in ready["ready"]]
    if by_column:
      order.sort(key=lambda o: o[1])  # stable: the workers' order within
    times = {name: [] for _, _, name in order}
    for r in range(repeats):
      for proc, column, name in order:
        proc.stdin.write(f"{column}\t{r}\n")
        proc.stdin.flush()
        times[name].append(float(proc.stdout.readline()))
    return times, failed
  finally:
    for proc in procs:
      if proc.stdin:
        proc.stdin.close()
      proc.wait()


def error_line(e: Exception) -> str:
  """'Type: the first line of its message' (120 characters at most): how a
  column that could not be built is reported."""
  return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


# ---------------------------------------------------------------------------
# While loops of a compiled program (its optimised HLO text).

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"^\s+(?:ROOT\s+)?%?([\w.\-]+)\s*=")
_WHILE_BODY = re.compile(r"\swhile\(.*?\bbody=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEE = re.compile(
    r"\b(?:calls|to_apply|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)|\bbranch_computations=\{([^}]*)\}"
)


def while_loops(hlo_text: str) -> list[dict[str, Any]]:
  """Every while op of optimised HLO text (`compiled.as_text()`).

  One dict per op: `name`, `trip_count` (XLA's `known_trip_count`; None
  for a data-dependent loop) and `per_call`, its iterations per call: the
  trip count times those of the loops around it (None if any is unknown;
  the largest over the paths that reach it). On a GPU each iteration is a
  host round trip (jax issue 2491).
  """
  trips, callees, computation = {}, {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header and not line.startswith(" "):
      computation = header.group(1)
      callees.setdefault(computation, [])
      if line.startswith("ENTRY"):
        callees.setdefault("__entry__", []).append((computation, 1))
      continue
    op = _OP.match(line)
    if not op or computation is None:
      continue
    body = _WHILE_BODY.search(line)
    if body:
      trip = _TRIP_COUNT.search(line)
      trips[op.group(1)] = int(trip.group(1)) if trip else None
      callees[computation].append((body.group(1), op.group(1)))
    for called, branches in _CALLEE.findall(line):
      names = [called] if called else re.findall(r"%?([\w.\-]+)", branches)
      callees[computation].extend((n, 1) for n in names)
  per_call: dict[str, int | None] = {}

  def visit(computation, factor, seen):
    for callee, via in callees.get(computation, ()):
      if callee in seen:
        continue
      inner = factor
      if via != 1:  # a while op's body: its trip count multiplies
        trip = trips[via]
        inner = None if factor is None or trip is None else factor * trip
        best = per_call.get(via, 0)
        unknown = inner is None or best is None
        per_call[via] = None if unknown else max(best, inner)
      visit(callee, inner, seen | {callee})

  visit("__entry__", 1, frozenset())
  return [
      {"name": name, "trip_count": trips[name], "per_call": per_call.get(name)}
      for name in trips
  ]


def max_while_trip_count(hlo_text: str) -> float:
  """The largest trip count of a while loop in optimised HLO text: 0
  without loops, `math.inf` if one is data-dependent (`while_loops`)."""
  counts = [loop["trip_count"] for loop in while_loops(hlo_text)]
  return math.inf if None in counts else max(counts, default=0)


def hlo_instructions(hlo_text: str) -> int:
  """Instructions in optimised HLO text, fused computations included."""
  return sum(
      1 for l in hlo_text.splitlines() if re.match(r"\s+(ROOT )?%\S+ = ", l)
  )


# ---------------------------------------------------------------------------
# What a compiled program costs.


class Compiled(NamedTuple):
  """A compiled program and how long it took to get it."""

  compiled: Any  # jax.stages.Compiled
  lower_s: float  # tracing + lowering to StableHLO
  compile_s: float  # XLA compilation


def compile_timed(fn, *args, jitted: bool = False, **jit_kwargs) -> Compiled:
  """``jax.jit(fn, **jit_kwargs).lower(*args).compile()`` (``jitted``:
  ``fn.lower(*args).compile()``), timed; ``args`` arrays or shapes."""
  start = time.perf_counter()
  lowered = (fn if jitted else jax.jit(fn, **jit_kwargs)).lower(*args)
  lowered_at = time.perf_counter()
  compiled = lowered.compile()
  end = time.perf_counter()
  return Compiled(compiled, lowered_at - start, end - lowered_at)


def _cost_dict(compiled) -> Optional[Mapping[str, float]]:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None  # some backends do not implement it
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
    cost = cost[0] if cost else None
  return cost or None


def flops(compiled) -> float:
  """XLA's FLOP count of a compiled program (NaN where unavailable); loop
  bodies count once (``loop_corrected_flops``)."""
  return float((_cost_dict(compiled) or {}).get("flops", float("nan")))


def memory_stats(compiled) -> Optional[dict[str, int]]:
  """XLA's buffer bytes of a compiled program, or None: ``temp`` (scratch
  live during the call, never the arguments), ``argument``, ``output``,
  ``alias`` (outputs reusing a donated argument), ``generated_code``."""
  try:
    stats = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None  # some backends do not implement it
  if stats is None:
    return None
  keys = ("temp", "argument", "output", "alias", "generated_code")
  return {k: int(getattr(stats, f"{k}_size_in_bytes", 0) or 0) for k in keys}


def _closed_jaxpr_flops(closed: jax_core.ClosedJaxpr, cache: dict) -> float:
  text = str(closed)  # shapes included: equal text, equal program
  if text not in cache:
    args = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
        for v in closed.jaxpr.invars
    ]
    fn = jax.jit(jax_core.jaxpr_as_fun(closed))
    cache[text] = flops(fn.lower(*args).compile())
  return cache[text]


def _scans(jaxpr: jax_core.Jaxpr):
  """Yields every scan equation not nested inside another scan."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      yield eqn
      continue
    for sub in jax_core.jaxprs_in_params(eqn.params):
      yield from _scans(sub)


def _scan_extra_flops(jaxpr: jax_core.Jaxpr, cache: dict) -> float:
  extra = 0.0
  for eqn in _scans(jaxpr):
    body = eqn.params["jaxpr"]
    counted_once = _closed_jaxpr_flops(body, cache)
    true_body = counted_once + _scan_extra_flops(body.jaxpr, cache)
    extra += eqn.params["length"] * true_body - counted_once
  return extra


def loop_corrected_flops(fn, *args, compiled=None) -> tuple[float, float]:
  """(raw, corrected) XLA FLOPs of ``jax.jit(fn)(*args)`` (``compiled``:
  that program, if at hand).

  The corrected count adds, for every ``lax.scan`` in ``fn``'s jaxpr (also
  inside ``jit``, ``custom_vjp``, ...), ``length - 1`` more copies of its
  body, whose FLOPs XLA counts on the body compiled alone; nested scans
  recursively. A scan XLA unrolls or removes as unused (e.g. frozen
  adapters' gradient scans) is over-counted; a data-dependent
  ``while_loop`` stays counted once.
  """
  if compiled is None:
    compiled = jax.jit(fn).lower(*args).compile()
  raw = flops(compiled)
  closed = jax.make_jaxpr(fn)(*args)
  return raw, raw + _scan_extra_flops(closed.jaxpr, {})


_HLO_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{$")
_HLO_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[([\d,]*)\][^ ]* ([\w\-]+)\("
)
_HLO_OP_NAME = re.compile(r'op_name="([^"]*)"')
_HLO_CALLS = re.compile(r"calls=%([\w.\-]+)")
_NOT_A_BUFFER = {"parameter", "get-tuple-element", "bitcast", "tuple"}
_NOT_A_BUFFER.add("constant")


def _dtype_bytes(name: str) -> int:
  bits = re.search(r"\d+", name)
  return 1 if name == "pred" else int(bits.group()) // 8 if bits else 4


class Buffer(NamedTuple):
  """One materialized buffer of a compiled program."""

  nbytes: int
  shape: str  # e.g. "f32[32,128,64,8]"
  opcode: str  # HLO opcode that produces it, e.g. "fusion", "dot"
  op_name: str  # JAX's name for the op (source-level path), if recorded


def largest_buffers(compiled, count: int = 10) -> list[Buffer]:
  """The ``count`` largest results of the non-fusion computations of a
  compiled program's HLO (what XLA materialises, loop bodies included;
  no parameters, tuples, aliases or constants). A diagnostic, not a memory
  model: XLA may reuse one allocation for several."""
  lines = compiled.as_text().splitlines()
  fused = {c for l in lines if " fusion(" in l for c in _HLO_CALLS.findall(l)}
  buffers, inside = [], None
  for line in lines:
    header = _HLO_COMPUTATION.match(line)
    if header:
      inside = header.group(2)
      continue
    if line.startswith("}"):
      inside = None
      continue
    if inside is None or inside in fused:
      continue
    match = _HLO_INSTRUCTION.match(line)
    if not match or match.group(3) in _NOT_A_BUFFER:
      continue
    dtype, dims, opcode = match.groups()
    size = int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    op_name = _HLO_OP_NAME.search(line)
    op_name = op_name.group(1) if op_name else ""
    nbytes = size * _dtype_bytes(dtype)
    buffers.append(Buffer(nbytes, f"{dtype}[{dims}]", opcode, op_name))
  buffers.sort(key=lambda b: -b.nbytes)
  return buffers[:count]
