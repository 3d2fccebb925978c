"""MoE dispatch + grouped GEMM as one Mosaic GPU kernel (Hopper), the protocol of PROTOCOL.md.

A persistent kernel of `num_sms` thread blocks in three phases, none of which waits for a peer before
its own sends are out:
1. send: each used send tile is copied (TMA, through shared memory, in column chunks) into its tile of
   the receiver's buffer; once the copies are complete the sender adds one to that receive tile's
   semaphore on the receiver. The tiles go out in one pass per peer (the peer at offset 0, 1, ..., P-1
   from this device): a TMA descriptor for peer memory is built at launch, so its peer must follow from
   the device's own position, not from data;
2. zero: receive tiles past `num_recv` are zeroed locally (no peer writes them);
3. compute: each (receive tile, weight, column tile) waits for its receive tile's semaphore, then runs
   the tile GEMM against its expert's weights. A tile starts as soon as its own rows are there, not when
   the whole exchange is done.
Semaphores are kernel scratch, zero at launch; waits do not decrement, so any number of thread blocks
can wait for the same tile.

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

_SCALARS = ("send_dst", "send_dst_tile", "num_send", "recv_expert", "num_recv")


def unsupported(d: int, widths: Sequence[int], dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why this kernel cannot take rows of width `d` and weights of these widths (None when it can)."""
  shapes = {"D": (d, tiles.block_k), "D (copied in chunks)": (d, tiles.block_n)}
  shapes |= {f"F{i}": (f, tiles.block_n) for i, f in enumerate(widths)}
  return mosaic_tiles.unsupported(dtype, shapes, tiles)


def dispatch_gemm(xs_SD: jax.Array, weights: Sequence[jax.Array], plan: TilePlan, axes: Axes, *,
                  tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_sms: int = mosaic_tiles.H100_SMS,
                  interpret=None) -> tuple[jax.Array, ...]:
  """(xr_RD, *products), as reference.dispatch_gemm; the plan's tile rows must be tiles.block_m.
  `interpret`: the Mosaic GPU interpreter, which has no semaphores: a ring of one device only."""
  p = ring.size(axes)
  s_tiles, r_tiles = plan.send_dst.shape[0], plan.recv_expert.shape[0]
  tm, d = tiles.block_m, xs_SD.shape[1]
  if xs_SD.shape[0] != s_tiles * tm:
    raise ValueError(f"send buffer of {xs_SD.shape[0]} rows is not {s_tiles} tiles of block_m={tm} rows")
  widths = [w.shape[2] for w in weights]
  reason = unsupported(d, widths, xs_SD.dtype, tiles)
  if reason:
    raise ValueError(f"MoE dispatch GEMM kernel: {reason}")
  chunk = tiles.block_n
  tile = lambda t: pl.ds(t * tm, tm)

  def body(send_dst, send_dst_tile, num_send, recv_expert, num_recv, xs_ref, *refs):
    w_refs, (xr_ref, *out_refs) = refs[:len(weights)], refs[len(weights):2 * len(weights) + 1]
    arrived = refs[2 * len(weights) + 1] if p > 1 else None

    me = ring.index(axes)
    for offset in range(p):  # one pass per peer: a TMA into peer memory needs a peer known at launch
      dst = lax.rem(me + offset, p)
      peer = ring.device(axes, dst)
      destination = xr_ref if offset == 0 else plgpu.remote_ref(xr_ref, peer)

      @plgpu.nd_loop((s_tiles,), collective_axes="sm")
      def _send(info):
        s = info.index[0]

        @pl.when((s < num_send[0]) & (send_dst[s] == dst))
        def _():
          dst_tile = send_dst_tile[s]

          @pl.loop(0, d // chunk)  # a loop in the kernel: unrolled, wide rows overflow layout inference
          def _copy(c):
            columns = mosaic_tiles.column_block(c, chunk)
            mosaic_tiles.store_tile(mosaic_tiles.load_tile(xs_ref.at[tile(s), columns]),
                                    destination.at[tile(dst_tile), columns])

          if p > 1:
            pl.semaphore_signal(arrived.at[dst_tile], 1, device_id=peer)

    @plgpu.nd_loop((r_tiles,), collective_axes="sm")
    def _zero_unused(info):
      m = info.index[0]

      @pl.when(m >= num_recv[0])
      def _():
        for ref, width in ((xr_ref, d), *zip(out_refs, widths)):
          mosaic_tiles.zero_row_block(ref.at[tile(m)], width // chunk, chunk)

    for w_ref, out_ref, f in zip(w_refs, out_refs, widths):
      n_tiles = f // tiles.block_n

      @plgpu.nd_loop((r_tiles * n_tiles,), collective_axes="sm")
      def _compute(info):
        m, ni = info.index[0] // n_tiles, lax.rem(info.index[0], n_tiles)

        @pl.when(m < num_recv[0])
        def _():
          if p > 1:
            pl.semaphore_wait(arrived.at[m], 1, decrement=False)
          columns = pl.ds(ni * tiles.block_n, tiles.block_n)
          acc = mosaic_tiles.matmul_tile(xr_ref.at[tile(m)], w_ref.at[recv_expert[m], :, columns], tiles)
          mosaic_tiles.store_tile(acc, out_ref.at[tile(m), columns])

  out_type = [ring.out_type((r_tiles * tm, d), xs_SD.dtype, xs_SD, *weights, axes=axes)]
  out_type += [ring.out_type((r_tiles * tm, f), xs_SD.dtype, xs_SD, *weights, axes=axes) for f in widths]
  outs = plgpu.kernel(
      body, out_type=out_type,
      scratch_types=[plgpu.SemaphoreType.REGULAR((r_tiles,))] if p > 1 else [],
      grid=(num_sms,), grid_names=("sm",),
      compiler_params=mosaic_tiles.compiler_params(),
      interpret=interpret,
  )(*(getattr(plan, name) for name in _SCALARS), xs_SD, *weights)
  return tuple(ring.varying_like(out, xs_SD, *weights, axes=axes) for out in outs)
