"""Evaluation metrics and the public metric writers (JSONL + TensorBoard).

Only public quantities reach these writers: dev metrics, epsilon spent, the
cycle counter. Wall time only with `config.log_wall_time`: it depends on the
realised batch sizes, so by default no event, file name or first event
carries a time (`EventFile`). Private per-step statistics (training loss,
realised batch sizes, per-expert counts, the owner map) are never written
unless the user opts in with `config.log_private_stats` (with a warning).
"""

from __future__ import annotations

import json
import re
import struct
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from raptor_jax import length_buckets


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
  return float(np.mean(predictions == labels))


def _class_f1(predictions: np.ndarray, labels: np.ndarray, c) -> float:
  tp = np.sum((predictions == c) & (labels == c))
  fp = np.sum((predictions == c) & (labels != c))
  fn = np.sum((predictions != c) & (labels == c))
  return 2 * tp / max(2 * tp + fp + fn, 1)


def binary_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
  """F1 of the positive class (QQP's second GLUE metric)."""
  return float(_class_f1(predictions, labels, 1))


def macro_f1(predictions: np.ndarray, labels: np.ndarray) -> float:
  """The mean F1 over the classes that occur in `labels` or `predictions`
  (scikit-learn's `f1_score(average='macro')`); a custom task's metric."""
  classes = np.union1d(labels, predictions)
  return float(np.mean([_class_f1(predictions, labels, c) for c in classes]))


METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "accuracy": accuracy,
    "f1": binary_f1,
    "macro_f1": macro_f1,
}


def evaluate(
    logits_fn: Callable,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    labels: np.ndarray,
    metric_names,
    batch_size: int,
    *,
    buckets: tuple[int, ...] = (),
) -> dict[str, float]:
  """Metrics of the current model on a labelled split (fixed-size batches).

  `buckets` (`length_buckets`): records run in batches of the smallest
  bucket length that holds them (`logits_fn` then compiles once per bucket);
  `()`: every batch at the split's full width, in order. The metrics are the
  same either way (right padding is masked): buckets change the layout and
  the time only, and nothing about them is returned.
  """
  logits = length_buckets.map_split(
      lambda ids, mask: np.asarray(logits_fn(ids, mask)),
      input_ids,
      attention_mask,
      buckets,
      batch_size,
  )
  predictions = np.argmax(logits, axis=-1)
  return {name: METRICS[name](predictions, labels) for name in metric_names}


# TensorBoard's event files, written here rather than with tensorboardX, whose
# package import pulls in torch (1.4-1.8 s before a run's first step). The
# format: TFRecord framing around `tensorboard.Event` protocol buffers, of
# which a scalar run needs three fields. tests/test_metrics.py checks these
# bytes against tensorboardX's writer.

_INVALID_TAG = re.compile(r"[^-/\w\.]")  # tensorboardX's `_clean_tag`


def _crc32c_table() -> tuple[int, ...]:
  table = []
  for byte in range(256):
    crc = byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    table.append(crc)
  return tuple(table)


_CRC32C = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
  """TFRecord's masked CRC-32C (Castagnoli) of `data`."""
  crc = 0xFFFFFFFF
  for byte in data:
    crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
  crc ^= 0xFFFFFFFF
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
  """One TFRecord: length, its masked CRC, the data, the data's masked CRC."""
  length = struct.pack("<Q", len(data))
  return b"".join(
      (
          length,
          struct.pack("<I", _masked_crc32c(length)),
          data,
          struct.pack("<I", _masked_crc32c(data)),
      )
  )


def _varint(value: int) -> bytes:
  out = bytearray()
  while True:
    byte, value = value & 0x7F, value >> 7
    out.append(byte | (0x80 if value else 0))
    if not value:
      return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
  return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(
    wall_time: float,
    step: int = 0,
    *,
    file_version: str | None = None,
    scalar: tuple[str, float] | None = None,
) -> bytes:
  """A serialised `Event` (proto3: fields at their default are left out).

  Args:
    wall_time: the event's time stamp (0.0: none).
    step: the global step, >= 0.
    file_version: the version a file's first event states
      ("brain.Event:2"); None in every other event.
    scalar: (tag, value): a summary of one `simple_value`; the tag cleaned
      as tensorboardX cleans it.
  """
  if step < 0:
    raise ValueError(f"step: a count >= 0, got {step}")
  out = b""
  if wall_time:
    out += b"\x09" + struct.pack("<d", wall_time)
  if step:
    out += b"\x10" + _varint(step)
  if file_version is not None:
    out += _length_delimited(3, file_version.encode())
  if scalar is not None:
    tag, value = scalar
    tag = _INVALID_TAG.sub("_", tag).lstrip("/")
    # simple_value is in a oneof, so it is written even when 0.0.
    value_msg = (
        _length_delimited(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    )
    out += _length_delimited(5, _length_delimited(1, value_msg))
  return out


class EventFile:
  """One TensorBoard event file that records no time or host unless asked.

  tensorboardX's writer names its file `events.out.tfevents.<start
  time>.<host name>` and stamps the file's first event with the start time;
  this one names it by the count of event files already in `directory` (one
  per session of a resumed run) and stamps every event with `clock()`.
  """

  def __init__(self, directory: Path, clock: Callable[[], float]):
    directory.mkdir(parents=True, exist_ok=True)
    index = len(list(directory.glob("events.out.tfevents.*")))
    self.path = directory / f"events.out.tfevents.{index:010d}.raptor_jax"
    self._clock = clock
    self._file = open(self.path, "wb")  # pylint: disable=consider-using-with
    self._file.write(
        tfrecord(event_bytes(clock(), file_version="brain.Event:2"))
    )

  def add_scalar(self, name: str, value: float, step: int) -> None:
    self._file.write(
        tfrecord(event_bytes(self._clock(), step, scalar=(name, value)))
    )

  def flush(self) -> None:
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class MetricWriter:
  """Appends scalars to `<workdir>/metrics.jsonl` and TensorBoard event files.

  With `just_logging=True` (every process but 0 of a multi-host run, as in
  flax's examples: `just_logging=jax.process_index() > 0`) nothing is opened
  or written: one process writes the shared workdir.
  """

  def __init__(
      self, workdir: Path, just_logging: bool = False, wall_time: bool = False
  ):
    self._just_logging = just_logging
    if just_logging:
      return
    self._jsonl = open(workdir / "metrics.jsonl", "a", encoding="utf-8")
    self._tb = EventFile(
        workdir / "tensorboard", time.time if wall_time else lambda: 0.0
    )

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    if self._just_logging:
      return
    row = {"step": int(step), **{k: float(v) for k, v in scalars.items()}}
    self._jsonl.write(json.dumps(row) + "\n")
    self._jsonl.flush()
    for name, value in scalars.items():
      self._tb.add_scalar(name, float(value), int(step))
    self._tb.flush()

  def close(self) -> None:
    if self._just_logging:
      return
    self._jsonl.close()
    self._tb.close()
