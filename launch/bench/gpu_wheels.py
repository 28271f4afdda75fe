"""The requirements the carried wheels still miss on the GPU machine's image.

`launch/bench/gpu_wheels.sh` downloads wheels without their dependencies;
this reads each wheel's `Requires-Dist`, keeps those that apply to the GPU
machine's Python (3.12, Linux x86-64, no extras), and prints those that
neither a carried wheel nor the image (`gpu_image_packages.txt`) provides,
one a line, for the script to download next.

  python -m launch.bench.gpu_wheels .whl launch/bench/gpu_image_packages.txt
"""

from __future__ import annotations

import email.parser
import pathlib
import re
import sys
import zipfile

from packaging import markers
from packaging import requirements

# The GPU machine's interpreter, for environment markers.
GPU_PYTHON = {
    'python_version': '3.12',
    'python_full_version': '3.12.3',
    'implementation_name': 'cpython',
    'implementation_version': '3.12.3',
    'platform_python_implementation': 'CPython',
    'sys_platform': 'linux',
    'platform_system': 'Linux',
    'platform_machine': 'x86_64',
    'os_name': 'posix',
    'extra': '',
}


_UNREADABLE = (
    requirements.InvalidRequirement,
    markers.UndefinedEnvironmentName,
)


def normalise(name: str) -> str:
  """PEP 503's normalised project name: 'Typing_Inspection' -> 'typing-inspection'."""
  return re.sub(r'[-_.]+', '-', name).lower()


def wheel_metadata(path: pathlib.Path) -> email.message.Message:
  """The METADATA of one wheel (`*.dist-info/METADATA`)."""
  with zipfile.ZipFile(path) as wheel:
    name = next(
        n for n in wheel.namelist() if n.endswith('.dist-info/METADATA')
    )
    return email.parser.Parser().parsestr(wheel.read(name).decode())


def image_packages(path: pathlib.Path) -> set[str]:
  """The normalised names of a package list (one a line, '#' comments)."""
  lines = (l.split('#')[0].strip() for l in path.read_text().splitlines())
  return {normalise(l) for l in lines if l}


def missing(wheel_dir: pathlib.Path, image: set[str]) -> list[str]:
  """Requirements (name and specifier, of the first wheel asking) of the
  wheels in `wheel_dir` that nothing provides, sorted by name."""
  provided = set(image)
  wanted: dict[str, requirements.Requirement] = {}
  for path in sorted(wheel_dir.glob('*.whl')):
    meta = wheel_metadata(path)
    provided.add(normalise(meta['Name']))
    for line in meta.get_all('Requires-Dist') or ():
      try:
        requirement = requirements.Requirement(line)
      except _UNREADABLE:
        continue
      marker = requirement.marker  # holds on the GPU machine, no extra
      if marker is None or marker.evaluate(GPU_PYTHON):
        wanted.setdefault(normalise(requirement.name), requirement)
  names = sorted(set(wanted) - provided)
  return [f'{name}{wanted[name].specifier}' for name in names]


def main(argv: list[str]) -> None:
  wheel_dir, image = pathlib.Path(argv[1]), pathlib.Path(argv[2])
  for requirement in missing(wheel_dir, image_packages(image)):
    print(requirement)


if __name__ == '__main__':
  main(sys.argv)
