"""Runs the micro training config in a fresh process (device counts, jax.distributed).

  python tests/parallel_worker.py WORKDIR '{"num_devices": 4, "method": "raptor"}' \
      [PROCESS_ID NUM_PROCESSES COORDINATOR]
  python tests/parallel_worker.py --runs '[[WORKDIR, OVERRIDES], ...]'   # one process

Set XLA_FLAGS=--xla_force_host_platform_device_count=N in the environment for N
CPU devices. Prints the results dict as JSON on the last line.
"""

import json
import sys


def noise_std(num_devices):
  """Std of the privatized update of all-zero sums, and the expected sigma*C/denominator."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from helpers import micro_model  # pylint: disable=g-import-not-at-top
  from raptor_jax.train import parallel, setup, step  # pylint: disable=g-import-not-at-top

  config, run_data, plan, model, params, bc = micro_model()
  mesh = parallel.make_mesh(num_devices)
  phase = plan.phases[0]
  trainable, frozen = setup.partition(params, phase.parts)
  fns = step.PhaseFunctions(
      model,
      phase,
      mesh=mesh,
      expert_layer=plan.expert_layer,
      num_experts=bc.num_experts,
      learning_rate=1e-3,
      residual="none",
      residual_gamma=1.0,
      key=jax.random.PRNGKey(0),
  )
  opt = fns.init_opt_states(trainable)
  trainable, frozen, opt = parallel.replicate((trainable, frozen, opt), mesh)
  local = config.microbatch_size * num_devices
  batch = {
      k: np.asarray(v[:local])
      for k, v in dict(
          input_ids=run_data.train.input_ids,
          attention_mask=run_data.train.attention_mask,
          labels=run_data.train.labels,
      ).items()
  }
  batch["owners"] = np.zeros(local, np.int32)
  batch, mask = parallel.shard_records(
      (batch, np.zeros(local, np.float32)), mesh
  )
  sums = fns.accumulate(
      trainable, frozen, fns.zero_sums(trainable), batch, mask
  )
  noise = []
  # The first link of each part's chain(privatize_sums, adam), on the replicated state.
  privatize = {name: jax.jit(tx.update) for name, tx in fns.privatizers.items()}
  for _ in range(3):
    for name, part_state in opt.items():
      noisy, noise_state = privatize[name](sums[name], part_state[0])
      opt[name] = (noise_state, *part_state[1:])
      noise += [np.asarray(x).ravel() for x in jax.tree.leaves(noisy)]
  part = phase.parts[0]
  return (
      float(np.std(np.concatenate(noise))),
      part.noise_multiplier * part.l2_clip / part.denominator,
  )


def main(argv):
  if argv[1] == "--noise":
    print(json.dumps(noise_std(int(argv[2]))))
    return
  if argv[1] == "--runs":  # several runs in one process (shared compilations)
    from helpers import micro_config  # pylint: disable=g-import-not-at-top
    from raptor_jax.train import train_and_evaluate  # pylint: disable=g-import-not-at-top

    results = [
        train_and_evaluate(micro_config(**overrides), workdir)
        for workdir, overrides in json.loads(argv[2])
    ]
    print(json.dumps(results, default=str))
    return
  workdir, overrides = argv[1], json.loads(argv[2])
  if len(argv) > 3:
    from raptor_jax.train import parallel  # pylint: disable=g-import-not-at-top

    parallel.initialize_distributed(argv[5], int(argv[4]), int(argv[3]))
  from helpers import micro_config  # pylint: disable=g-import-not-at-top
  from raptor_jax.train import train_and_evaluate  # pylint: disable=g-import-not-at-top

  results = train_and_evaluate(micro_config(**overrides), workdir)
  print(json.dumps(results, default=str))


if __name__ == "__main__":
  main(sys.argv)
