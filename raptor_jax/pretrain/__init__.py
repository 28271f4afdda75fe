"""Pretraining small MoE models on public text (for users without a checkpoint).

    from raptor_jax.pretrain import pretrain
    report = pretrain(config, workdir)   # writes <workdir>/model (save_pretrained)

`corpus` (sources, cleaning, decontamination against the fine-tuning task),
`tokenizer` (WordPiece on the public text), `objectives` (masked/causal LM,
router auxiliary losses), `model` (backbone + LM head), `evaluate`
(held-out loss and routing health), `train` (the loop).
"""

from raptor_jax.pretrain.train import pretrain

__all__ = ["pretrain"]
