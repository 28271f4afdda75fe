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


class EventFile:
  """One TensorBoard event file that records no time or host unless asked.

  tensorboardX's writer names its file `events.out.tfevents.<start
  time>.<host name>` and stamps the file's first event with the start time;
  this one names it by the count of event files already in `directory` (one
  per session of a resumed run) and stamps every event with `clock()`.
  """

  def __init__(self, directory: Path, clock: Callable[[], float]):
    from tensorboardX.record_writer import RecordWriter  # pylint: disable=g-import-not-at-top

    directory.mkdir(parents=True, exist_ok=True)
    index = len(list(directory.glob("events.out.tfevents.*")))
    self.path = directory / f"events.out.tfevents.{index:010d}.raptor_jax"
    self._clock = clock
    self._records = RecordWriter(str(self.path))
    self._write(file_version="brain.Event:2")

  def _write(self, **fields) -> None:
    from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top

    event = event_pb2.Event(wall_time=self._clock(), **fields)
    self._records.write(event.SerializeToString())

  def add_scalar(self, name: str, value: float, step: int) -> None:
    from tensorboardX import summary  # pylint: disable=g-import-not-at-top

    self._write(step=step, summary=summary.scalar(name, value))

  def flush(self) -> None:
    self._records.flush()

  def close(self) -> None:
    self._records.close()


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
