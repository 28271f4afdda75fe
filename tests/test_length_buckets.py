"""Length buckets: every sampled record once, in a bucket that holds it, and
a record's gradient independent of how far its bucket pads it."""

import collections
import dataclasses
import difflib
import itertools
import json
import logging
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raptor_jax import length_buckets, models, ownership, sampling
from raptor_jax.models import hf
from raptor_jax.train import cycle, metrics, parallel, setup, step
from raptor_jax.train import train_and_evaluate
from raptor_jax.train.run import build_run, validate

from helpers import SMALL_FAMILIES, latest_state, load_config_module, micro_config


def test_default_buckets_and_bad_buckets_get_one_line():
  assert length_buckets.default_buckets(64) == (16, 32, 64)
  assert length_buckets.default_buckets(16) == (16,)
  assert length_buckets.default_buckets(8) == (8,)
  assert length_buckets.check_buckets([16, 64], 64) == (16, 64)
  for bad in ((16, 32), (32, 16, 64), (), (0, 64)):
    with pytest.raises(ValueError, match="data.length_buckets") as err:
      length_buckets.check_buckets(bad, 64)
    assert "\n" not in str(err.value)
  with pytest.raises(ValueError, match="more than the last bucket"):
    length_buckets.bucket_index(np.array([3, 70]), (16, 64))


@pytest.mark.parametrize("processes", [1, 3])
def test_every_sampled_record_runs_once_in_a_bucket_that_holds_it(processes):
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 65, 500)
  sample = np.sort(rng.choice(500, 137, replace=False))
  buckets = (16, 32, 64)
  per_host = [
      length_buckets.bucketed_microbatches(
          sample,
          lengths,
          buckets,
          8,
          processes=processes,
          process_index=p,
      )
      for p in range(processes)
  ]
  # The same bucket sequence on every host (collectives line up).
  layouts = [[item.length for item in items] for items in per_host]
  assert all(layout == layouts[0] for layout in layouts)
  assert layouts[0] == sorted(layouts[0])
  seen = []
  for p, items in enumerate(per_host):
    carried = {b: 0 for b in buckets}
    for item in items:
      mb = item.microbatch
      assert mb.indices.shape == mb.mask.shape == (8,)
      real = mb.indices[mb.mask > 0] * processes + p  # global indices
      assert np.all(lengths[real] <= item.length)
      smaller = [b for b in buckets if b < item.length]
      if smaller:  # above its own bucket: only a carried remainder
        carried[item.length] += int(np.sum(lengths[real] <= smaller[-1]))
      seen += real.tolist()
    assert all(c < 8 for c in carried.values()), carried
  assert sorted(seen) == sample.tolist()
  assert (
      length_buckets.bucketed_microbatches(
          np.array([], np.int64), lengths, buckets, 8
      )
      == []
  )


SIZES = types.SimpleNamespace(
    d_model=16,
    d_kv=4,
    d_ff=24,
    num_layers=2,
    num_heads=2,
    num_experts=4,
    expert_capacity=3,  # drops tokens of a 12-token record
    sparse_step=1,
    num_kv_heads=1,
    top_k=2,
    norm_topk_prob=True,
    num_shared_experts=1,
    first_k_dense=1,
    kv_lora_rank=8,
)


@pytest.mark.slow  # ~25 s per family; the README's test command stays < 6 min
@pytest.mark.parametrize("family", ["switch", "olmoe", "deepseek"])
def test_padding_inside_a_bucket_never_changes_a_records_gradient(family):
  """One 12-token record padded to 16 and 40 tokens: the same logits
  and the same gradient of every parameter (right padding is masked;
  routing and capacity see the real tokens first)."""
  backbone = hf.backbone_from_sizes(family, SIZES, 50, dispatch="dense")
  pooling = "mean" if family == "switch" else "last"
  model = models.SequenceClassifier(backbone, 2, pooling=pooling)
  ids = jnp.asarray(np.random.default_rng(1).integers(2, 50, (1, 12)))
  params = model.init(
      jax.random.PRNGKey(0), ids, jnp.ones_like(ids, jnp.int32)
  )["params"]

  def loss(params, length):
    padded = jnp.pad(ids, ((0, 0), (0, length - 12)))
    mask = (jnp.arange(length) < 12)[None].astype(jnp.int32)
    logits, _ = model.apply({"params": params}, padded, mask)
    return jax.nn.log_softmax(logits)[0, 1], logits

  results = {
      length: jax.grad(loss, has_aux=True)(params, length)
      for length in (16, 40)
  }
  grads16, logits16 = results[16]
  for length in (40,):
    grads, logits = results[length]
    np.testing.assert_allclose(logits, logits16, rtol=1e-5, atol=1e-6)
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(grads16)):
      np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-6)


# -- wired into the trainer ----------------------------------------------------

BUCKETS = (16, 32)  # the micro task's records: 10 to 22 of 32 tokens


def _config(family="switch", buckets=BUCKETS, **overrides):
  return micro_config(
      **SMALL_FAMILIES[family], **{"data.length_buckets": buckets}, **overrides
  )


def _unbucketed(run):
  config = run.config.copy_and_resolve_references()
  config.data.length_buckets = ()
  return dataclasses.replace(run, config=config)


def test_the_config_default_follows_the_task_and_max_length():
  config = micro_config()
  assert config.data.length_buckets is None  # the base config's default
  assert length_buckets.from_config(config) == ()  # the synthetic task
  glue = load_config_module("glue").get_config("task=sst2,preset=small")
  assert length_buckets.from_config(glue) == (16, 32, 64)
  glue.data.max_length = 128
  assert length_buckets.from_config(glue) == (16, 32, 64, 128)
  custom = load_config_module("custom").get_config("cpu")
  assert length_buckets.from_config(custom) == (16, 32, 64)
  assert length_buckets.from_config(_config()) == BUCKETS
  with pytest.raises(ValueError, match="data.length_buckets"):
    validate(_config(buckets=(8, 16)))  # before any data is loaded


def _sums(fns, run, trainable, frozen, sample, mesh, buckets):
  """A phase's clipped sums of `sample`, by the trainer's microbatches."""
  lengths = length_buckets.record_lengths(run.data.train.attention_mask)
  sums = fns.zero_sums(trainable)
  for length, mb in cycle.microbatches(
      sample, run.config.microbatch_size, buckets, lengths
  ):
    batch, mask = parallel.shard_records(
        (cycle.batch(run.data.train, run.owners, mb.indices, length), mb.mask),
        mesh,
    )
    assert batch["input_ids"].shape[1] == (length or 32)
    sums = fns.accumulate(trainable, frozen, sums, batch, mask)
  return sums


def _assert_close(a, b, rtol=1e-5):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_allclose(
        x, y, rtol=rtol, atol=rtol * max(np.abs(y).max(), 1e-6)
    )


@pytest.mark.slow
@pytest.mark.parametrize("family", ["switch", "olmoe", "deepseek"])
def test_bucketed_update_equals_the_unbucketed_one(family):
  """Per record (padding inside a bucket changes no record's clipped,
  residual-weighted gradient: bucket length vs max_length) and per step
  (the clipped sums without noise, and the noisy update with a fixed noise
  key) for every phase of RAPTOR."""
  run = build_run(_config(family))
  mesh = parallel.make_mesh(1)
  secret = bytes(32)
  phase_fns = cycle.phase_functions(run, mesh, secret)
  state, frozen = cycle.initial_state(run, phase_fns, mesh)
  trainable = state.trainable
  lengths = length_buckets.record_lengths(run.data.train.attention_mask)
  for phase, fns in zip(run.plan.phases, phase_fns):
    sample = sampling.poisson_sample(
        run.n, run.plan.sample_rate, seed=1, stream=phase.stream, step=0
    )
    # Per record: every record of the sample, at its bucket and at 32.
    per_record = jax.jit(fns.released_per_record)
    for length, mb in cycle.microbatches(
        sample, run.config.microbatch_size, BUCKETS, lengths
    ):
      short = cycle.batch(run.data.train, run.owners, mb.indices, length)
      full = cycle.batch(run.data.train, run.owners, mb.indices)
      _assert_close(
          per_record(trainable, frozen, short, mb.mask),
          per_record(trainable, frozen, full, mb.mask),
          rtol=2e-5,
      )
    # Per step, noise off: the clipped sums.
    bucketed = _sums(fns, run, trainable, frozen, sample, mesh, BUCKETS)
    plain = _sums(fns, run, trainable, frozen, sample, mesh, ())
    _assert_close(bucketed, plain)
    assert any(np.abs(x).max() > 0 for x in jax.tree.leaves(plain))
  # Per step, noise on (the run's noise keys): a whole cycle of both phases.
  writer = metrics.MetricWriter(None, just_logging=True)
  got = cycle.train_cycle(run, phase_fns, mesh, state, frozen, secret, writer)
  want = cycle.train_cycle(
      _unbucketed(run), phase_fns, mesh, state, frozen, secret, writer
  )
  _assert_close(got.trainable, want.trainable)
  assert got.ledger.to_dict() == want.ledger.to_dict()


def test_one_compile_per_phase_and_bucket_and_the_same_cycles(monkeypatch):
  """Several cycles trace each phase's accumulate once per bucket that ran,
  at that bucket's length, and never again; the cycles (noisy updates from
  the run's fixed noise keys) equal those without buckets (whose
  max_length microbatches share the last bucket's compilation)."""
  traces = collections.Counter()
  accumulate = step.PhaseFunctions._accumulate

  def counted(self, trainable, frozen, sums, batch, mask):
    traces[self.phase.name, batch["input_ids"].shape[1]] += 1
    return accumulate(self, trainable, frozen, sums, batch, mask)

  monkeypatch.setattr(step.PhaseFunctions, "_accumulate", counted)
  run = build_run(_config())
  mesh = parallel.make_mesh(1)
  secret = bytes(32)
  phase_fns = cycle.phase_functions(run, mesh, secret)
  start, frozen = cycle.initial_state(run, phase_fns, mesh)
  writer = metrics.MetricWriter(None, just_logging=True)
  states = {}
  for name, r in (("bucketed", run), ("plain", _unbucketed(run))):
    state = start
    for _ in range(3):
      state = cycle.train_cycle(
          r, phase_fns, mesh, state, frozen, secret, writer
      )
    states[name] = state
  assert states["bucketed"].cycle == 3
  assert set(traces.values()) == {1}, traces
  assert {name for name, _ in traces} == {p.name for p in run.plan.phases}
  assert {length for _, length in traces} == set(BUCKETS)  # both ran
  _assert_close(states["bucketed"].trainable, states["plain"].trainable)
  assert states["bucketed"].ledger.to_dict() == states["plain"].ledger.to_dict()


def test_evaluation_layer_selection_and_owner_map_use_the_buckets():
  """The same metrics, layer table and owners as at max_length, from
  batches of each bucket's length."""
  config = _config()
  plain = _config(buckets=())
  run_data = setup.load_run_data(config)
  backbone, params = setup.load_backbone(config, run_data)
  widths = []
  router = ownership._router_fn(backbone, params)
  spy = lambda ids, mask: widths.append(ids.shape[1]) or router(ids, mask)
  args = (run_data.train.input_ids, run_data.train.attention_mask)
  rule = ownership.owner_rule(backbone.config, "count")
  got = ownership.owners_per_layer(
      spy, *args, batch_size=64, buckets=BUCKETS, **rule
  )
  np.testing.assert_array_equal(
      got, ownership.owners_per_layer(router, *args, batch_size=64, **rule)
  )
  assert set(widths) == set(BUCKETS)
  layer, table = ownership.select_expert_layer(
      config, backbone, params, run_data
  )
  assert (layer, table) == ownership.select_expert_layer(
      plain, backbone, params, run_data
  )
  np.testing.assert_array_equal(
      ownership.private_owner_map(
          config, backbone, params, run_data.train, layer
      ),
      ownership.private_owner_map(
          plain, backbone, params, run_data.train, layer
      ),
  )
  model = models.SequenceClassifier(backbone, 2, pooling="mean")
  head = model.init(jax.random.PRNGKey(0), *(jnp.asarray(a[:2]) for a in args))[
      "params"
  ]
  logits = jax.jit(lambda i, m: model.apply({"params": head}, i, m)[0])
  dev = run_data.dev
  evaluated = [
      metrics.evaluate(
          logits,
          dev.input_ids,
          dev.attention_mask,
          dev.labels,
          ("accuracy", "f1"),
          16,
          buckets=b,
      )
      for b in (BUCKETS, ())
  ]
  assert evaluated[0] == evaluated[1]


def _shape(value):
  """A JSON value with every number replaced by its type (structure only)."""
  if isinstance(value, dict):
    return {k: _shape(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_shape(v) for v in value]
  return type(value).__name__ if isinstance(value, (int, float)) else value


def _public_outputs(workdir, log_text):
  """{name: what a run logs and writes publicly}, numbers masked, paths cut."""
  # (the fixed-seed warning is given once per process: left out; so are
  # the compile progress lines: one per program of every bucket the config
  # names, in the order the threads finish, whatever the data holds)
  lines = [
      l
      for l in log_text.splitlines()
      if "secret_seed is fixed" not in l
      and not re.search(r" compiling .*\d+/\d+ \(", l)
  ]
  text = "\n".join(lines).replace(str(workdir), "W")
  outputs = {"log": re.sub(r"\d+(\.\d+)?", "#", text)}
  for name in ("results.json", "privacy_report.json", "layer_selection.json"):
    outputs[name] = _shape(json.loads((workdir / name).read_text()))
  outputs["metrics.jsonl"] = [
      _shape(json.loads(line))
      for line in (workdir / "metrics.jsonl").read_text().splitlines()
  ]
  return outputs


@pytest.mark.slow
def test_the_trainer_by_length_reaches_the_padded_result(tmp_path, caplog):
  """The trainer end to end (fixed secret seed): the same dev metrics and
  parameters up to float rounding, and no trace of the buckets in what it
  logs or writes: the log, metrics.jsonl, TensorBoard and the reports hold
  the same fields as without buckets (no per-bucket counts), and only
  config.json names them."""
  results, outputs = {}, {}
  for name, buckets in (("a", ()), ("b", BUCKETS)):
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="raptor_jax"):
      results[name] = train_and_evaluate(
          _config(buckets=buckets), str(tmp_path / name)
      )
    outputs[name] = _public_outputs(tmp_path / name, caplog.text)
    for path in (tmp_path / name).rglob("*"):
      if path.is_file() and path.name != "config.json":
        assert b"bucket" not in path.read_bytes().lower(), path
    assert "bucket" not in caplog.text.lower()
  assert results["b"]["accuracy"] == results["a"]["accuracy"]
  _, got, _ = latest_state(tmp_path / "b")
  _, want, _ = latest_state(tmp_path / "a")
  _assert_close(got["trainable"], want["trainable"], rtol=1e-4)
  diff = list(
      difflib.unified_diff(
          outputs["a"].pop("log").splitlines(),
          outputs["b"].pop("log").splitlines(),
      )
  )
  assert not diff, "\n".join(diff)
  assert outputs["b"] == outputs["a"]


@pytest.mark.slow
def test_two_processes_with_buckets_agree_with_one(tmp_path):
  """jax.distributed with two processes (each holding its own records and
  their lengths only; the hosts agree on the microbatches per bucket): the
  same parameters and ledger as one process, with and without buckets."""
  from test_parallel import _assert_same_state, _free_port, _run

  bucketed = {"stop_after_cycles": 1, "data.length_buckets": list(BUCKETS)}
  _run(tmp_path / "one", {**bucketed, "num_devices": 1}, devices=1)
  _run(
      tmp_path / "plain", {"stop_after_cycles": 1, "num_devices": 1}, devices=1
  )
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = [
      _run(
          tmp_path / "multi",
          bucketed,
          devices=1,
          process=(pid, 2, coordinator),
      )
      for pid in range(2)
  ]
  for proc in procs:
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-4000:]
  _assert_same_state(tmp_path / "one", tmp_path / "multi")
  _assert_same_state(tmp_path / "one", tmp_path / "plain")


def _plan_tokens(sizes, buckets, m, carry):
  """(tokens, microbatches) of one carry-or-not choice per boundary."""
  tokens = count = moved = 0
  for k, (n, length) in enumerate(zip(sizes, buckets)):
    n += moved
    moved = n % m if k < len(buckets) - 1 and carry[k] else 0
    batches = -(-(n - moved) // m)
    tokens, count = tokens + batches * m * length, count + batches
  return tokens, count


@pytest.mark.parametrize("seed", range(20))
def test_carrying_remainders_up_is_the_cheapest_layout(seed):
  """`carried_counts` processes the fewest tokens of all 2^(K-1) carry
  choices (brute force), never more than every record in its own bucket,
  and every record still runs in a bucket that holds it."""
  rng = np.random.default_rng(seed)
  buckets = tuple(sorted(rng.choice(np.arange(8, 129, 8), 4, replace=False)))
  m = int(rng.integers(2, 40))
  lengths = rng.integers(1, buckets[-1] + 1, int(rng.integers(0, 300)))
  own = length_buckets.bucket_index(lengths, buckets)
  sizes = np.bincount(own, minlength=len(buckets))
  runs = length_buckets.carried_counts(sizes, buckets, m)
  assert runs.sum() == len(lengths)
  tokens = sum(-(-int(r) // m) * m * b for r, b in zip(runs, buckets))
  brute = min(
      _plan_tokens(sizes, buckets, m, carry)[0]
      for carry in itertools.product((0, 1), repeat=len(buckets) - 1)
  )
  assert tokens == brute
  assert tokens <= _plan_tokens(sizes, buckets, m, (0,) * 3)[0]
  which = length_buckets.carried_buckets(lengths, buckets, m)
  assert np.all(which >= own)  # only ever up: padding added, nothing cut
  np.testing.assert_array_equal(
      np.bincount(which, minlength=len(buckets)), runs
  )
