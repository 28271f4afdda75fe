"""Empirical privacy audit: a one-run canary audit per stream, membership
inference, and the white-box audit of the transforms.

  python launch/audit.py --config=configs/switch_sst2.py:tiny \
    --workdir=/tmp/audit_raptor
  python launch/audit.py --config=configs/switch_sst2.py:tiny \
    --workdir=/tmp/audit_mono --config.method=monolithic_lora \
    --config.privacy.epsilon=1

trains once with random canaries (each included with probability 1/2) in
<workdir>/train and writes <workdir>/audit.json: the claimed epsilon, per
stream (shared, expert, or all) the epsilon lower bound at 95% confidence,
and the loss-threshold membership-inference AUROC and TPR at 0.1% / 1% FPR.
An explicit private experiment: keep audit.json as private as the training
data. The bounds are lower bounds, not estimates of the true epsilon.

White-box audit of the DP transforms themselves (no config, about a minute):

  python launch/audit.py --mechanism --workdir=/tmp/audit_mech
"""

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from raptor_jax import process

# First of all, before any library starts a thread: kept host memory on CPU
# hosts (raptor_jax/process.py); one XLA device, as before.
process.setup(argv=sys.argv, cpu_devices=1)

import json
import logging
import pathlib

from absl import app, flags, logging as absl_logging  # pylint: disable=g-multiple-import

from raptor_jax import _validate, entry_flags  # pylint: disable=g-multiple-import

_CONFIG, _WORKDIR = entry_flags.define_run_flags(
    "Training configuration file.",
    "The audit's own directory (audit.json, train/); rerunning reuses its "
    "training run.",
)
_NUM_CANARIES = flags.DEFINE_integer(
    "num_canaries",
    1000,
    "Canaries drawn; each joins the training set with probability 1/2.",
)
_SEED = flags.DEFINE_integer(
    "audit_seed", 0, "Seed of the canaries and of their inclusion."
)
_EXPERT = flags.DEFINE_integer(
    "expert",
    -1,
    "Expert of l* that owns the canaries (-1: the one owning most random "
    "candidates).",
)
_CONFIDENCE = flags.DEFINE_float(
    "confidence", 0.95, "Confidence of the lower bounds."
)
_MECHANISM = flags.DEFINE_bool(
    "mechanism",
    False,
    "Audit the transforms (dp_aggregate, owner_dp_aggregate) and planted "
    "bugs instead of a training run.",
)
_SIGMAS = flags.DEFINE_list(
    "sigmas", ["1", "2"], "--mechanism: noise multipliers."
)
_TRIALS = flags.DEFINE_integer(
    "trials", 100_000, "--mechanism: trials with and without the canary."
)
flags.mark_flags_as_required(["workdir"])


def mechanism_audit(workdir: pathlib.Path) -> None:
  """Every transform, correct and with each planted bug, at every sigma."""
  from raptor_jax import audit  # pylint: disable=g-import-not-at-top

  rows = []
  for sigma in (float(s) for s in _SIGMAS.value):
    for transform in ("dp_aggregate", "owner_dp_aggregate"):
      bugs = [None] + [
          b
          for b in audit.PLANTED_BUGS
          if b != "owner_leak" or transform == "owner_dp_aggregate"
      ]
      for bug in bugs:
        r = audit.audit_transform(
            transform,
            noise_multiplier=sigma,
            trials=_TRIALS.value,
            bug=bug,
            confidence=_CONFIDENCE.value,
        )
        rows.append(r)
        others = ""
        if "other_experts" in r:
          others = " other experts " + ", ".join(
              f"{o['epsilon_lower_bound']:.2f}"
              for o in r["other_experts"].values()
          )
        print(
            f"{transform:<19} {bug or 'correct':<15} sigma {sigma:g}: "
            f"analytic {r['epsilon_analytic']:.3f}  lower bound "
            f"{r['epsilon_lower_bound']:.3f}  AUROC {r['auroc']:.3f}{others}",
            flush=True,
        )
  workdir.mkdir(parents=True, exist_ok=True)
  summary = dict(
      delta=audit.DELTA, trials=_TRIALS.value, bugs=audit.PLANTED_BUGS
  )
  (workdir / "mechanism_audit.json").write_text(
      json.dumps(
          dict(summary, audits=rows), indent=2, sort_keys=True, default=str
      )
  )


def main(argv):
  del argv
  absl_logging.set_verbosity(absl_logging.WARNING)  # orbax/jax chatter
  logging.getLogger("raptor_jax").setLevel(logging.INFO)
  workdir = pathlib.Path(_WORKDIR.value)
  with _validate.errors_exit_in_one_line():
    if _MECHANISM.value:
      mechanism_audit(workdir)
      return
    if _CONFIG.value is None:
      raise ValueError(
          "set --config (or --mechanism for the transforms' audit)"
      )
    from raptor_jax.studies import audit  # pylint: disable=g-import-not-at-top

    result = audit.run(
        _CONFIG.value,
        workdir,
        num_canaries=_NUM_CANARIES.value,
        seed=_SEED.value,
        expert=_EXPERT.value,
        confidence=_CONFIDENCE.value,
    )
    print(audit.summary(result))


if __name__ == "__main__":
  app.run(main)
