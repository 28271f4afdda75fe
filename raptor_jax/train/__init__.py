"""Training: RAPTOR, its baselines and ablations through one loop.

from raptor_jax.train import train_and_evaluate
results = train_and_evaluate(config, workdir)
"""

from raptor_jax import _validate

with _validate.needs_extra("raptor_jax.train"):  # flax, orbax, datasets, ...
  from raptor_jax.train.config import base_config
  from raptor_jax.train.loop import train_and_evaluate
  from raptor_jax.train.methods import METHODS, build_plan

__all__ = ["METHODS", "base_config", "build_plan", "train_and_evaluate"]
