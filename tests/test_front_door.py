"""raptor_jax.make_private (the one-call front door): its calibration, its
refusals of every use that would release more than the accountant counts
(issue 44), the shape and MultiSteps guards, the missing-extras line, and
the README's snippets."""

import json
import os
import re
import textwrap
import warnings

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import raptor_jax
from raptor_jax import accounting, calibration, grads, transforms

from helpers import ROOT, run_python

_KW = dict(
    target_epsilon=2.0,
    delta=1e-5,
    batch_size=100,
    epochs=3,
    l2_clip=1.0,
)


def _data(n=1000):
  x = np.random.default_rng(0).normal(size=(n, 3)).astype(np.float32)
  return {"x": x, "id": np.arange(n)}


def _private(secret=None, data=None, **overrides):
  return raptor_jax.make_private(
      optax.sgd(1.0),
      **{
          **_KW,
          "data": _data() if data is None else data,
          "secret": secret or os.urandom(32),
          **overrides,
      },
  )


def _indices(step):
  return [batch["id"][mask > 0].tolist() for batch, mask in step]


def test_make_private_is_calibrated_to_the_budget_and_counts_each_step():
  private = _private()
  assert private.steps == 30  # 3 epochs of ceil(1000 / 100) steps
  assert private.noise_multiplier == calibration.calibrate_dpsgd(
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


def test_samples_are_poisson_padded_rows_of_the_data():
  sizes = []
  for step in _private(epochs=20).microbatches:
    ids = sum(_indices(step), [])
    assert len(set(ids)) == len(ids)  # a record enters a step at most once
    sizes.append(len(ids))
    for batch, mask in step:
      assert batch["x"].shape == (32, 3) and mask.shape == (32,)
      np.testing.assert_array_equal(batch["x"], _data()["x"][batch["id"]])
  assert 90 < np.mean(sizes) < 110  # E|sample| = q n = 100


@pytest.mark.parametrize("experts", [None, 4])
def test_the_noise_has_std_sigma_c_over_the_public_denominator(experts):
  kw = dict(l2_clip=2.0)
  if experts:
    private = raptor_jax.make_private_experts(
        optax.sgd(1.0),
        num_experts=experts,
        data=_data(),
        secret=os.urandom(32),
        **_KW | kw,
    )
    params = {"w": jnp.zeros((experts, 5000))}
  else:
    private = _private(**kw)
    params = {"w": jnp.zeros(20000)}
  state = private.tx.init(params)
  next(iter(private.microbatches))
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
        (dict(data={"x": np.zeros((10, 2)), "y": np.zeros(9)}), "data"),
        (dict(data=["a", "b"]), "data"),
        (dict(allow_overspend="yes"), "allow_overspend"),
        (dict(resume={"version": 1}), "resume"),
    ],
)
def test_bad_arguments_are_one_line(overrides, field):
  with pytest.raises(ValueError) as error:
    _private(**overrides)
  assert "\n" not in str(error.value) and field in str(error.value)


# Issue 44: no use of the front door releases more than its accountant counts.


def _apply(private):
  params = {"w": jnp.zeros(3)}

  @jax.jit
  def apply(opt_state, sums):  # noise only: the accounting is what is tested
    return private.tx.update(sums, opt_state, params)[1]

  return apply, private.tx.init(params), grads.zeros_like_f32(params)


def _dp_accounting_epsilon(private, released):
  """dp_accounting's PLD epsilon of what was released: sample t released
  released[t] times with fresh noise is ONE Poisson-sampled Gaussian with
  sigma / sqrt(released[t]) (the samples released k times, self-composed)."""
  pld = dp_accounting.pld.PLDAccountant(
      value_discretization_interval=accounting.VALUE_DISCRETIZATION_INTERVAL
  )
  for k in sorted(set(released) - {0}):
    pld.compose(
        dp_accounting.PoissonSampledDpEvent(
            private.accountant.sample_rate,
            dp_accounting.GaussianDpEvent(private.noise_multiplier / k**0.5),
        ),
        released.count(k),
    )
  return pld.get_epsilon(private.accountant.delta)


@pytest.mark.parametrize("target, epochs, passes", [(2.0, 5, 5), (1.0, 1, 2)])
def test_an_opacus_style_epoch_loop_never_under_reports(target, epochs, passes):
  # The README's numbers: an epoch loop around private.microbatches (which
  # already spans every epoch) replayed each Poisson sample `passes` times,
  # while the accountant counted passes * steps fresh steps: 4.55 reported
  # for 8.43 spent (target 2, 50 steps, 5 passes), 1.33 for 1.88 (target 1,
  # 10 steps, 2 passes). Now the second pass refuses in one line.
  private = _private(target_epsilon=target, epochs=epochs)
  apply, opt_state, sums = _apply(private)
  released = [0] * private.steps
  with pytest.raises(ValueError) as error:
    for _ in range(passes):
      for t, _ in enumerate(private.microbatches):
        opt_state = apply(opt_state, sums)
        released[t] += 1
  assert "\n" not in str(error.value)
  assert "from_step(t)" in str(error.value)
  assert released == [1] * private.steps
  reported = private.accountant.epsilon()
  assert reported >= _dp_accounting_epsilon(private, released)
  assert reported <= target


@pytest.mark.parametrize(
    "target, epochs, passes, spent",
    [(2.0, 5, 5, 8.43), (1.0, 1, 2, 1.88)],
)
def test_a_replay_opted_into_is_accounted_as_released(
    target, epochs, passes, spent
):
  private = _private(target_epsilon=target, epochs=epochs, allow_overspend=True)
  apply, opt_state, sums = _apply(private)
  released = [0] * private.steps
  with pytest.warns(UserWarning, match="allow_overspend") as caught:
    for p in range(passes):
      steps = private.microbatches.from_step(0) if p else private.microbatches
      for t, _ in enumerate(steps):
        opt_state = apply(opt_state, sums)
        released[t] += 1
  assert len(caught) == 1  # once, not once per replayed step
  assert released == [passes] * private.steps
  truth = _dp_accounting_epsilon(private, released)
  assert round(truth, 2) == spent
  assert private.accountant.epsilon() >= truth
  assert private.accountant.epsilon() == pytest.approx(truth, rel=1e-6)


def test_a_replay_is_refused_unless_opted_into():
  private = _private(epochs=1)
  for t, _ in enumerate(private.microbatches):
    if t == 6:
      break  # steps 0-6 handed out
  with pytest.raises(ValueError) as error:
    next(private.microbatches.from_step(5))
  assert str(error.value) == (
      "private.microbatches: step 5's Poisson sample was already released,"
      " and releasing it again spends past the target epsilon 2; the first"
      " step not yet released is 7 (resume with"
      " private.microbatches.from_step(t)), or pass make_private(...,"
      " allow_overspend=True) to release it again, accounted"
  )
  assert len(list(private.microbatches.from_step(7))) == 3
  assert private.accountant.steps == 10
  assert private.accountant.epsilon() <= 2.0


def test_two_runs_with_one_secret_share_neither_samples_nor_noise():
  secret, params = os.urandom(32), {"w": jnp.zeros(20000)}
  noise, samples = [], []
  for _ in range(2):
    private = _private(secret=secret)
    samples.append([_indices(step) for step in private.microbatches])
    updates, _ = private.tx.update(
        grads.zeros_like_f32(params), private.tx.init(params), params
    )
    noise.append(np.asarray(updates["w"]))
  assert samples[0] != samples[1]
  assert abs(np.corrcoef(noise[0], noise[1])[0, 1]) < 0.05  # was 1.0


def test_every_index_is_a_row_of_the_data_with_jax_arrays():
  # With `n` given apart from the data, n = 2000 over 1000 jax rows read
  # record 999 for every index past it (one step took it 43 times). The
  # data now decides n, and the microbatches are its own rows.
  data = jax.tree.map(jnp.asarray, _data())
  private = _private(data=data, batch_size=500, epochs=1)
  assert private.accountant.sample_rate == 0.5  # B / n, n = 1000 rows
  for step in private.microbatches:
    ids = sum(_indices(step), [])
    assert len(ids) == len(set(ids))
  with pytest.raises(TypeError):
    _private(data=data, n=2000)


def test_one_update_per_microbatch_is_refused():
  # 64 noisy releases for 10 steps, and the accountant counted 10.
  private = _private(epochs=1)
  apply, opt_state, sums = _apply(private)
  with pytest.raises(ValueError) as error:
    for step in private.microbatches:
      for _ in step:
        opt_state = apply(opt_state, sums)
  message = str(error.value)
  assert message.startswith("tx.update: ran ") and "\n" not in message
  assert "never once per microbatch" in message
  with pytest.raises(ValueError, match="tx.update: ran"):
    private.accountant.epsilon()  # no report of an unbounded spend


def test_updates_without_its_samples_are_refused():
  # The user's own batches: epsilon() stayed 0.0 after 10 noisy updates.
  private = _private(epochs=1)
  apply, opt_state, sums = _apply(private)
  for _ in range(10):
    opt_state = apply(opt_state, sums)
  with pytest.raises(ValueError) as error:
    private.accountant.epsilon()
  assert str(error.value) == (
      "tx.update: released 10 noisy updates, but private.microbatches handed"
      " out no Poisson sample, so the spend cannot be accounted; build every"
      " step from private.microbatches (the accountant covers only its"
      " samples)"
  )


def test_a_resumed_process_reports_the_whole_run():
  # A second process resumed at step 25 of 50 reported epsilon 1.32 where
  # the run spent 2.00. The saved state carries the ledger (and the nonce,
  # so the resumed run draws its own samples); without it, refused.
  secret, kw = os.urandom(32), dict(epochs=5)
  first = _private(secret=secret, **kw)
  head = [_indices(s) for _, s in zip(range(25), first.microbatches)]
  saved = json.loads(json.dumps(first.accountant.state_dict()))
  whole = [_indices(s) for s in first.microbatches.from_step(25)]
  assert first.accountant.epsilon() == pytest.approx(2.0, rel=2e-3)

  fresh = _private(secret=secret, **kw)  # a new process, no saved state
  with pytest.raises(ValueError) as error:
    fresh.microbatches.from_step(25)
  assert str(error.value).startswith(
      "private.microbatches.from_step(25): 25 steps before it (the first: 0)"
      " are not in the accountant, so epsilon() would report the resumed"
      " part alone; pass make_private(..., resume=saved)"
  )
  resumed = _private(secret=secret, resume=saved, **kw)
  assert resumed.accountant.epsilon() == pytest.approx(
      accounting.dpsgd_epsilon(
          noise_multiplier=resumed.noise_multiplier,
          sample_rate=0.1,
          steps=25,
          delta=1e-5,
      )
  )
  with pytest.raises(ValueError, match="iterate it once"):
    iter(resumed.microbatches)  # from step 0 again: a replay
  tail = [_indices(s) for s in resumed.microbatches.from_step(25)]
  assert head and tail == whole  # the run's own samples
  assert resumed.accountant.epsilon() == first.accountant.epsilon()
  with pytest.raises(ValueError, match="resume"):
    _private(secret=secret, resume=saved, epochs=4)  # another run's state


def test_the_accountant_never_under_reports():
  # Whatever the loop did (broken off, resumed, replayed with the opt-in),
  # the report is at least dp_accounting's epsilon of what was released.
  private = _private(target_epsilon=0.5, epochs=2, allow_overspend=True)
  apply, opt_state, sums = _apply(private)
  released = [0] * private.steps
  plan = [(0, 7), (3, 12), (12, 20), (0, 5)]  # (first step, stop before)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for i, (first, stop) in enumerate(plan):
      steps = (
          private.microbatches.from_step(first) if i else private.microbatches
      )
      for t, _ in zip(range(first, stop), steps):  # range first: no extra
        opt_state = apply(opt_state, sums)
        released[t] += 1
      assert private.accountant.epsilon() >= _dp_accounting_epsilon(
          private, released
      )
  assert max(released) == 3 and min(released) == 1


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
  out = run_python(
      "-c",
      script,
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
