"""host_devices.one_device_per_core: JAX's CPU backend split into devices."""

import os
import subprocess
import sys
import textwrap

import pytest

from raptor_jax import host_devices

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, **env) -> str:
  environ = {
      k: v
      for k, v in os.environ.items()
      if k not in ('XLA_FLAGS', 'JAX_NUM_CPU_DEVICES')
  }
  out = subprocess.run(
      [sys.executable, '-c', textwrap.dedent(script)],
      capture_output=True,
      text=True,
      env=dict(environ, JAX_PLATFORMS='cpu', PYTHONPATH=_ROOT, **env),
      cwd=_ROOT,
  )
  assert out.returncode == 0, out.stderr
  return out.stdout.strip().splitlines()[-1]


def test_splits_the_cpu_backend_into_the_requested_devices():
  out = _run("""
      from raptor_jax import host_devices
      count = host_devices.one_device_per_core(3)
      import jax
      print(count, len(jax.devices()), jax.devices()[0].platform)
  """)
  assert out == '3 3 cpu'


def test_defaults_to_one_device_per_core_of_the_affinity():
  out = _run("""
      import os
      from raptor_jax import host_devices
      count = host_devices.one_device_per_core()
      import jax
      print(count, len(jax.devices()), len(os.sched_getaffinity(0)))
  """)
  count, devices, cores = out.split()
  assert count == devices == cores


@pytest.mark.parametrize(
    'env',
    [
        {'XLA_FLAGS': '--xla_force_host_platform_device_count=5'},
        {'JAX_NUM_CPU_DEVICES': '5'},
    ],
)
def test_keeps_a_count_the_user_chose(env):
  out = _run(
      """
      from raptor_jax import host_devices
      count = host_devices.one_device_per_core(2)
      import jax
      print(count, len(jax.devices()))
      """,
      **env,
  )
  assert out == '5 5'


def test_too_late_after_a_computation_is_one_clear_error():
  out = _run("""
      import jax, jax.numpy as jnp
      jnp.ones(2).block_until_ready()
      from raptor_jax import host_devices
      try:
        host_devices.one_device_per_core(2)
      except ValueError as e:
        print(str(e))
  """)
  assert 'before the first JAX computation' in out


def test_rejects_a_negative_count():
  with pytest.raises(ValueError, match='>= 0'):
    host_devices.one_device_per_core(-1)


def test_host_cores_is_the_affinity():
  assert host_devices.host_cores() == len(os.sched_getaffinity(0))


def test_dividing_count_is_the_most_devices_that_split_every_size():
  assert host_devices.dividing_count([8, 32, 128], cores=2) == 2
  assert host_devices.dividing_count([8, 32, 128], cores=16) == 8
  assert host_devices.dividing_count([3], cores=2) == 1
  assert host_devices.dividing_count([12, 18], cores=16) == 6


def test_launch_main_rejects_a_negative_device_count_in_one_line(tmp_path):
  out = subprocess.run(
      [
          sys.executable,
          'launch/main.py',
          '--config=configs/switch_sst2.py:tiny',
          f'--workdir={tmp_path}',
          '--cpu_devices=-1',
      ],
      capture_output=True,
      text=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=_ROOT),
      cwd=_ROOT,
  )
  assert out.returncode != 0
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: cpu devices must be')
  assert not list(tmp_path.iterdir())  # nothing written


# One device reaches the psum `late` seconds after the other, as a device
# whose thread a loaded machine deschedules.
_LATE_DEVICE = """
    import sys, time
    from raptor_jax import host_devices
    host_devices.one_device_per_core(2, **{kwargs})
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    def late(index, x):
      if int(index) == 1:
        time.sleep({late})
      return x

    def body(x):
      shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
      x = jax.pure_callback(late, shape, jax.lax.axis_index('d'), x)
      return jax.lax.psum(x, 'd')

    mesh = jax.make_mesh((2,), ('d',))
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P('d'), out_specs=P()))
    x = jax.device_put(jnp.ones((2, 4)), NamedSharding(mesh, P('d')))
    print(float(step(x).sum()))
"""


def test_collective_timeout_governs_how_long_a_late_device_may_be():
  # The timeout the split sets is the one XLA applies: 3 s aborts a device
  # 8 s late, as XLA's default (60 s) aborted a loaded 2-core run at cycle 11.
  environ = {
      k: v
      for k, v in os.environ.items()
      if k not in ('XLA_FLAGS', 'JAX_NUM_CPU_DEVICES')
  }
  script = _LATE_DEVICE.format(kwargs="{'collective_timeout_s': 3}", late=8)
  out = subprocess.run(
      [sys.executable, '-c', textwrap.dedent(script)],
      capture_output=True,
      text=True,
      env=dict(environ, JAX_PLATFORMS='cpu', PYTHONPATH=_ROOT),
      cwd=_ROOT,
  )
  assert out.returncode != 0
  assert 'Termination timeout' in out.stderr


def test_the_default_split_waits_past_xla_default_for_a_late_device():
  # XLA's own timeouts (20 + 40 s) aborted a loaded 2-core run at cycle 11.
  # The test above shows XLA applies the flags the split sets; here the
  # default split sets them to COLLECTIVE_TIMEOUT_S, far above a minute (a
  # device 65 s late then completes: measured, 66 s, before this replaced it).
  script = """
    import os
    from raptor_jax import host_devices
    host_devices.one_device_per_core(2)
    flags = dict(f.split('=') for f in os.environ['XLA_FLAGS'].split())
    print(sum(int(flags[f'--xla_cpu_collective_call_{name}_timeout_seconds'])
              for name in ('warn_stuck', 'terminate')))
  """
  waited = int(_run(script))
  assert waited == host_devices.COLLECTIVE_TIMEOUT_S and waited > 20 + 40


def test_collective_timeout_flags_keep_the_users():
  flags = host_devices.with_collective_timeout('--xla_foo=1', 3600)
  assert flags.split() == [
      '--xla_foo=1',
      '--xla_cpu_collective_call_warn_stuck_timeout_seconds=600',
      '--xla_cpu_collective_call_terminate_timeout_seconds=3000',
  ]
  mine = '--xla_cpu_collective_call_terminate_timeout_seconds=7'
  assert mine in host_devices.with_collective_timeout(mine, 3600).split()
  assert (
      host_devices.with_collective_timeout(mine, 3600).count('terminate') == 1
  )
