"""raptor_jax: role-aware differentially private fine-tuning of sparse MoE models.

The front door is ``raptor_jax.make_private`` (``make_private_experts`` for
parameters stacked per expert): DP-SGD calibrated to a budget in one call
(``raptor_jax.private``).

Submodules (import them directly, e.g. ``from raptor_jax import transforms``):

* ``models``: Flax ports of Switch Transformer, OLMoE and DeepSeek-MoE, LoRA,
  heads, and ``from_pretrained`` for Hugging Face checkpoints.
* ``transforms``: the optax DP aggregation transforms.
* ``accounting``: privacy accounting and noise calibration.
* ``ownership``: owner maps, routing statistics, public layer selection.
"""

__version__ = "0.1.0"

from raptor_jax import xla_workarounds as _xla_workarounds

# Before JAX's first computation: XLA:CPU's YNNPACK reduce fusions return
# wrong values on jaxlib 0.10.2+ (`xla_workarounds`).
_xla_workarounds.apply()

__all__ = ["make_private", "make_private_experts"]


def __getattr__(name: str):
  # Imported on first use: `import raptor_jax` (and so `raptor_jax.process`,
  # which must run before JAX starts) imports no JAX.
  if name in __all__:
    from raptor_jax import private  # pylint: disable=g-import-not-at-top

    return getattr(private, name)
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
