"""The TensorBoard event files: byte for byte what tensorboardX writes."""

import pytest

from helpers import run_python, tensorboard_events
from raptor_jax.train import metrics

# (wall time, step, file version, scalar): zero and non-zero time and step,
# a value of 0.0 (written: it sits in a oneof), a negative and a huge value,
# a multi-byte step, tags tensorboardX keeps and one it cleans.
_EVENTS = [
    (0.0, 0, "brain.Event:2", None),
    (1.7e9 + 0.25, 0, "brain.Event:2", None),
    (0.0, 3, None, ("epsilon_spent", 0.5)),
    (0.0, 0, None, ("dev/accuracy", 0.0)),
    (12.5, 300, None, ("final/dev_f1", -2.75)),
    (0.0, 2**40 + 5, None, ("x.y-z", 3.4e38)),
    (0.0, 7, None, ("/lead slash (odd)", 1.0 / 3.0)),
]


def _tensorboardx_record(wall_time, step, file_version, scalar, path):
  from tensorboardX import summary  # pylint: disable=g-import-not-at-top
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  from tensorboardX.record_writer import RecordWriter  # pylint: disable=g-import-not-at-top

  fields = {"wall_time": wall_time, "step": step}
  if file_version is not None:
    fields["file_version"] = file_version
  if scalar is not None:
    fields["summary"] = summary.scalar(*scalar)
  writer = RecordWriter(str(path))
  writer.write(event_pb2.Event(**fields).SerializeToString())
  writer.close()
  return path.read_bytes()


@pytest.mark.parametrize("event", _EVENTS)
def test_event_records_equal_tensorboardx_s(event, tmp_path):
  wall_time, step, file_version, scalar = event
  ours = metrics.tfrecord(
      metrics.event_bytes(
          wall_time, step, file_version=file_version, scalar=scalar
      )
  )
  assert ours == _tensorboardx_record(*event, tmp_path / "reference")


def test_a_written_file_reads_back_with_tensorboardx_s_protos(tmp_path):
  times = iter([0.0, 1.5, 2.5])
  file = metrics.EventFile(tmp_path, lambda: next(times))
  file.add_scalar("dev/accuracy", 0.75, 16)
  file.add_scalar("epsilon_spent", 4.0, 32)
  file.close()
  events = tensorboard_events(file.path)
  assert events[0].file_version == "brain.Event:2"
  rows = [
      (e.wall_time, e.step, v.tag, v.simple_value)
      for e in events[1:]
      for v in e.summary.value
  ]
  assert rows == [
      (1.5, 16, "dev/accuracy", 0.75),
      (2.5, 32, "epsilon_spent", 4.0),
  ]


def test_a_negative_step_is_refused():
  with pytest.raises(ValueError, match="step"):
    metrics.event_bytes(0.0, -1)


def test_writing_metrics_imports_neither_tensorboardx_nor_torch(tmp_path):
  """tensorboardX's package import pulls in torch, 1.4-1.8 s of a run's
  start; the trainer's writer needs neither."""
  code = (
      "import sys, pathlib\n"
      "from raptor_jax.train import metrics\n"
      f"w = metrics.MetricWriter(pathlib.Path({str(tmp_path)!r}))\n"
      "w.write(1, {'epsilon_spent': 0.5}); w.close()\n"
      "print(sorted({'torch', 'tensorboardX'} & set(sys.modules)))\n"
  )
  proc = run_python("-c", code, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip().splitlines()[-1] == "[]"
