"""Grouped GEMM + return: the protocol the GPU kernel and its twin both run (PROTOCOL.md), on a machine
(gpu_machine.py or twin_machine.py). Tile plan and legend: moe_routing.py; D_t column tiles of the output,
B blocks.

1. compute and return, one pass per owner (the device at offset 0, 1, ..., P-1): items (m, ni) of the
   used receive tiles from that owner, flat index m * D_t + ni, each run by block item mod B: the sum of
   the tile's GEMMs against its expert's weights, put straight into tile recv_src_tile[m], column tile ni,
   of the owner's `ret`, whose arrivals[that tile * D_t + ni] counts its bytes. Tiles go home as soon as
   they are computed; nothing here waits for a peer. With `transposed`, the weights are stored [E_l, D, F_i]
   and multiplied transposed (moe_routing.weight_columns).
2. land: my used send tile s went to tile m = send_dst_tile[s] of device send_dst[s]; its column tile ni
   comes back from that device's item m * D_t + ni, so the block with that item's index, which holds the
   twin's DMA semaphore, awaits its bytes (a tile I computed for myself was stored by this very block in
   phase 1). Send tiles I never used are zeroed.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl

from meshmoe.pallas_kernels import moe_routing, ring


def run(machine, recv_expert, recv_src, recv_src_tile, num_recv, send_dst, send_dst_tile, num_send, *refs,
        p: int, num_inputs: int, transposed: bool = False) -> None:
  h_refs, w_refs, ret_ref = refs[:num_inputs], refs[num_inputs:2 * num_inputs], refs[2 * num_inputs]
  arrivals = refs[2 * num_inputs + 1] if p > 1 else None
  tiles = machine.tiles
  tile = lambda t: pl.ds(t * tiles.block_m, tiles.block_m)
  n_tiles = ret_ref.shape[1] // tiles.block_n
  me = ring.index(machine.axes)

  for offset in range(p):
    owner, peer = machine.peer(offset)

    @machine.items(num_recv[0] * n_tiles)
    def _compute_and_return(i):
      m, ni = i // n_tiles, lax.rem(i, n_tiles)

      @pl.when(recv_src[m] == owner)
      def _():
        columns = pl.ds(ni * tiles.block_n, tiles.block_n)
        acc = machine.matmul_sum([(h_ref.at[tile(m)], moe_routing.weight_columns(w_ref, recv_expert[m], columns,
                                                                                  transposed))
                                  for h_ref, w_ref in zip(h_refs, w_refs)], transpose_b=transposed)
        target = ret_ref.at[tile(recv_src_tile[m]), columns]
        if offset == 0:
          machine.put_value(acc, target)
        else:
          machine.put_value(acc, target, peer, arrivals.at[recv_src_tile[m] * n_tiles + ni])

  @pl.loop(0, ret_ref.shape[0] // tiles.block_m * n_tiles)
  def _land_or_zero(j):
    s, ni = j // n_tiles, lax.rem(j, n_tiles)
    columns = pl.ds(ni * tiles.block_n, tiles.block_n)
    used = s < num_send[0]
    if p > 1:
      @pl.when(used & (send_dst[s] != me)
               & (machine.owner(send_dst_tile[s] * n_tiles + ni) == machine.block))
      def _():
        machine.await_arrival(arrivals.at[j], ret_ref.at[tile(s), columns])

    @pl.when(~used & (machine.owner(j) == machine.block))
    def _():
      machine.zero(ret_ref.at[tile(s), columns])
