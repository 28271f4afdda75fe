"""The test session's own set-up (tests/conftest.py)."""

import gc

import conftest


def test_the_session_end_freezes_the_heap():
  """A clean test run (issue 48.7): the end of the session must not run
  full garbage collections over the heap (see `conftest.pytest_unconfigure`)."""
  assert conftest.pytest_unconfigure.pytest_impl["tryfirst"]
  frozen = gc.get_freeze_count()
  try:
    conftest.pytest_unconfigure(None)
    assert gc.get_freeze_count() > frozen
  finally:
    gc.unfreeze()
