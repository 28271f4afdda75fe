"""The run's secret, the randomness derived from it, and the data fingerprint.

Privacy amplification by sampling and the Gaussian noise both assume the
adversary cannot reproduce the randomness. A fresh run draws a 256-bit secret
from the operating system (`os.urandom`); every random stream derives from
it through a keyed BLAKE2b with one label per purpose (domain separation), so
knowing one stream's seed reveals nothing about another's::

  'poisson'         the seed of every Poisson sample (numpy's SeedSequence
                    takes the whole 256-bit integer)
  'noise/<i>'       phase i's noise key: 128 KDF bits as two independent
                    threefry keys (each holds only 64), whose two standard
                    normal draws the transforms combine into one
                    (`transforms` module docstring): reproducing the noise
                    needs all 128 bits, and threefry gives the same draws on
                    any device count
  'data-fingerprint' the key of the keyed data digest in privacy_report.json

The secret lives in the (private) checkpoint only, so a resumed run draws the
same samples and noise; it is never written to config.json, logs or reports.
`config.privacy.secret_seed = N >= 0` replaces the OS draw by a KDF of N for
reproducible experiments: anyone who knows N can reproduce every sample and
noise draw, so such a run has no privacy against them (a warning says so).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from pathlib import Path

import jax
import ml_collections
import numpy as np

log = logging.getLogger("raptor_jax")

SECRET_BYTES = 32  # 256 bits from the OS; at least 128 are needed.
_PERSON = b"raptor_jax/v1"  # BLAKE2b personalisation: this library's KDF.
_warned_fixed = []  # warn once per process about a fixed secret seed


def derive(secret: bytes, label: str, size: int = 32) -> bytes:
  """`size` bytes of a keyed BLAKE2b of `label` under `secret` (a PRF/KDF)."""
  if len(secret) < 16:
    raise ValueError(f"a secret needs at least 128 bits, got {8 * len(secret)}")
  return hashlib.blake2b(
      label.encode(), key=secret[:64], digest_size=size, person=_PERSON
  ).digest()


def fixed_secret(seed: int) -> bytes:
  """The secret of `privacy.secret_seed = seed`: public to whoever knows seed."""
  return hashlib.blake2b(
      f"secret_seed={int(seed)}".encode(),
      digest_size=SECRET_BYTES,
      person=_PERSON,
  ).digest()


def draw_secret(config: ml_collections.ConfigDict) -> bytes:
  """256 fresh bits from the OS, or the KDF of a fixed `privacy.secret_seed`."""
  seed = int(config.privacy.secret_seed)
  return os.urandom(SECRET_BYTES) if seed < 0 else fixed_secret(seed)


def warn_if_fixed(config: ml_collections.ConfigDict) -> None:
  """Warns once per process that a fixed `privacy.secret_seed` gives no privacy."""
  if int(config.privacy.secret_seed) < 0 or _warned_fixed:
    return
  _warned_fixed.append(True)
  log.warning(
      "privacy.secret_seed is fixed: anyone who knows it can reproduce every"
      " Poisson sample and noise draw, so the run gives NO privacy against"
      " them; use it for reproducible experiments only and never publish it"
  )


def public_config(config: ml_collections.ConfigDict) -> str:
  """The config as JSON for config.json, without its secrets.

  Left out: `privacy.secret_seed` (it reproduces every sample and noise
  draw) and an audit run's `audit.seed` (it reproduces every canary's
  inclusion bit, the auditor's secret; see `canaries`).
  """
  values = config.to_dict()
  values.get("privacy", {}).pop("secret_seed", None)
  values.get("audit", {}).pop("seed", None)
  return json.dumps(values, indent=2, sort_keys=True, default=str)


def sampler_seed(secret: bytes) -> int:
  """The 256-bit seed of `sampling.poisson_sample` (`default_rng((seed, stream, step))`)."""
  return int.from_bytes(derive(secret, "poisson"), "little")


# docs/method.md §3: the noise secret has at least 128 bits.
NOISE_KEY_BITS = 128


def noise_key(secret: bytes, phase_index: int) -> jax.Array:
  """Phase `phase_index`'s noise key: two raw threefry keys (uint32[2, 2],
  each as `jax.random.PRNGKey` makes one) of 128 KDF bits in all; orbax
  checkpoints it as is. One threefry key holds only 64 bits."""
  size = NOISE_KEY_BITS // 8
  words = np.frombuffer(derive(secret, f"noise/{phase_index}", size), np.uint32)
  return jax.numpy.asarray(words.reshape(2, 2))


def cell_secret_seed(seed: int, cell: str) -> int:
  """A sweep cell's fixed seed, derived from the sweep's `seed` and the cell.

  Distinct cells of one sweep then draw distinct samples and noise (a fixed
  seed shared by every cell would repeat them).
  """
  digest = derive(fixed_secret(seed), f"cell/{cell}", 8)
  return int.from_bytes(digest, "little") >> 1  # a non-negative int64


def _file_digest(path: Path) -> dict:
  sha = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      sha.update(chunk)
  return dict(size=path.stat().st_size, sha256=sha.hexdigest())


def data_fingerprint(config: ml_collections.ConfigDict) -> dict:
  """What identifies the private training records (kept in the checkpoint).

  A local `data.train_path`: its size and sha256 (every file of a directory,
  by relative name). The generated task: it is a deterministic function of
  public config fields (`seed`, `data.synthetic`, `data.max_length`, the
  tokenizer), which the config fingerprint already pins, so it is recorded as
  generated. A hub dataset: its public name (the hub pins its content).
  """
  dc = config.data
  if dc.task == "synthetic":
    return dict(source="generated", task="synthetic")
  if not dc.train_path:
    hub = dc.get("hub_dataset")  # a custom task's (configs/custom.py)
    return dict(source="hub", task=f"custom {hub}" if hub else dc.task)
  path = Path(dc.train_path).expanduser()
  if path.is_dir():
    files = {
        str(p.relative_to(path)): _file_digest(p)
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }
  else:
    files = {path.name: _file_digest(path)}
  return dict(source="file", files=files)


def keyed_digest(secret: bytes, fingerprint: dict) -> str:
  """A digest of `fingerprint` keyed by the secret: safe to publish.

  A plain sha256 of the private file is a deterministic function of every
  record: an adversary who knows all records but one could test candidates
  for the last one against it. Keyed by a KDF of the secret it is a PRF
  output, which reveals nothing without the secret (kept in the checkpoint),
  yet lets the data owner match a report to its data.
  """
  text = repr(sorted(_flatten(fingerprint))).encode()
  return hmac.new(
      derive(secret, "data-fingerprint"), text, hashlib.sha256
  ).hexdigest()


def public_data(secret: bytes, fingerprint: dict) -> dict:
  """The report's data field: the public source, or a keyed file digest."""
  if fingerprint["source"] != "file":
    return dict(fingerprint)
  return dict(source="file", keyed_sha256=keyed_digest(secret, fingerprint))


def _flatten(tree, prefix=""):
  if isinstance(tree, dict):
    for key, value in tree.items():
      yield from _flatten(value, f"{prefix}/{key}")
  else:
    yield prefix, str(tree)
