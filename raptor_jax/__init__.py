"""raptor_jax: role-aware differentially private fine-tuning of sparse MoE models.

Submodules (import them directly, e.g. ``from raptor_jax import transforms``):

* ``models``: Flax ports of Switch Transformer, OLMoE and DeepSeek-MoE, LoRA,
  heads, and ``from_pretrained`` for Hugging Face checkpoints.
* ``transforms``: the optax DP aggregation transforms.
* ``accounting``: privacy accounting and noise calibration.
* ``ownership``: owner maps, routing statistics, public layer selection.
"""

__version__ = "0.1.0"
