"""Spectral initialisation of token embeddings from public co-occurrence counts.

A transformer's masked-LM loss sits at the unigram level for its first
millions of tokens, which is all that a CPU sees in half an hour. Word
co-occurrence statistics of the same public text already hold most of what
those embeddings would learn first (distributional similarity: "great" near
"excellent", "awful" near "terrible"), and they cost seconds: count pairs
within a window, take positive pointwise mutual information (PPMI, with
context-distribution smoothing 0.75), and factorise it with a truncated SVD
(Levy, Goldberg and Dagan, 2015). The rows U sqrt(S), rescaled to the
family's embedding scale, replace the random embedding before pretraining;
everything else starts as usual. Public text only, deterministic.
"""

from __future__ import annotations

import numpy as np

MAX_VOCAB = 16384  # dense V x V counts: 1 GiB of float32 at this size


def cooccurrence(
    rows: np.ndarray, vocab_size: int, window: int = 4
) -> np.ndarray:
  """Symmetric counts of token pairs at distance 1..window, weighted 1/distance.

  Args:
    rows: int [N, S] token rows (pairs never cross a row boundary).
    vocab_size: V.
    window: the largest distance counted.

  Returns:
    float32 [V, V].
  """
  if vocab_size > MAX_VOCAB:
    raise ValueError(
        f"spectral embeddings count a dense {vocab_size}^2 matrix; use a vocabulary "
        f"of at most {MAX_VOCAB} or --config.model.embedding_init=normal"
    )
  rows = np.asarray(rows, np.int64)
  counts = np.zeros(vocab_size * vocab_size, np.float64)
  for k in range(1, window + 1):
    left, right = rows[:, :-k].reshape(-1), rows[:, k:].reshape(-1)
    counts += (
        np.bincount(left * vocab_size + right, minlength=vocab_size**2) / k
    )
  counts = counts.reshape(vocab_size, vocab_size)
  return (counts + counts.T).astype(np.float32)


def ppmi(counts: np.ndarray, smoothing: float = 0.75) -> np.ndarray:
  """max(0, log P(w, c) / (P(w) P_smooth(c))) with P_smooth(c) ~ count(c)^smoothing."""
  total = counts.sum()
  word = counts.sum(axis=1) / total
  context = counts.sum(axis=0) ** smoothing
  context = context / context.sum()
  with np.errstate(divide="ignore", invalid="ignore"):
    pmi = (
        np.log(counts / total)
        - np.log(word)[:, None]
        - np.log(context)[None, :]
    )
  return np.where(np.isfinite(pmi), np.maximum(pmi, 0.0), 0.0).astype(
      np.float32
  )


def truncated_svd(
    matrix: np.ndarray,
    rank: int,
    seed: int,
    oversample: int = 10,
    power_iterations: int = 2,
) -> tuple[np.ndarray, np.ndarray]:
  """(U [V, rank], S [rank]) of a randomised SVD (Halko et al.), seeded."""
  rng = np.random.default_rng(seed)
  q = matrix @ rng.standard_normal((matrix.shape[1], rank + oversample)).astype(
      np.float32
  )
  for _ in range(power_iterations):
    q, _ = np.linalg.qr(q)
    q = matrix @ (matrix.T @ q)
  q, _ = np.linalg.qr(q)
  u, s, _ = np.linalg.svd(q.T @ matrix, full_matrices=False)
  return q @ u[:, :rank], s[:rank]


def spectral_embeddings(
    rows: np.ndarray,
    vocab_size: int,
    dim: int,
    *,
    std: float,
    seed: int = 0,
    window: int = 4,
) -> np.ndarray:
  """Token embeddings [V, dim] from PPMI + SVD, scaled to per-coordinate `std`.

  Tokens that never occur (and so have an all-zero PPMI row) keep a small
  random vector, so that no two embeddings are identical.
  """
  u, s = truncated_svd(ppmi(cooccurrence(rows, vocab_size, window)), dim, seed)
  emb = u * np.sqrt(s)[None, :]
  emb *= std / max(float(emb.std()), 1e-12)
  unseen = np.abs(emb).sum(axis=1) < 1e-6
  emb[unseen] = (
      0.1
      * std
      * np.random.default_rng(seed + 1).standard_normal(
          (int(unseen.sum()), dim)
      )
  )
  return emb.astype(np.float32)
