"""Grouped GEMM + return to the owners as one Mosaic GPU kernel (Hopper), the protocol of PROTOCOL.md.

A persistent kernel of `num_sms` thread blocks in two phases:
1. compute and return: each (received tile, column tile) is the sum of its tile GEMMs against its
   expert's weights, written (TMA, through shared memory) straight into the tile of the owner's `ret`
   buffer it came from; once the write is complete the thread block adds one to that tile's semaphore on
   the owner. Tiles go home as soon as they are computed. The work runs in one pass per owner (the device
   at offset 0, 1, ..., P-1 from this one): a TMA descriptor for peer memory is built at launch, so its
   peer must follow from the device's own position, not from data. Nothing in this phase waits for a peer;
2. wait: each of my used send tiles waits until its semaphore counts one signal per column tile (all of
   its columns are back); tiles I never sent are zeroed.
Semaphores are kernel scratch, zero at launch, and waits do not decrement.

Tile plan and legend: moe_routing.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.pallas_kernels import mosaic_tiles, ring
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes

_SCALARS = ("recv_expert", "recv_src", "recv_src_tile", "num_recv", "num_send")


def unsupported(widths: Sequence[int], d: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why this kernel cannot take inputs of these widths and outputs of width `d` (None when it can)."""
  shapes = {f"F{i}": (f, tiles.block_k) for i, f in enumerate(widths)} | {"D": (d, tiles.block_n)}
  return mosaic_tiles.unsupported(dtype, shapes, tiles)


def gemm_return(hs: Sequence[jax.Array], weights: Sequence[jax.Array], plan: TilePlan, axes: Axes, *,
                tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_sms: int = mosaic_tiles.H100_SMS,
                interpret=None) -> jax.Array:
  """ret_SD, as reference.gemm_return; the plan's tile rows must be tiles.block_m. `interpret`: see
  moe_dispatch_gemm.mosaic_gpu."""
  p = ring.size(axes)
  s_tiles, r_tiles = plan.send_dst.shape[0], plan.recv_expert.shape[0]
  tm, d, dtype = tiles.block_m, weights[0].shape[2], hs[0].dtype
  if hs[0].shape[0] != r_tiles * tm:
    raise ValueError(f"inputs of {hs[0].shape[0]} rows are not {r_tiles} tiles of block_m={tm} rows")
  reason = unsupported([h.shape[1] for h in hs], d, dtype, tiles)
  if reason:
    raise ValueError(f"MoE GEMM return kernel: {reason}")
  n_tiles = d // tiles.block_n
  tile = lambda t: pl.ds(t * tm, tm)

  def body(recv_expert, recv_src, recv_src_tile, num_recv, num_send, *refs):
    h_refs, w_refs, ret_ref = refs[:len(hs)], refs[len(hs):2 * len(hs)], refs[2 * len(hs)]
    returned = refs[2 * len(hs) + 1] if p > 1 else None
    me = ring.index(axes)
    for offset in range(p):
      owner = lax.rem(me + offset, p)
      peer = ring.device(axes, owner)
      destination = ret_ref if offset == 0 else plgpu.remote_ref(ret_ref, peer)

      @plgpu.nd_loop((r_tiles * n_tiles,), collective_axes="sm")
      def _compute_and_return(info):
        m, ni = info.index[0] // n_tiles, lax.rem(info.index[0], n_tiles)

        @pl.when((m < num_recv[0]) & (recv_src[m] == owner))
        def _():
          columns = pl.ds(ni * tiles.block_n, tiles.block_n)
          acc = None
          for h_ref, w_ref in zip(h_refs, w_refs):
            product = mosaic_tiles.matmul_tile(h_ref.at[tile(m)], w_ref.at[recv_expert[m], :, columns], tiles)
            acc = product if acc is None else acc + product
          mosaic_tiles.store_tile(acc, destination.at[tile(recv_src_tile[m]), columns])
          if p > 1:
            pl.semaphore_signal(returned.at[recv_src_tile[m]], 1, device_id=peer)

    @plgpu.nd_loop((s_tiles,), collective_axes="sm")
    def _wait_or_zero(info):
      s = info.index[0]

      @pl.when(s < num_send[0])
      def _():
        if p > 1:
          pl.semaphore_wait(returned.at[s], n_tiles, decrement=False)

      @pl.when(s >= num_send[0])
      def _():
        mosaic_tiles.zero_row_block(ret_ref.at[tile(s)], n_tiles, tiles.block_n)

  ret_SD = plgpu.kernel(
      body, out_type=ring.out_type((s_tiles * tm, d), dtype, *hs, *weights, axes=axes),
      scratch_types=[plgpu.SemaphoreType.REGULAR((s_tiles,))] if p > 1 else [],
      grid=(num_sms,), grid_names=("sm",),
      compiler_params=mosaic_tiles.compiler_params(),
      interpret=interpret,
  )(*(getattr(plan, name) for name in _SCALARS), *hs, *weights)
  return ring.varying_like(ret_SD, *hs, *weights, axes=axes)
