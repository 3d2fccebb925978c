"""The cache of programs compiled only to be read (meshmoe.analysis.compiled_cache), on small deviceless
programs for 8 H100s. Reference: the same program compiled by jax with the same options, here and now."""

import logging
import os
import pathlib
import stat
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshmoe.analysis import compiled_cache, deviceless
from tests.model_steps import gpu_mesh


def _lowered(devices_reversed: bool = False, width: int = 256):
  mesh = gpu_mesh((8,), ("x",))
  if devices_reversed:
    mesh = jax.sharding.Mesh(mesh.devices[::-1], ("x",))
  step = jax.jit(jax.shard_map(lambda x, w: jax.lax.psum_scatter(jnp.tanh(x @ w) @ w.T, "x", tiled=True),
                               mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))
  return step.lower(jax.ShapeDtypeStruct((8 * width, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P("x"))),
                    jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P())))


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv(compiled_cache.CACHE_DIR_VARIABLE, str(tmp_path))
  return tmp_path


def _entries(folder) -> list[str]:
  return sorted(name for name in os.listdir(folder) if not name.startswith("."))


def test_a_program_read_back_is_what_jax_compiles(cache):
  lowered = _lowered()
  first, second = deviceless.compile_for_analysis(lowered), deviceless.compile_for_analysis(lowered)
  assert (first.from_cache, second.from_cache) == (False, True) and len(_entries(cache)) == 1
  fresh = lowered.compile(compiler_options=deviceless.ANALYSIS_OPTIONS)
  assert second.as_text() == fresh.as_text()
  memory = fresh.memory_analysis()
  for field in ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes"):
    assert getattr(second.memory_analysis(), field) == getattr(memory, field), field
  # Traced again in the same process (another test asking for the same program): the same entry.
  assert deviceless.compile_for_analysis(_lowered()).from_cache


def test_anything_the_compile_depends_on_is_a_different_entry(cache, monkeypatch):
  deviceless.compile_for_analysis(_lowered())
  assert not deviceless.compile_for_analysis(_lowered(width=128)).from_cache  # another program
  assert not deviceless.compile_for_analysis(_lowered(devices_reversed=True)).from_cache  # device assignment
  assert not deviceless.compile_for_analysis(  # compiler options
      _lowered(), {"xla_gpu_enable_latency_hiding_scheduler": False}).from_cache
  monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"] + " --xla_gpu_enable_while_loop_double_buffering=false")
  assert not deviceless.compile_for_analysis(_lowered()).from_cache  # XLA flags
  assert len(_entries(cache)) == 5


def test_a_damaged_entry_is_compiled_again_and_replaced(cache):
  lowered = _lowered()
  expected = deviceless.compile_for_analysis(lowered).as_text()
  [entry] = _entries(cache)
  data = (cache / entry).read_bytes()
  (cache / entry).write_bytes(data[: len(data) // 2])  # a copy cut short
  again = deviceless.compile_for_analysis(lowered)
  assert not again.from_cache and again.as_text() == expected
  assert (cache / entry).read_bytes() == data and deviceless.compile_for_analysis(lowered).from_cache


def test_kernel_dumps_always_compile(cache, monkeypatch, tmp_path_factory):
  """ptxas' logs (kernel_resources.dump_to) are written while compiling: a cached program would write none."""
  lowered = _lowered()
  deviceless.compile_for_analysis(lowered)
  monkeypatch.setenv("MOSAIC_GPU_DUMP_TO", str(tmp_path_factory.mktemp("dumps")))
  assert not deviceless.compile_for_analysis(lowered).from_cache


def test_an_unwritable_folder_costs_a_warning_not_the_analysis(cache, caplog):
  if os.geteuid() == 0:  # root writes into a read-only folder; a file in the folder's place refuses anyone
    os.rmdir(cache)
    cache.write_text("not a folder")
  else:
    cache.chmod(stat.S_IRUSR | stat.S_IXUSR)
  with caplog.at_level(logging.WARNING):
    program = deviceless.compile_for_analysis(_lowered())
  assert not program.from_cache and "psum_scatter" not in program.as_text() and "reduce-scatter" in program.as_text()
  assert compiled_cache.CACHE_DIR_VARIABLE in caplog.text


def test_without_the_variable_nothing_is_kept(tmp_path, monkeypatch):
  monkeypatch.delenv(compiled_cache.CACHE_DIR_VARIABLE, raising=False)
  monkeypatch.chdir(tmp_path)
  lowered = _lowered()
  assert not deviceless.compile_for_analysis(lowered).from_cache
  assert not deviceless.compile_for_analysis(lowered).from_cache and os.listdir(tmp_path) == []


def test_kernels_traced_under_the_pattern_name_no_local_path():
  """Mosaic GPU kernels carry the paths of the files they were traced from (this checkout's, the venv's)
  and a hash of them inside the program; traced with LOCAL_ROOTS_PATTERN as jax's source-file regex (the
  tests' set-up), a fresh clone elsewhere lowers the same text and so finds what this one kept."""
  from meshmoe.pallas_kernels import mosaic_tiles
  from meshmoe.pallas_kernels.grouped_weight_gradient import api
  from tests.pallas_kernels import harness

  mesh = harness.h100_mesh(1)
  args = [harness.abstract(mesh, shape, jnp.bfloat16 if len(shape) != 1 else jnp.int32, P())
          for shape in ((4 * 64, 256), (4 * 64, 256), (4,), (4, 256, 256))]

  def lowered_text() -> str:
    return jax.jit(lambda x, dy, rows, like: api.weight_gradient(
        x, dy, rows, like, tile_rows=64, backend="mosaic_gpu", num_sms=harness.h100_sms(),
        tiles=mosaic_tiles.DEFAULT_TILES)).lower(*args).as_text()

  checkout = str(pathlib.Path(os.path.abspath(compiled_cache.__file__)).parents[2])  # links unresolved
  assert jax.config.jax_hlo_source_file_canonicalization_regex == compiled_cache.LOCAL_ROOTS_PATTERN
  canonical = lowered_text()
  assert "pallas_kernels/grouped_weight_gradient/mosaic_gpu.py" in canonical  # named from the checkout's root
  assert checkout + "/" not in canonical and sys.prefix + "/" not in canonical
  jax.config.update("jax_hlo_source_file_canonicalization_regex", None)  # what a clone elsewhere differs by
  try:
    assert checkout + "/" in lowered_text()
  finally:
    jax.config.update("jax_hlo_source_file_canonicalization_regex", compiled_cache.LOCAL_ROOTS_PATTERN)
