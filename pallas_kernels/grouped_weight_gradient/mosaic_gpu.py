"""Grouped weight gradient as a Mosaic GPU kernel (Hopper): each output tile sums its expert's row steps.

Each expert's rows are contiguous, expert after expert (rows_E). A persistent kernel walks the (expert,
D tile, F tile) output tiles; for each it loads the expert's rows of x and dy in steps of TM = block_k
rows, two steps ahead (TMA into a two-slot shared-memory buffer, so step t + 1 loads while step t
multiplies), and accumulates x_step^T @ dy_step with WGMMA (the transposed operand read straight from
shared memory) into float32 registers. Only the expert's own rows are read: the FLOPs are those of the
rows that exist, where XLA's transposed ragged dot computes every expert over every row.

Rows come two ways:
- in whole steps (`tile_rows` a multiple of block_k: the MoE tile plan lays receive buffers out so);
- ragged (any other `tile_rows`, e.g. 1: tokamax's path, rows sorted by expert and nothing padded). An
  expert's first and last steps may then hold rows of its neighbours, which are zeroed in shared memory
  before they are multiplied.

With `tiles.consumers` = 2 (or more) the kernel is warp-specialised, the Hopper GEMM layout (whole steps
only): each thread block runs a producer warpgroup, which only issues the TMA loads of `tiles.stages`
steps ahead, and `consumers` warpgroups, each multiplying its own block_n / consumers columns of a
block_m x block_n output tile (Tiles(128, 256, 64, 3, 2): 128 x 256, two consumers of 128 columns), one
WGMMA left in flight across steps. The producer waits only for a slot the consumers have released, so
loads run ahead of the multiplies; the consumers store their halves of the tile through shared memory
while the producer loads the next tile's rows. Untimed so far: the GPU kit's `wgrad` rows time both
layouts on a Hopper GPU.

Legend: R rows, D and F the two widths, E experts, TM rows per step, C consumer warpgroups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.pallas_kernels import gpu_kernel, mosaic_tiles, ring
from meshmoe.pallas_kernels.mosaic_tiles import Tiles


KERNEL_NAME = "grouped_weight_gradient"  # the compiled kernel's (and its ptxas report's) name
# Registers the producer warpgroup keeps (it holds no accumulator; the rest go to the consumers).
PRODUCER_REGISTERS = 40


def unsupported(d: int, f: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES,
                tile_rows: int | None = None) -> str | None:
  """Why this kernel cannot take widths D and F (None when it can): D in WGMMA-height tiles, F in
  block_n tiles; with warp specialisation, expert rows in whole block_k steps (`tile_rows`) and the
  pipeline's shared memory within Hopper's."""
  reason = mosaic_tiles.unsupported(dtype, {"D": (d, tiles.block_m), "F": (f, tiles.block_n)}, tiles)
  if reason or tiles.consumers == 1:
    return reason
  if _ragged(tile_rows or tiles.block_m, tiles):
    return (f"the warp-specialised kernel needs each expert's rows in whole {tiles.block_k}-row steps, "
            f"not multiples of {tile_rows}")
  tm, consumers = tiles.block_k, tiles.consumers
  itemsize = jnp.dtype(dtype).itemsize
  needed = (tiles.stages * tm * (tiles.block_m + tiles.block_n)  # the pipeline's row tiles
            + tiles.block_m * tiles.block_n) * itemsize  # the consumers' output slots
  if needed > mosaic_tiles.SHARED_MEMORY_BYTES:
    return (f"tiles {tiles} with {consumers} consumers and {tm}-row tiles need {needed} bytes of shared memory, "
            f"more than {mosaic_tiles.SHARED_MEMORY_BYTES}")
  return None


def weight_gradient(x_RD: jax.Array, dy_RF: jax.Array, rows_E: jax.Array, like: jax.Array, *, tile_rows: int,
                    tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_blocks: int, interpret=None) -> jax.Array:
  """dw_EDF in `like`'s dtype, as reference.weight_gradient; every rows_E[e] is a multiple of tile_rows
  (1: any). tiles.consumers > 1: the warp-specialised kernel (module docstring)."""
  d, f, num_experts = x_RD.shape[1], dy_RF.shape[1], rows_E.shape[0]
  reason = unsupported(d, f, x_RD.dtype, tiles, tile_rows)
  if reason or dy_RF.dtype != x_RD.dtype:
    raise ValueError(f"grouped weight-gradient kernel: {reason or 'x and dy dtypes differ'}")
  ragged, tm = _ragged(tile_rows, tiles), tiles.block_k
  if x_RD.shape[0] % tm:  # the last expert's last step reads whole tiles; its rows past the groups are masked
    pad = ((0, tm - x_RD.shape[0] % tm), (0, 0))
    x_RD, dy_RF = jnp.pad(x_RD, pad), jnp.pad(dy_RF, pad)
  rows_E = rows_E.astype(jnp.int32)
  start_E = jnp.cumsum(rows_E) - rows_E
  out_type = jax.ShapeDtypeStruct((num_experts, d, f), like.dtype)
  if tiles.consumers > 1:
    body = functools.partial(_warp_specialized, tiles=tiles)
    dw = plgpu.kernel(gpu_kernel.named(body, KERNEL_NAME), out_type=out_type, grid=(num_blocks,), grid_names=("sm",),
                      num_threads=tiles.consumers + 1, thread_name="wg", compiler_params=mosaic_tiles.compiler_params(),
                      interpret=interpret)(start_E // tm, rows_E // tm, x_RD, dy_RF)
    return ring.varying_like(dw, like)
  bd, bf = tiles.block_m, tiles.block_n
  d_tiles, f_tiles = d // bd, f // bf

  def body(start_ref, size_ref, x_ref, dy_ref, out_ref):
    @plgpu.nd_loop((num_experts * d_tiles * f_tiles,), collective_axes="sm")
    def _output_tile(info):
      e, rest = info.index[0] // (d_tiles * f_tiles), lax.rem(info.index[0], d_tiles * f_tiles)
      di, fi = rest // f_tiles, lax.rem(rest, f_tiles)
      start, size = start_ref[e], size_ref[e]
      # The expert's rows [start, start + size) in whole tm-row steps; the first and last may hold rows of
      # other experts (ragged), which are zeroed in shared memory before they are multiplied.
      first = start // tm
      count = jnp.where(size > 0, (start + size + tm - 1) // tm - first, 0)

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
            if ragged:
              pl.when((t == 0) | (t == count - 1))(
                  lambda: _keep_rows(((x_smem.at[slot], bd), (dy_smem.at[slot], bf)), (first + t) * tm, start, size))
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
      gpu_kernel.named(body, KERNEL_NAME), out_type=out_type,
      grid=(num_blocks,), grid_names=("sm",), compiler_params=mosaic_tiles.compiler_params(), interpret=interpret,
  )(start_E, rows_E, x_RD, dy_RF)
  return ring.varying_like(dw, like)


def _ragged(tile_rows: int, tiles: Tiles) -> bool:
  """Whether experts' rows may start or end inside a block_k-row step (then its other rows are masked)."""
  return tile_rows % tiles.block_k != 0


def _keep_rows(tiles_smem, first_row, start, size) -> None:
  """Zeros the rows of shared-memory row tiles outside [start, start + size) (rows from first_row on):
  both operands, so rows of other experts add nothing even where they hold infinities."""
  for tile_smem, width in tiles_smem:
    rows = first_row + lax.broadcasted_iota(jnp.int32, (tile_smem.shape[0], width), 0)
    keep = (rows >= start) & (rows < start + size)
    tile_smem[...] = jnp.where(keep, tile_smem[...], jnp.zeros((), tile_smem.dtype))
  plgpu.commit_smem()  # the WGMMA reads shared memory through the async proxy


def _warp_specialized(first_ref, count_ref, x_ref, dy_ref, out_ref, *, tiles: Tiles):
  """The warp-specialised kernel body, run by every warpgroup of a block (module docstring); first_ref and
  count_ref in block_k-row steps."""
  num_experts, d, f = out_ref.shape
  consumers, bd, bf, tm = tiles.consumers, tiles.block_m, tiles.consumer_columns, tiles.block_k
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

