"""MoE dispatch + grouped GEMM: the protocol the GPU kernel and its twin both run (PROTOCOL.md), on a machine
(gpu_machine.py or twin_machine.py). Tile plan and legend: moe_routing.py; B blocks.

1. send, one pass per peer (the device at offset 0, 1, ..., P-1): my used send tile s, run by block
   s mod B, is put into tile send_dst_tile[s] of the receiver's buffer xr, whose arrivals[that tile] counts
   its bytes. Tiles for myself are copied locally. Nothing here waits for a peer: it is the machine's
   send phase, which a warp-specialised GPU block runs on its sender warpgroup, so the puts to peers
   overlap phases 2 and 3 (the local copies are complete before them).
2. zero: receive tiles past num_recv (no peer writes them) are zeroed, tile m by block m mod B.
3. land and compute: used receive tile m is run by the block with the index of the block that sent it,
   recv_src_tile[m] mod B (the twin's DMA semaphore is on that block; on the GPU it is the block that
   awaits it). It awaits the tile's bytes (a tile from myself was copied by this very block in phase 1)
   and multiplies it by its expert's weights, one column tile after another. A tile is computed as soon as
   its own rows are there, not when the whole exchange is done. With `swiglu` (a swiglu.MODES mode), the
   weights are gate and up, and each step of tiles.gate_up_columns columns stores silu(gate) * up from the
   two products (machine.matmul_gate_up; swiglu.py), and for "keep" the products too.
   With `transposed`, the weights are stored [E_l, F_i, D] and multiplied transposed (the backward reads
   the forward's weights as they are: moe_routing.weight_columns).
"""

from __future__ import annotations

from jax.experimental import pallas as pl

from meshmoe.pallas_kernels import moe_routing, ring
from meshmoe.pallas_kernels.moe_dispatch_gemm import swiglu as swiglu_epilogue


def run(machine, send_dst, send_dst_tile, num_send, recv_expert, recv_src, recv_src_tile, num_recv, xs_ref,
        *refs, p: int, num_weights: int, swiglu: str | None = None, transposed: bool = False) -> None:
  num_outputs = swiglu_epilogue.num_outputs(swiglu) if swiglu else num_weights
  w_refs, (xr_ref, *out_refs) = refs[:num_weights], refs[num_weights:num_weights + num_outputs + 1]
  arrivals = refs[num_weights + num_outputs + 1] if p > 1 else None
  tiles = machine.tiles
  tile = lambda t: pl.ds(t * tiles.block_m, tiles.block_m)
  me = ring.index(machine.axes)

  def send_to(offset):
    dst, peer = machine.peer(offset)

    @machine.items(num_send[0])
    def _send(s):
      @pl.when(send_dst[s] == dst)
      def _():
        target = xr_ref.at[tile(send_dst_tile[s])]
        if offset == 0:
          machine.put(xs_ref.at[tile(s)], target)
        else:
          machine.put(xs_ref.at[tile(s)], target, peer, arrivals.at[send_dst_tile[s]])

  machine.send_phase(send_to, p)

  @machine.items(xr_ref.shape[0] // tiles.block_m)
  def _zero_unused(m):
    @pl.when(m >= num_recv[0])
    def _():
      for ref in (xr_ref, *out_refs):
        machine.zero(ref.at[tile(m)])

  @pl.loop(0, num_recv[0])
  def _land_and_compute(m):
    @pl.when(machine.owner(recv_src_tile[m]) == machine.block)
    def _():
      if p > 1:
        @pl.when(recv_src[m] != me)
        def _():
          machine.await_arrival(arrivals.at[m], xr_ref.at[tile(m)])

      if swiglu:  # gate and up columns together; their products make the outputs
        if transposed:
          raise ValueError("the SwiGLU epilogue multiplies weights stored [E_l, D, F] (not transposed)")
        epilogue, width = swiglu_epilogue.epilogue(swiglu), tiles.gate_up_columns

        @pl.loop(0, out_refs[0].shape[1] // width)
        def _gate_up_columns(ni):
          columns = pl.ds(ni * width, width)
          products = machine.matmul_gate_up(xr_ref.at[tile(m)], *(w_ref.at[recv_expert[m], :, columns]
                                                                  for w_ref in w_refs))
          for value, out_ref in zip(epilogue(*products), out_refs):
            machine.store(value, out_ref.at[tile(m), columns])
        return

      for w_ref, out_ref in zip(w_refs, out_refs):
        @pl.loop(0, out_ref.shape[1] // tiles.block_n)
        def _column(ni):
          columns = pl.ds(ni * tiles.block_n, tiles.block_n)
          product = machine.matmul(xr_ref.at[tile(m)], moe_routing.weight_columns(w_ref, recv_expert[m], columns,
                                                                                transposed), transpose_b=transposed)
          machine.store(product, out_ref.at[tile(m), columns])
