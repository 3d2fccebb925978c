"""The grouped weight-gradient kernel (pallas_kernels/grouped_weight_gradient): per expert, its contiguous
row tiles of x transposed times those of dy, against a NumPy sum per expert, in the Mosaic GPU
interpreter (empty experts and an expert with every row included), with one warpgroup and warp-specialised
(a producer and two consumers); both compile for an H100 without a GPU, the warp-specialised one with
Hopper's 128 x 256 tile at Mixtral's expert widths; the reference (XLA's transposed ragged dot) agrees.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshmoe.analysis import deviceless
from meshmoe.pallas_kernels import mosaic_tiles
from meshmoe.pallas_kernels.grouped_weight_gradient import api, mosaic_gpu
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from tests.pallas_kernels import harness
from tests.tolerances import FP32_MODULE_RTOL, assert_close

TM = 64


def _case(tiles_per_expert, d=128, f=256, seed=0):
  rows = np.asarray(tiles_per_expert) * TM
  total = int(rows.sum()) + 2 * TM  # unused rows after the last group: ignored
  keys = jax.random.split(jax.random.key(seed), 2)
  x = jax.random.normal(keys[0], (total, d), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[1], (total, f), jnp.float32).astype(jnp.bfloat16)
  return x, dy, jnp.asarray(rows, jnp.int32)


def _numpy(x, dy, rows) -> np.ndarray:
  x, dy = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  starts = np.cumsum(rows) - rows
  return np.stack([x[s:s + n].T @ dy[s:s + n] for s, n in zip(starts, np.asarray(rows))])


# The one-warpgroup kernel, and the warp-specialised one with a producer and two consumers on 64 x 128 and
# 64 x 256 output tiles (the 128-row tiles compile below; the interpreter runs them too, slower).
LAYOUTS = [mosaic_tiles.DEFAULT_TILES, Tiles(64, 128, 64, 2, consumers=2), Tiles(64, 256, 64, 3, consumers=2)]


@pytest.mark.parametrize("tiles", LAYOUTS, ids=["one-warpgroup", "ws-64x128", "ws-64x256"])
@pytest.mark.parametrize("tiles_per_expert", [[2, 0, 3], [0, 0, 5, 0], [1, 1, 1, 1, 1]], ids=["gap", "one", "even"])
def test_kernel_equals_a_sum_per_expert(tiles_per_expert, tiles):
  x, dy, rows = _case(tiles_per_expert)
  like = jnp.zeros((len(tiles_per_expert), x.shape[1], dy.shape[1]), jnp.float32)
  mesh = harness.one_device_ring()
  run = lambda fn: harness.per_device(fn, mesh, (P(),) * 4, P())(x, dy, rows, like)
  got = run(lambda x, dy, rows, like: mosaic_gpu.weight_gradient(x, dy, rows, like, tile_rows=TM, tiles=tiles,
                                                                 num_blocks=3,
                                                                 interpret=harness.GPU_INTERPRET))
  # float32 output, bfloat16 inputs: only the summation order differs from float64.
  assert_close(got, _numpy(x, dy, rows), FP32_MODULE_RTOL, "kernel")
  reference = run(lambda x, dy, rows, like: api.weight_gradient(x, dy, rows, like, tile_rows=TM, backend="collectives"))
  assert_close(reference, _numpy(x, dy, rows), FP32_MODULE_RTOL, "reference")


@pytest.mark.parametrize("rows", [[37, 0, 90, 1, 64], [0, 200, 0], [5]], ids=["uneven", "one", "few"])
def test_ragged_rows_equal_a_sum_per_expert(rows):
  """Experts' rows not in whole 64-row steps (tile_rows=1, tokamax's path): the steps an expert shares with
  its neighbours are masked. The rows after the groups hold infinities, which must not leak in, and the
  buffer's rows are not a multiple of 64."""
  rows = np.asarray(rows)
  total = int(rows.sum()) + 11
  keys = jax.random.split(jax.random.key(3), 2)
  x = jax.random.normal(keys[0], (total, 128), jnp.float32).astype(jnp.bfloat16).at[int(rows.sum()):].set(jnp.inf)
  dy = jax.random.normal(keys[1], (total, 256), jnp.float32).astype(jnp.bfloat16).at[int(rows.sum()):].set(jnp.inf)
  rows = jnp.asarray(rows, jnp.int32)
  like = jnp.zeros((rows.shape[0], 128, 256), jnp.float32)
  got = harness.per_device(
      lambda x, dy, rows, like: mosaic_gpu.weight_gradient(x, dy, rows, like, tile_rows=1, num_blocks=3,
                                                           interpret=harness.GPU_INTERPRET),
      harness.one_device_ring(), (P(),) * 4, P())(x, dy, rows, like)
  assert_close(got, _numpy(x, dy, rows), FP32_MODULE_RTOL, "ragged kernel")


# Mixtral-8x7B's expert widths (D 4096, F 14336) with the Hopper tile: 128 x 256, two consumers, 3 stages.
HOPPER_TILES = mosaic_tiles.HOPPER_TILES


@pytest.mark.parametrize("d,f,tiles,tile_rows", [(256, 512, mosaic_tiles.DEFAULT_TILES, TM),
                                                 (4096, 14336, HOPPER_TILES, TM),
                                                 (4096, 14336, mosaic_tiles.DEFAULT_TILES, 1)],
                         ids=["one-warpgroup", "ws-128x256", "ragged"])
def test_kernel_compiles_for_an_h100(d, f, tiles, tile_rows):
  mesh = harness.h100_mesh(1)
  args = [harness.abstract(mesh, (8 * TM + 5, d), jnp.bfloat16, P()),
          harness.abstract(mesh, (8 * TM + 5, f), jnp.bfloat16, P()),
          harness.abstract(mesh, (4,), jnp.int32, P()), harness.abstract(mesh, (4, d, f), jnp.bfloat16, P())]
  hlo = deviceless.compile_for_analysis(jax.jit(
      lambda x, dy, rows, like: api.weight_gradient(x, dy, rows, like, tile_rows=tile_rows, backend="mosaic_gpu",
                                                    num_sms=harness.h100_sms(), tiles=tiles)).lower(*args)).as_text()
  assert 'custom_call_target="mosaic_gpu' in hlo and " dot(" not in hlo


def test_unsupported_names_the_width():
  assert api.unsupported(128, 256, jnp.bfloat16) is None
  assert "D=96" in api.unsupported(96, 256, jnp.bfloat16)
  assert "F=64" in api.unsupported(128, 64, jnp.bfloat16)
  assert "F=384" in api.unsupported(128, 384, jnp.bfloat16, HOPPER_TILES)  # 256-wide tiles
  assert api.unsupported(4096, 14336, jnp.bfloat16, HOPPER_TILES, tile_rows=TM) is None
  # Four stages of 64-row tiles 128 + 256 wide, and two 128 x 128 output slots: 256 KB, more than Hopper has.
  assert "shared memory" in api.unsupported(4096, 14336, jnp.bfloat16, Tiles(128, 256, 64, 4, consumers=2))
  assert "consumer warpgroups" in api.unsupported(128, 256, jnp.bfloat16, Tiles(128, 96, 64, 3, consumers=2))
  assert "whole 64-row steps" in api.unsupported(128, 256, jnp.bfloat16, HOPPER_TILES, tile_rows=1)
