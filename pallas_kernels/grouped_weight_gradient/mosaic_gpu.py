"""Grouped weight gradient as a Mosaic GPU kernel (Hopper): each output tile sums its expert's row tiles.

Each expert's rows are whole tiles of `tile_rows` rows, contiguous (the MoE tile plan lays receive buffers
out that way). A persistent kernel walks the (expert, D tile, F tile) output tiles; for each it loads the
expert's row tiles of x and dy two at a time ahead (TMA into a two-slot shared-memory buffer, so tile
t + 1 loads while tile t multiplies) and accumulates x_tile^T @ dy_tile with WGMMA (the transposed
operand read straight from shared memory) into float32 registers. Only the expert's own rows are read:
the FLOPs are those of the rows that exist, where XLA's transposed ragged dot computes every expert over
every row.

With `tiles.consumers` = 2 (or more) the kernel is warp-specialised, the Hopper GEMM layout: each thread
block runs a producer warpgroup, which only issues the TMA loads of `tiles.stages` row tiles ahead, and
`consumers` warpgroups, each multiplying its own block_n / consumers columns of a block_m x block_n output
tile (Tiles(128, 256, 64, 3, 2): 128 x 256, two consumers of 128 columns), one WGMMA left in flight across
row tiles. The
producer waits only for a slot the consumers have released, so loads run ahead of the multiplies; the
consumers store their halves of the tile through shared memory while the producer loads the next tile's
rows. Untimed so far:
the GPU kit's `wgrad` rows time both layouts on a Hopper GPU.

Legend: R rows, D and F the two widths, E experts, TM rows per tile, C consumer warpgroups.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.pallas_kernels import mosaic_tiles, ring
from meshmoe.pallas_kernels.mosaic_tiles import Tiles


# Registers the producer warpgroup keeps (it holds no accumulator; the rest go to the consumers).
PRODUCER_REGISTERS = 40


def unsupported(d: int, f: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES,
                tile_rows: int | None = None) -> str | None:
  """Why this kernel cannot take widths D and F (None when it can): D in WGMMA-height tiles, F in
  block_n tiles, and with warp specialisation the pipeline's shared memory within Hopper's."""
  reason = mosaic_tiles.unsupported(dtype, {"D": (d, tiles.block_m), "F": (f, tiles.block_n)}, tiles)
  if reason or tiles.consumers == 1:
    return reason
  tm, consumers = _step_rows(tile_rows or tiles.block_m, tiles), tiles.consumers
  itemsize = jnp.dtype(dtype).itemsize
  needed = (tiles.stages * tm * (tiles.block_m + tiles.block_n)  # the pipeline's row tiles
            + tiles.block_m * tiles.block_n) * itemsize  # the consumers' output slots
  if needed > mosaic_tiles.SHARED_MEMORY_BYTES:
    return (f"tiles {tiles} with {consumers} consumers and {tm}-row tiles need {needed} bytes of shared memory, "
            f"more than {mosaic_tiles.SHARED_MEMORY_BYTES}")
  return None


def weight_gradient(x_RD: jax.Array, dy_RF: jax.Array, rows_E: jax.Array, like: jax.Array, *, tile_rows: int,
                    tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_blocks: int, interpret=None) -> jax.Array:
  """dw_EDF in `like`'s dtype, as reference.weight_gradient; rows_E must be multiples of tile_rows.
  tiles.consumers > 1: the warp-specialised kernel (module docstring)."""
  d, f, num_experts = x_RD.shape[1], dy_RF.shape[1], rows_E.shape[0]
  reason = unsupported(d, f, x_RD.dtype, tiles, tile_rows)
  if reason or dy_RF.dtype != x_RD.dtype:
    raise ValueError(f"grouped weight-gradient kernel: {reason or 'x and dy dtypes differ'}")
  tile_rows = _step_rows(tile_rows, tiles)
  tiles_E = (rows_E // tile_rows).astype(jnp.int32)
  first_E = jnp.cumsum(tiles_E) - tiles_E
  out_type = jax.ShapeDtypeStruct((num_experts, d, f), like.dtype)
  if tiles.consumers > 1:
    body = functools.partial(_warp_specialized, tiles=tiles, tile_rows=tile_rows)
    dw = plgpu.kernel(body, out_type=out_type, grid=(num_blocks,), grid_names=("sm",), num_threads=tiles.consumers + 1,
                      thread_name="wg", compiler_params=mosaic_tiles.compiler_params(), interpret=interpret,
                      )(first_E, tiles_E, x_RD, dy_RF)
    return ring.varying_like(dw, like)
  bd, bf, tm = tiles.block_m, tiles.block_n, tile_rows
  d_tiles, f_tiles = d // bd, f // bf

  def body(first_ref, count_ref, x_ref, dy_ref, out_ref):
    @plgpu.nd_loop((num_experts * d_tiles * f_tiles,), collective_axes="sm")
    def _output_tile(info):
      e, rest = info.index[0] // (d_tiles * f_tiles), lax.rem(info.index[0], d_tiles * f_tiles)
      di, fi = rest // f_tiles, lax.rem(rest, f_tiles)
      count, first = count_ref[e], first_ref[e]

      def with_buffers(x_smem, dy_smem, x_arrived, dy_arrived):
        def load(t, slot):
          rows = pl.ds((first + t) * tm, tm)
          plgpu.copy_gmem_to_smem(x_ref.at[rows, pl.ds(di * bd, bd)], x_smem.at[slot], x_arrived.at[slot])
          plgpu.copy_gmem_to_smem(dy_ref.at[rows, pl.ds(fi * bf, bf)], dy_smem.at[slot], dy_arrived.at[slot])

        def accumulate(acc_ref):
          pl.when(count > 0)(lambda: load(0, 0))

          def step(t, carry):
            slot = lax.rem(t, 2)
            # The other slot's multiply finished in the step before (wgmma_wait), so it can refill.
            pl.when(t + 1 < count)(lambda: load(t + 1, 1 - slot))
            plgpu.barrier_wait(x_arrived.at[slot])
            plgpu.barrier_wait(dy_arrived.at[slot])
            plgpu.wgmma(acc_ref, x_smem.at[slot].T, dy_smem.at[slot])
            plgpu.wgmma_wait(0)
            return carry

          lax.fori_loop(0, count, step, 0)
          return acc_ref[...]

        return pl.run_scoped(accumulate, plgpu.ACC((bd, bf), jnp.float32))

      acc = pl.run_scoped(with_buffers, plgpu.SMEM((2, tm, bd), x_RD.dtype), plgpu.SMEM((2, tm, bf), dy_RF.dtype),
                          plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2))
      mosaic_tiles.store_tile(acc, out_ref.at[e, pl.ds(di * bd, bd), pl.ds(fi * bf, bf)])

  dw = plgpu.kernel(
      body, out_type=out_type,
      grid=(num_blocks,), grid_names=("sm",), compiler_params=mosaic_tiles.compiler_params(), interpret=interpret,
  )(first_E, tiles_E, x_RD, dy_RF)
  return ring.varying_like(dw, like)


def _step_rows(tile_rows: int, tiles: Tiles) -> int:
  """Rows multiplied per step: the plan's tile rows, or block_k of them where a tile is taller (a 128-row
  tile of the Hopper layout is two steps), so the pipeline's row tiles fit in shared memory."""
  return math.gcd(tile_rows, tiles.block_k)


def _warp_specialized(first_ref, count_ref, x_ref, dy_ref, out_ref, *, tiles: Tiles, tile_rows: int):
  """The warp-specialised kernel body, run by every warpgroup of a block (module docstring)."""
  num_experts, d, f = out_ref.shape
  consumers, bd, bf, tm = tiles.consumers, tiles.block_m, tiles.consumer_columns, tile_rows
  d_tiles, f_tiles = d // bd, f // tiles.block_n
  wg = lax.axis_index("wg")

  def pipeline(body, compute_context, grid, first, di, fi):
    # The producer keeps `stages` row tiles in flight; buffers are released one step late, so a consumer
    # leaves its newest WGMMA running while it issues the next (wgmma_wait(1)).
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=grid, memory_registers=PRODUCER_REGISTERS, wg_axis="wg", num_compute_wgs=consumers,
        max_concurrent_steps=tiles.stages, compute_context=compute_context,
        in_specs=[plgpu.BlockSpec((tm, bd), lambda t: (first + t, di), delay_release=1),
                  plgpu.BlockSpec((tm, consumers * bf), lambda t: (first + t, fi), delay_release=1)])

  def multiply(indices, x_smem, dy_smem, acc_ref):
    plgpu.wgmma(acc_ref, x_smem.T, dy_smem.at[:, pl.ds(wg * bf, bf)])
    plgpu.wgmma_wait(1)
    return acc_ref

  def with_scratch(out_smem):
    @plgpu.nd_loop((num_experts * d_tiles * f_tiles,), collective_axes="sm")
    def _output_tile(info):
      e, rest = info.index[0] // (d_tiles * f_tiles), lax.rem(info.index[0], d_tiles * f_tiles)
      di, fi = rest // f_tiles, lax.rem(rest, f_tiles)

      def compute_context(run_pipeline):
        def accumulate(acc_ref):
          run_pipeline(acc_ref)
          plgpu.wgmma_wait(0)
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # this consumer's last tile has left its slot
          out_smem[wg] = acc_ref[...].astype(out_smem.dtype)
          plgpu.commit_smem()
          columns = pl.ds((fi * consumers + wg) * bf, bf)
          plgpu.copy_smem_to_gmem(out_smem.at[wg], out_ref.at[e, pl.ds(di * bd, bd), columns])

        pl.run_scoped(accumulate, plgpu.ACC((bd, bf), jnp.float32))

      # Each output tile's pipeline allocates its own buffers and barriers: sharing one allocation between
      # pipelines lets the producer refill a slot whose last use a consumer has not yet observed (the
      # interpreter's barrier check fails with one row tile per expert), unless the pipelines are chained.
      pipeline(multiply, compute_context, (count_ref[e],), first_ref[e], di, fi)(x_ref, dy_ref)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(with_scratch, plgpu.SMEM((consumers, bd, bf), out_ref.dtype), collective_axes="wg")

