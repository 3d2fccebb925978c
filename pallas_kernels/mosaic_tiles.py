"""Tile GEMM building blocks shared by the Mosaic GPU kernels (Hopper: TMA copies and WGMMA).

A kernel computes one output tile at a time: `matmul_tile` streams the K dimension of an A row block and
a B column block through shared memory (a pipeline of `stages` TMA loads ahead of the WGMMA that consumes
them, with one WGMMA left in flight across K steps) into a float32 accumulator; `store_tile` writes a
tile through shared memory to global memory (local or a peer's); `load_tile` reads one. The grouped GEMM
tiles of the MoE kernels are the same tile over one expert's weights. These are written here rather than
taken from tokamax, whose Mosaic GPU GEMMs read the live device at trace time and so cannot be compiled
for GPUs this machine does not have, and because the fused kernels need hooks inside the K loop
(forwarding each A tile to a peer as it is loaded, by the all-gather GEMM).

Legend: M rows, N columns, K contraction of one tile GEMM.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.config import KERNEL_TILES

# WGMMA multiplies 16-bit floating point inputs (float32 would need TF32 and different tiles).
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Hopper's shared memory per block (opt-in maximum, the figure XLA's H100 spec gives).
SHARED_MEMORY_BYTES = 232_448


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes of a kernel's GEMMs. block_m 64 is one warpgroup's WGMMA height; block_k 64 bf16 values
  are one 128-byte swizzled row; `stages` TMA loads are in flight ahead of the WGMMA.

  `consumers` > 1 warp-specialises a kernel's thread blocks (the Hopper GEMM layout): a producer warpgroup
  loads tiles and runs the communication, and `consumers` warpgroups each multiply block_n / consumers
  columns of the block_m x block_n output tile (gpu_warp_specialized.py; e.g. Tiles(128, 256, 64, 3, 2))."""

  block_m: int = 64
  block_n: int = 128
  block_k: int = 64
  stages: int = 4
  consumers: int = 1

  @property
  def consumer_columns(self) -> int:
    """Output columns each consumer warpgroup multiplies."""
    return self.block_n // self.consumers

  @property
  def splits_gate_up(self) -> bool:
    """Whether a SwiGLU GEMM step splits its tile by rows between two consumers: gate's and up's columns
    fill the two consumers' B panels, and each consumer multiplies its 64 rows by both (two accumulators
    of 64 x block_n / 2, half the registers of two column halves' 128-row gate and up tiles)."""
    return self.consumers == 2 and self.block_m == 128

  @property
  def gate_up_columns(self) -> int:
    """Columns of gate (and of up) one SwiGLU GEMM step computes: a B panel's where the step splits by rows."""
    return self.consumer_columns if self.splits_gate_up else self.block_n

  def staging_shape(self) -> tuple[int, int, int]:
    """(slots, rows, columns) of a warp-specialised producer's staging buffer for puts: chunks of 64 rows
    (or block_m) by block_k columns, small enough to leave the shared memory to the GEMM pipeline."""
    return STAGING_SLOTS, min(self.block_m, 64), self.block_k

  def gate_up_pipeline_fits(self, itemsize: int) -> bool:
    """Whether one warpgroup's SwiGLU pipeline (matmul_gate_up: an A and two B tiles per stage, two output
    tiles' float32 accumulators) fits in shared memory with the output tile."""
    pipeline = self.stages * (self.block_m * self.block_k + 2 * self.block_k * self.block_n) * itemsize
    return pipeline + self.block_m * self.block_n * max(itemsize, 4) <= SHARED_MEMORY_BYTES

  def shared_memory_bytes(self, itemsize: int) -> int:
    """Shared memory of one thread block: the pipeline's A and B buffers and the output tile, and with
    warp specialisation the producer's staging buffer too."""
    pipeline = self.stages * (self.block_m * self.block_k + self.block_k * self.block_n) * itemsize
    if self.consumers == 1:
      return pipeline + self.block_m * self.block_n * max(itemsize, 4)
    slots, rows, columns = self.staging_shape()
    return pipeline + (self.block_m * self.block_n + slots * rows * columns) * itemsize


# Slots of a warp-specialised producer's staging buffer (Tiles.staging_shape).
STAGING_SLOTS = 2
DEFAULT_TILES = Tiles()
# Hopper's GEMM layout: 128 x 256 output tiles, a producer and two consumer warpgroups, 3 stages. Untimed
# against DEFAULT_TILES so far, so the default stays one warpgroup (pallas_kernels/README.md, "Verification").
HOPPER_TILES = Tiles(128, 256, 64, 3, consumers=2)
# The config's `parallel.kernel_tiles` choices.
LAYOUTS = dict(zip(KERNEL_TILES, (DEFAULT_TILES, HOPPER_TILES)))


def unsupported(dtype, shapes: dict[str, tuple[int, int]], tiles: Tiles) -> str | None:
  """Why the tile kernels cannot run these GEMMs (None when they can). `shapes` names each GEMM's
  (rows, cols) pair per tiled dimension, e.g. {"M": (m, block_m), ...}."""
  if tiles.stages < 2:
    return f"tiles {tiles} pipeline fewer than 2 stages (a step's buffers are released one step late)"
  if tiles.consumers < 1 or tiles.block_n % tiles.consumers or tiles.consumer_columns % 64:
    return (f"tiles {tiles}: block_n={tiles.block_n} must split into {tiles.consumers} consumer warpgroups' "
            "column blocks of a multiple of 64")
  if tiles.block_m % 64:
    return f"tiles {tiles}: block_m={tiles.block_m} is not a multiple of 64 (a warpgroup's WGMMA height)"
  if jnp.dtype(dtype) not in DTYPES:
    return f"dtype {jnp.dtype(dtype).name} (the GPU kernels multiply bfloat16 or float16)"
  for name, (size, block) in shapes.items():
    if size % block:
      return f"{name}={size} is not a multiple of its tile {block}"
  if tiles.shared_memory_bytes(jnp.dtype(dtype).itemsize) > SHARED_MEMORY_BYTES:
    return f"tiles {tiles} need more than {SHARED_MEMORY_BYTES} bytes of shared memory"
  return None


def matmul_tile(a_gmem, b_gmem, tiles: Tiles, on_a_tile: Callable[[jax.Array, object], None] | None = None,
                transpose_b: bool = False) -> jax.Array:
  """a_gmem [block_m, K] @ b_gmem [K, block_n] as a float32 value; with `transpose_b`, b_gmem is
  [block_n, K] and WGMMA reads its shared-memory tiles transposed. `on_a_tile(k_index, a_smem)` runs
  for each A tile once it is in shared memory (before the buffer is reused), e.g. to send it on."""
  return matmul_sum([(a_gmem, b_gmem)], tiles, transpose_b, on_a_tile)


def matmul_sum(pairs, tiles: Tiles, transpose_b: bool = False, on_a_tile=None) -> jax.Array:
  """The sum of a_gmem @ b_gmem over `pairs` (each as matmul_tile's operands) as a float32 value: every
  product is accumulated into one accumulator, so a sum holds one tile in registers, not one per product."""

  def accumulate(acc_ref):
    for a_gmem, b_gmem in pairs:
      _accumulate(acc_ref, a_gmem, b_gmem, tiles, on_a_tile, transpose_b)
    return acc_ref[...]

  return pl.run_scoped(accumulate, plgpu.ACC((tiles.block_m, tiles.block_n), jnp.float32))


def matmul_gate_up(a_gmem, gate_gmem, up_gmem, tiles: Tiles) -> tuple[jax.Array, jax.Array]:
  """(a_gmem @ gate_gmem, a_gmem @ up_gmem) as float32 values from one pipeline: each A tile is loaded once
  for both products (Tiles.gate_up_pipeline_fits must hold)."""
  b_spec = plgpu.BlockSpec((tiles.block_k, tiles.block_n), lambda ki: (ki, 0), delay_release=1)

  def accumulate(gate_acc, up_acc):
    def step(indices, a_smem, gate_smem, up_smem):
      plgpu.wgmma(gate_acc, a_smem, gate_smem)
      plgpu.wgmma(up_acc, a_smem, up_smem)
      plgpu.wgmma_wait(1)  # the previous step's WGMMAs are complete (its buffers are released next)

    plgpu.emit_pipeline(
        step, grid=(a_gmem.shape[1] // tiles.block_k,),
        in_specs=[plgpu.BlockSpec((tiles.block_m, tiles.block_k), lambda ki: (0, ki), delay_release=1), b_spec,
                  b_spec],
        max_concurrent_steps=tiles.stages,
    )(a_gmem, gate_gmem, up_gmem)
    plgpu.wgmma_wait(0)
    return gate_acc[...], up_acc[...]

  acc = plgpu.ACC((tiles.block_m, tiles.block_n), jnp.float32)
  return pl.run_scoped(accumulate, acc, acc)


def _accumulate(acc_ref, a_gmem, b_gmem, tiles: Tiles, on_a_tile, transpose_b: bool) -> None:
  """Adds a_gmem @ b_gmem to acc_ref through a pipeline of `stages` TMA loads; every WGMMA is complete when
  it returns."""
  k = a_gmem.shape[1]
  # Each step's buffers are released one step late (delay_release=1), so a step may leave its WGMMA in
  # flight (wgmma_wait(1): all but the newest are complete) and the tensor cores never wait for the issue
  # of the next K step; by the time a buffer is refilled, its WGMMA has completed.
  if transpose_b:
    b_spec = plgpu.BlockSpec((tiles.block_n, tiles.block_k), lambda ki: (0, ki), delay_release=1)
  else:
    b_spec = plgpu.BlockSpec((tiles.block_k, tiles.block_n), lambda ki: (ki, 0), delay_release=1)

  def step(indices, a_smem, b_smem, acc_ref):
    plgpu.wgmma(acc_ref, a_smem, b_smem.T if transpose_b else b_smem)
    if on_a_tile is not None:
      on_a_tile(indices[0], a_smem)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the A buffer is refilled after this step
    plgpu.wgmma_wait(1)

  plgpu.emit_pipeline(
      functools.partial(_with_acc, step, acc_ref),
      grid=(k // tiles.block_k,),
      in_specs=[plgpu.BlockSpec((tiles.block_m, tiles.block_k), lambda ki: (0, ki), delay_release=1), b_spec],
      max_concurrent_steps=tiles.stages,
  )(a_gmem, b_gmem)
  plgpu.wgmma_wait(0)  # the last step's WGMMA


def _with_acc(step, acc_ref, indices, a_smem, b_smem):
  step(indices, a_smem, b_smem, acc_ref)


def store_tile(value: jax.Array, dst_gmem, wait_complete: bool = True) -> None:
  """Writes a tile value to `dst_gmem` (any global ref, a peer's too) through shared memory and waits
  until the write is complete (so a semaphore signalled next orders after it), or with
  `wait_complete=False` only until the copy has read the shared memory (which is then reused)."""

  def store(tile_smem):
    tile_smem[...] = value.astype(tile_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(tile_smem, dst_gmem)
    plgpu.wait_smem_to_gmem(0, wait_read_only=not wait_complete)

  pl.run_scoped(store, plgpu.SMEM(value.shape, dst_gmem.dtype))


def column_block(index, width: int) -> pl.Slice:
  """Columns [index * width, (index + 1) * width) for a kernel loop index."""
  return pl.ds(pl.multiple_of(index * width, width), width)


def zero_row_block(dst_gmem, num_blocks: int, width: int) -> None:
  """Writes zeros to a row block of `num_blocks` x `width` columns, one tile at a time. A loop in the
  kernel, not unrolled: Mosaic GPU's layout inference recurses once per operation, and unrolled column
  loops over a model's full width (4096 and more) exceed Python's recursion limit."""

  @pl.loop(0, num_blocks)
  def _zero(c):
    store_tile(jnp.zeros((dst_gmem.shape[0], width), jnp.float32), dst_gmem.at[:, column_block(c, width)])


def load_tile(src_gmem) -> jax.Array:
  """A tile of global memory as a value (through shared memory)."""

  def load(tile_smem, barrier):
    plgpu.copy_gmem_to_smem(src_gmem, tile_smem, barrier)
    plgpu.barrier_wait(barrier)
    return tile_smem[...]

  return pl.run_scoped(load, plgpu.SMEM(src_gmem.shape, src_gmem.dtype), plgpu.Barrier())


def compiler_params() -> plgpu.CompilerParams:
  return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)
