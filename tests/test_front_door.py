"""transforms.make_private (the one-call front door), the shape and
MultiSteps guards, the missing-extras line, and the README's snippets."""

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from raptor_jax import accounting, grads, transforms

from helpers import ROOT

_KW = dict(
    target_epsilon=2.0,
    delta=1e-5,
    n=1000,
    batch_size=100,
    epochs=3,
    l2_clip=1.0,
)


def _private(secret=b"s" * 32, **overrides):
  return transforms.make_private(
      optax.sgd(1.0), **{**_KW, "secret": secret, **overrides}
  )


def test_make_private_is_calibrated_to_the_budget_and_counts_each_step():
  private = _private()
  assert private.steps == 30  # 3 epochs of ceil(1000 / 100) steps
  assert private.noise_multiplier == accounting.calibrate_dpsgd(
      target_epsilon=2.0, delta=1e-5, sample_rate=0.1, steps=30
  )
  assert private.accountant.epsilon() == 0.0
  for t, _ in enumerate(private.microbatches, start=1):
    assert private.accountant.steps == t  # counted when handed out
  spent = private.accountant.epsilon()
  assert (1 - accounting.CALIBRATION_RTOL) * 2.0 <= spent <= 2.0
  assert spent == pytest.approx(
      accounting.dpsgd_epsilon(
          noise_multiplier=private.noise_multiplier,
          sample_rate=0.1,
          steps=30,
          delta=1e-5,
      )
  )


def test_samples_are_poisson_padded_and_a_function_of_the_secret():
  first = [[mb.indices.tolist() for mb in s] for s in _private().microbatches]
  again = [[mb.indices.tolist() for mb in s] for s in _private().microbatches]
  other = _private(secret=b"t" * 32).microbatches
  assert first == again and first != [
      [mb.indices.tolist() for mb in s] for s in other
  ]
  sizes = [
      sum(int(mb.mask.sum()) for mb in step)
      for step in _private(epochs=20).microbatches
  ]
  assert 90 < np.mean(sizes) < 110  # E|sample| = q n = 100
  for step in _private(microbatch_size=32).microbatches:
    assert all(mb.indices.shape == (32,) for mb in step)


@pytest.mark.parametrize("experts", [None, 4])
def test_the_noise_has_std_sigma_c_over_the_public_denominator(experts):
  kw = dict(l2_clip=2.0)
  if experts:
    private = transforms.make_private_experts(
        optax.sgd(1.0), num_experts=experts, secret=b"k" * 32, **_KW | kw
    )
    params = {"w": jnp.zeros((experts, 5000))}
  else:
    private = _private(**kw)
    params = {"w": jnp.zeros(20000)}
  state = private.tx.init(params)
  updates, _ = private.tx.update(grads.zeros_like_f32(params), state, params)
  denominator = 100 / (experts or 1)
  want = private.noise_multiplier * 2.0 / denominator
  assert np.std(np.asarray(updates["w"])) == pytest.approx(want, rel=0.03)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(secret="not bytes"), "secret"),
        (dict(secret=b"short"), "secret"),
        (dict(batch_size=2000), "batch_size"),
        (dict(delta=0.01), "delta"),
        (dict(target_epsilon=-1.0), "target_epsilon"),
    ],
)
def test_bad_arguments_are_one_line(overrides, field):
  with pytest.raises(ValueError) as error:
    _private(**overrides)
  assert "\n" not in str(error.value) and field in str(error.value)


def _dp(num_experts=None):
  if num_experts:
    return transforms.owner_dp_aggregate(1.0, 1.0, num_experts, 2.0, 0)
  return transforms.dp_aggregate(1.0, 1.0, 4.0, 0)


def test_a_mean_gradient_is_refused_in_one_line():
  params = {"w": jnp.zeros(3)}
  tx = optax.chain(_dp(), optax.sgd(0.1))
  state = tx.init(params)
  with pytest.raises(ValueError) as error:
    tx.update({"w": jnp.ones(3)}, state, params)  # a mean, no record axis
  assert str(error.value) == (
      "dp_aggregate updates['w']: must be per-record gradients of shape"
      " (n, *(3,)), got shape (3,); pass per-record gradients, e.g."
      " jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, batch), not a"
      " mean gradient"
  )
  # Without params at update time, the shapes seen by init decide.
  with pytest.raises(ValueError, match="per-record gradients"):
    _dp_alone = _dp()
    _dp_alone.update({"w": jnp.ones(3)}, _dp_alone.init(params))
  with pytest.raises(ValueError, match="one record count n"):
    tx.update({"w": jnp.ones((4, 3))}, state, params, mask=jnp.ones(5))
  updates, _ = tx.update({"w": jnp.ones((4, 3))}, state, params)
  assert updates["w"].shape == (3,)


def test_owner_updates_must_be_per_record_slices():
  stacked = {"w": jnp.zeros((4, 3))}
  tx = _dp(num_experts=4)
  state = tx.init(stacked)
  owners = jnp.array([0, 1, 3])
  with pytest.raises(ValueError) as error:
    tx.update({"w": jnp.ones((4, 3))[None]}, state, stacked, owners=owners)
  assert str(error.value).startswith(
      "owner_dp_aggregate updates['w']: must be per-record gradients of shape"
      " (n, *(3,)), got shape (1, 4, 3)"
  )
  updates, _ = tx.update({"w": jnp.ones((3, 3))}, state, stacked, owners=owners)
  assert updates["w"].shape == (4, 3)


@pytest.mark.parametrize("name", ["dp_aggregate", "owner", "privatize_sums"])
def test_multisteps_is_refused_in_one_line(name):
  if name == "privatize_sums":
    inner, grads_in = transforms.privatize_sums(1.0, 1.0, 4.0, 0), jnp.ones(3)
    params, extra = jnp.zeros(3), {}
  elif name == "owner":
    inner, grads_in = _dp(num_experts=2), jnp.ones((5, 3))
    params, extra = jnp.zeros((2, 3)), dict(owners=jnp.zeros(5, jnp.int32))
    name = "owner_dp_aggregate"
  else:
    inner, grads_in = _dp(), jnp.ones((5, 3))
    params, extra = jnp.zeros(3), {}
  tx = optax.MultiSteps(optax.chain(inner, optax.sgd(0.1)), every_k_schedule=2)
  with pytest.raises(ValueError) as error:
    tx.update(grads_in, tx.init(params), params, **extra)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"{name}: must not run inside optax.MultiSteps")


def test_missing_extras_name_the_install_command():
  script = textwrap.dedent("""
      import sys

      class NoFlax:
        def find_spec(self, name, path=None, target=None):
          if name.split('.')[0] in ('flax', 'datasets'):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

      sys.meta_path.insert(0, NoFlax())
      from raptor_jax import transforms  # the DP core needs no extra
      try:
        import raptor_jax.train
      except ModuleNotFoundError as e:
        print(e)
  """)
  out = subprocess.run(
      [sys.executable, "-c", script],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.stdout.strip().endswith(
      "which is not installed; pip install 'raptor_jax[train]'"
  ), out.stderr[-2000:]


def _readme_blocks(path="README.md"):
  """The python blocks of the page's 'Use the DP transforms ...' section."""
  text = (ROOT / path).read_text()
  section = text.split("DP transforms in your own JAX project")[1]
  section = section.split("\n## ")[0]
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("path", ["README.md", "docs/transforms.md"])
def test_the_readme_snippets_run_as_written(capsys, path):
  blocks = _readme_blocks(path)
  assert len(blocks) == 3
  namespace = {}
  for block in blocks:  # each continues the one before
    exec(compile(block, path, "exec"), namespace)  # pylint: disable=exec-used
  printed = capsys.readouterr().out
  assert re.fullmatch(
      r"sigma \d+\.\d\d over 50 steps: epsilon (1\.99|2\.00) at delta 1e-5\n",
      printed,
  ), printed
  params = namespace["params"]
  assert abs(float(params["w"][1]) + 2.0) < 1.0  # learnt y = x @ (1, -2, .5)
  assert namespace["updates"]["w"].shape == (4, 3)
