"""The docstring examples of the DP core run and print what they claim."""

import doctest
import importlib

import pytest

DP_CORE = (
    'transforms',
    'grads',
    'sampling',
    'accounting',
    'ledger',
    'length_buckets',
    'private',
)


@pytest.mark.parametrize('name', DP_CORE)
def test_docstring_examples_pass(name):
  module = importlib.import_module(f'raptor_jax.{name}')
  result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.attempted > 0, f'raptor_jax.{name} has no docstring example'
  assert result.failed == 0, f'{result.failed} failing example(s), see above'


def test_a_wrong_example_fails():
  """The check above is not vacuous: a wrong expected output is caught."""
  runner = doctest.DocTestRunner(verbose=False)
  test = doctest.DocTestParser().get_doctest(
      '>>> 1 + 1\n3\n', {}, 'wrong', None, 0
  )
  with open('/dev/null', 'w') as devnull:
    runner.run(test, out=devnull.write)
  assert runner.failures == 1
