"""Grouped weight gradient as a Mosaic GPU kernel (Hopper): each output tile sums its expert's row tiles.

Each expert's rows are whole tiles of `tile_rows` rows, contiguous (the MoE tile plan lays receive buffers
out that way). A persistent kernel walks the (expert, D tile, F tile) output tiles; for each it loads the
expert's row tiles of x and dy two at a time ahead (TMA into a two-slot shared-memory buffer, so tile
t + 1 loads while tile t multiplies) and accumulates x_tile^T @ dy_tile with WGMMA (the transposed
operand read straight from shared memory) into float32 registers. Only the expert's own rows are read:
the FLOPs are those of the rows that exist, where XLA's transposed ragged dot computes every expert over
every row.

Legend: R rows, D and F the two widths, E experts, TM rows per tile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.pallas_kernels import mosaic_tiles, ring
from meshmoe.pallas_kernels.mosaic_tiles import Tiles


def unsupported(d: int, f: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why this kernel cannot take widths D and F (None when it can): D in WGMMA-height tiles, F in
  block_n tiles."""
  return mosaic_tiles.unsupported(dtype, {"D": (d, tiles.block_m), "F": (f, tiles.block_n)}, tiles)


def weight_gradient(x_RD: jax.Array, dy_RF: jax.Array, rows_E: jax.Array, like: jax.Array, *, tile_rows: int,
                    tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_blocks: int,
                    interpret=None) -> jax.Array:
  """dw_EDF in `like`'s dtype, as reference.weight_gradient; rows_E must be multiples of tile_rows."""
  d, f, num_experts = x_RD.shape[1], dy_RF.shape[1], rows_E.shape[0]
  reason = unsupported(d, f, x_RD.dtype, tiles)
  if reason or dy_RF.dtype != x_RD.dtype:
    raise ValueError(f"grouped weight-gradient kernel: {reason or 'x and dy dtypes differ'}")
  bd, bf, tm = tiles.block_m, tiles.block_n, tile_rows
  d_tiles, f_tiles = d // bd, f // bf
  tiles_E = (rows_E // tm).astype(jnp.int32)
  first_E = jnp.cumsum(tiles_E) - tiles_E

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
      body, out_type=jax.ShapeDtypeStruct((num_experts, d, f), like.dtype),
      grid=(num_blocks,), grid_names=("sm",), compiler_params=mosaic_tiles.compiler_params(), interpret=interpret,
  )(first_E, tiles_E, x_RD, dy_RF)
  return ring.varying_like(dw, like)

