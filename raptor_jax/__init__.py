"""raptor_jax: role-aware differentially private fine-tuning of sparse MoE models.

The front door is ``raptor_jax.make_private`` (``make_private_experts`` for
parameters stacked per expert): DP-SGD calibrated to a budget in one call
(defined in ``raptor_jax.private``).

Submodules (import them directly, e.g. ``from raptor_jax import transforms``):

* ``models``: Flax ports of Switch Transformer, OLMoE and DeepSeek-MoE, LoRA,
  heads, and ``from_pretrained`` for Hugging Face checkpoints.
* ``transforms``: the optax DP aggregation transforms.
* ``accounting`` and ``calibration``: privacy accounting and noise
  calibration.
* ``ownership``: owner maps, routing statistics, public layer selection.
* ``studies``: the experiments (sweeps, the controlled study).

``import raptor_jax`` imports no JAX: ``raptor_jax.process.setup`` must run
before anything starts a thread, and JAX starts one on import. The two front
door functions therefore import ``raptor_jax.private`` when called.
"""

__version__ = "0.1.0"

from raptor_jax import xla_workarounds as _xla_workarounds

# Before JAX's first computation: XLA:CPU's YNNPACK reduce fusions return
# wrong values on jaxlib 0.10.2+ (`xla_workarounds`).
_xla_workarounds.apply()

__all__ = ["make_private", "make_private_experts"]


def make_private(optimizer, **kwargs):
  """DP-SGD in one call, calibrated to a budget: `raptor_jax.private.make_private`.

  Its docstring states the guarantee and the arguments.
  """
  from raptor_jax import private  # pylint: disable=g-import-not-at-top

  return private.make_private(optimizer, **kwargs)


def make_private_experts(optimizer, **kwargs):
  """`make_private` for parameters stacked per expert: `raptor_jax.private.make_private_experts`.

  Its docstring states the guarantee and the arguments.
  """
  from raptor_jax import private  # pylint: disable=g-import-not-at-top

  return private.make_private_experts(optimizer, **kwargs)
