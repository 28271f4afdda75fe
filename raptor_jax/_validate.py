"""Argument and config validators: one wording for every bad value.

Every check of a user-supplied value in raptor_jax goes through this module,
so that a mistake always reads the same way, as ONE line::

    <field>: must be <condition>, got <value>; <how to fix>

for example::

    privacy.rho: must be in (0, 1), got 1.5; set --config.privacy.rho (the
    paper uses 0.9)

``<field>`` is the config field (``privacy.rho``) or the argument name
(``sample_rate``); ``<value>`` is the ``repr`` of what was passed; the fix is
left out only where the condition already says it (a library argument).
Every validator raises ``ValueError`` (also for a value of the wrong type), so
callers catch one exception type, and returns the value in its canonical
Python type (``float`` or ``int``).

Validators never clamp, round or replace a value: a privacy parameter that is
out of range is refused, never silently moved into range (docs/method.md, DESIGN
"Errors"). ``bool`` is refused wherever a number is expected (``True`` is an
``int`` to Python, never a meant epsilon or step count).

This module imports only the standard library, so the DP core
(``transforms``, ``grads``, ``sampling``, ``accounting``, ``ledger``) stays
importable with its core dependencies alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
import contextlib
import math
import numbers
import operator
import os
import sys
from typing import Any, Callable, NoReturn


class Shown(str):
  """A value's description shown as is after ``got`` (e.g. an array's shape)."""

  def __repr__(self) -> str:
    return str(self)


TRACEBACK_VARIABLE = "RAPTOR_TRACEBACK"


@contextlib.contextmanager
def errors_exit_in_one_line() -> Iterator[None]:
  """For command-line entry points: bad input exits with ONE line.

  A ``ValueError`` (every validator's), ``FileNotFoundError`` or ``OSError``
  inside the block exits with ``error: <message>`` and status 1 instead of a
  traceback; ``RAPTOR_TRACEBACK=1`` re-raises it for debugging. Anything else
  (a bug) keeps its traceback.
  """
  try:
    yield
  except (ValueError, FileNotFoundError, OSError) as e:
    if os.environ.get(TRACEBACK_VARIABLE):
      raise
    sys.exit(f"error: {e}  ({TRACEBACK_VARIABLE}=1 shows the traceback)")


@contextlib.contextmanager
def needs_extra(package: str, extra: str = "train") -> Iterator[None]:
  """Turns a missing optional dependency into one line naming the extra.

  The DP core installs with four dependencies; ``package`` (e.g.
  ``raptor_jax.train``) needs the ``extra``'s too.
  """
  try:
    yield
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        f"{package} needs {e.name}, which is not installed; pip install"
        f" 'raptor_jax[{extra}]'",
        name=e.name,
    ) from None


# The fix of a number that must be known before tracing (a clip, a noise
# multiplier, a denominator): an array could be traced or data-dependent.
PUBLIC_NUMBER = "pass a public Python number, not an array or a traced value"


def message(field: str, condition: str, value: Any, fix: str = "") -> str:
  """The one-line error text: ``<field>: must be <condition>, got <value>; <fix>``."""
  text = f"{field}: must be {condition}, got {value!r}"
  return f"{text}; {fix}" if fix else text


def fail(field: str, condition: str, value: Any, fix: str = "") -> NoReturn:
  """Raises the ``ValueError`` of ``message``; for checks with no helper here."""
  raise ValueError(message(field, condition, value, fix))


def check(
    ok: bool, field: str, condition: str, value: Any, fix: str = ""
) -> None:
  """Raises the uniform error unless ``ok`` (a condition the caller computed)."""
  if not ok:
    fail(field, condition, value, fix)


def _is_real(value: Any) -> bool:
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _as_int(value: Any) -> int | None:
  """``value`` as an int if it is an integer (not a bool), else None."""
  if isinstance(value, bool):
    return None
  try:
    return operator.index(value)
  except TypeError:
    return None


def _real(
    field: str,
    value: Any,
    fix: str,
    within: Callable[[Any], bool],
    condition: str,
) -> float:
  """A real number (not bool) for which `within` holds, as a float."""
  check(_is_real(value) and within(value), field, condition, value, fix)
  return float(value)


def number(field: str, value: Any, fix: str = "") -> float:
  """A finite real number (int or float, not bool); returns it as a float."""
  return _real(field, value, fix, math.isfinite, "a finite number")


def positive(field: str, value: Any, fix: str = "") -> float:
  """A finite number > 0; returns it as a float."""
  return _real(
      field, value, fix, lambda v: 0 < v < math.inf, "a finite number > 0"
  )


def non_negative(field: str, value: Any, fix: str = "") -> float:
  """A finite number >= 0; returns it as a float."""
  return _real(
      field, value, fix, lambda v: 0 <= v < math.inf, "a finite number >= 0"
  )


def in_interval(field: str, value: Any, interval: str, fix: str = "") -> float:
  """A number in ``interval``, written as in maths: ``'(0, 1]'``, ``'[0, 0.5)'``.

  Args:
    field: the config field or argument name.
    value: the value to check.
    interval: ``(`` / ``[`` excludes / includes the lower bound, ``)`` / ``]``
      the upper one; bounds are numbers (``inf`` allowed).
    fix: how to fix a bad value.

  Returns:
    ``value`` as a float.
  """
  low, high = (float(b) for b in interval[1:-1].split(","))
  ok = _is_real(value) and not math.isnan(value)
  if ok:
    above = low < value if interval[0] == "(" else low <= value
    below = value < high if interval[-1] == ")" else value <= high
    ok = above and below
  check(
      ok,
      field,
      f"in {interval}",
      value,
      fix,
  )
  return float(value)


def probability(field: str, value: Any, fix: str = "") -> float:
  """A number in the open interval (0, 1), e.g. delta or a budget share."""
  return in_interval(field, value, "(0, 1)", fix)


def int_at_least(field: str, value: Any, minimum: int, fix: str = "") -> int:
  """An integer >= ``minimum`` (any integer type, not bool); returns an int."""
  as_int = _as_int(value)
  check(
      as_int is not None and as_int >= minimum,
      field,
      f"an int >= {minimum}",
      value,
      fix,
  )
  return as_int


def positive_int(field: str, value: Any, fix: str = "") -> int:
  """An integer >= 1 (a count of steps, records, devices...)."""
  return int_at_least(field, value, 1, fix)


def non_negative_int(field: str, value: Any, fix: str = "") -> int:
  """An integer >= 0 (a seed, a step index, an optional count)."""
  return int_at_least(field, value, 0, fix)


def one_of(
    field: str, value: Any, choices: Iterable[Any], fix: str = ""
) -> Any:
  """One of ``choices`` (compared with ``==``); returns ``value``."""
  choices = tuple(choices)
  check(
      value in choices,
      field,
      "one of " + ", ".join(map(repr, choices)),
      value,
      fix,
  )
  return value


def config_fix(field: str, example: Any = None) -> str:
  """The usual fix of a config field: ``set --config.<field>[=<example>]``."""
  return f"set --config.{field}" + ("" if example is None else f"={example}")


def sample_rate(value: Any) -> float:
  """A Poisson sample rate ``q = B / n`` in (0, 1] (accountant and sampler)."""
  return in_interval(
      "sample_rate",
      value,
      "(0, 1]",
      "q = B / n needs an expected batch size 1 <= B <= n",
  )
