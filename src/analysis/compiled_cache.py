"""What an analysis reads from a compiled program, kept on disk so that the same program compiles once.

A program compiled only to be read (deviceless.compile_for_analysis: every deviceless GPU compile of the
AOT report, the planner's `--verify`, the tests) is read for two things: XLA's optimized, scheduled HLO
and its memory figures (buffer assignment). A deviceless compile of a training step takes about a minute,
most of it ptxas building machine code nobody runs, and JAX's persistent compilation cache cannot keep it
(a deviceless executable is written but cannot be read back without a GPU client). So `CompiledProgram`
holds just those two, and `compile_for_analysis` keeps it in `MESHMOE_ANALYSIS_CACHE_DIR` when that names
a folder (off by default, as JAX_COMPILATION_CACHE_DIR is).

The key is what the compile depends on: the lowered program's text (StableHLO with its shardings and the
serialized custom-call kernels), the devices it is compiled for in the order of its device assignment (id,
host, kind, compute capability), the compiler options, XLA_FLAGS and the versions of jax, jaxlib and the
CUDA plugin. Mosaic GPU kernels embed the paths of the
Python files they were traced from (this checkout's, the venv's) in the program, and a hash of those: a
clone elsewhere misses unless jax strips the paths when tracing, which `LOCAL_ROOTS_PATTERN` as
jax_hlo_source_file_canonicalization_regex does (the tests set it: tests/conftest.py). Not in the key:
jax.config's compile settings (optimization effort and the like, which meshmoe
never changes); whoever changes one should use another folder. A program whose Mosaic GPU kernels are
asked to dump their ptxas logs (kernel_resources.dump_to) always compiles: those logs are a side effect of
compiling. Source locations are not in the key either, so the HLO's metadata read back names the files
of whichever checkout compiled it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import pathlib
import re
import sys
import tempfile
import zlib
from typing import Any

import jax

CACHE_DIR_VARIABLE = "MESHMOE_ANALYSIS_CACHE_DIR"
_FORMAT = 1  # of the stored entries; part of the key
_MOSAIC_DUMP = "MOSAIC_GPU_DUMP_TO"  # kernel_resources.DUMP_DIRECTORY (that module imports nothing of jax)


@dataclasses.dataclass(frozen=True)
class MemoryFigures:
  """XLA's buffer assignment of one device's program, under the names of jax's CompiledMemoryStats."""
  argument_size_in_bytes: int
  output_size_in_bytes: int
  alias_size_in_bytes: int
  temp_size_in_bytes: int
  generated_code_size_in_bytes: int


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
  """A compiled program as an analysis reads it; `as_text()` and `memory_analysis()` as on jax's Compiled."""
  hlo_text: str
  memory: MemoryFigures
  from_cache: bool = False

  def as_text(self) -> str:
    return self.hlo_text

  def memory_analysis(self) -> MemoryFigures:
    return self.memory


def compile_and_read(lowered, compiler_options: dict[str, Any]) -> CompiledProgram:
  """`lowered.compile(compiler_options)` read into a CompiledProgram, from the cache when it holds it."""
  folder = os.environ.get(CACHE_DIR_VARIABLE)
  key = None if not folder or os.environ.get(_MOSAIC_DUMP) else _key(lowered, compiler_options)
  if key is not None:
    found = _load(pathlib.Path(folder) / key)
    if found is not None:
      return found
  compiled = lowered.compile(compiler_options=compiler_options)
  m = compiled.memory_analysis()
  program = CompiledProgram(compiled.as_text(), MemoryFigures(
      m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes, m.temp_size_in_bytes,
      m.generated_code_size_in_bytes))
  if key is not None:
    try:
      _store(pathlib.Path(folder), key, program)
    except OSError as error:  # a full or read-only disk costs the next compile, not this analysis
      logging.getLogger(__name__).warning("not kept in %s=%s: %s", CACHE_DIR_VARIABLE, folder, error)
  return program


def _devices(lowered) -> list[tuple] | None:
  """The devices the program is compiled for, in the order of its device assignment (which device runs
  which partition); None when that cannot be read, and then the program is not cached. jax keeps it only in
  a private field of the lowering: read defensively, a change there turns the cache off, nothing worse."""
  try:
    return [_describe(device) for device in lowered._lowering._device_list]
  except (AttributeError, TypeError):
    return None


def _describe(device: jax.Device) -> tuple:
  return device.id, device.process_index, device.device_kind, str(getattr(device, "compute_capability", ""))


def _key(lowered, compiler_options: dict[str, Any]) -> str | None:
  devices = _devices(lowered)
  if devices is None:
    return None
  versions = {name: _version(name) for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt")}
  digest = hashlib.sha256()
  for part in (str(_FORMAT), lowered.as_text(), json.dumps(devices), json.dumps(compiler_options, sort_keys=True),
               os.environ.get("XLA_FLAGS", ""), json.dumps(versions, sort_keys=True)):
    digest.update(part.encode())
    digest.update(b"\0")
  return digest.hexdigest()


# Where this machine keeps the source files a program's kernels may name: meshmoe's checkout (the folder
# above the package's, which holds sharding/, models/, pallas_kernels/; site-packages for an installed
# wheel; Bazel's runfiles, whose links are left unresolved, as Python's file names are) and the
# interpreter's environment (the venv, with jax and tokamax). As a regex for
# jax_hlo_source_file_canonicalization_regex, longest first: `/clone/.venv/lib/...` loses `/clone/.venv/`.
_LOCAL_ROOTS = {str(pathlib.Path(os.path.abspath(__file__)).parents[2]), sys.prefix, sys.base_prefix}
LOCAL_ROOTS_PATTERN = "^(" + "|".join(re.escape(root + os.sep)
                                      for root in sorted(_LOCAL_ROOTS, key=len, reverse=True)) + ")"


def _version(distribution: str) -> str:
  try:
    return importlib.metadata.version(distribution)
  except importlib.metadata.PackageNotFoundError:
    return ""


def _load(path: pathlib.Path) -> CompiledProgram | None:
  try:
    entry = json.loads(zlib.decompress(path.read_bytes()))
    program = CompiledProgram(entry["hlo_text"], MemoryFigures(**entry["memory"]), from_cache=True)
  except FileNotFoundError:
    return None
  except (OSError, zlib.error, ValueError, KeyError, TypeError):  # unreadable: compiled again, overwritten
    return None
  with contextlib.suppress(OSError):
    os.utime(path)  # newest use, for whoever prunes the folder oldest first
  return program


def _store(folder: pathlib.Path, key: str, program: CompiledProgram) -> None:
  """Written whole or not at all: into a temporary file of the same folder, then renamed over the key."""
  folder.mkdir(parents=True, exist_ok=True)
  data = zlib.compress(json.dumps({"hlo_text": program.hlo_text,
                                   "memory": dataclasses.asdict(program.memory)}).encode(), 6)
  handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{key}.")
  try:
    with os.fdopen(handle, "wb") as f:
      f.write(data)
    os.replace(temporary, folder / key)
  except BaseException:
    with contextlib.suppress(OSError):
      os.remove(temporary)
    raise
