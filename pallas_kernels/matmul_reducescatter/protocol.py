"""GEMM + reduce-scatter: the protocol the GPU kernel and its twin both run (PROTOCOL.md), on a machine
(gpu_machine.py or twin_machine.py).

P steps. In step s a device computes the partial sums for destination (me - s - 1) mod P: items (mi, ni),
tile (mi, ni) of y[destination] @ w, flat index mi * N_t + ni, each run by block item mod B. From step 1
on, the item awaits arrivals[s - 1, item] (the left neighbour's block of the same index put the matching
partial tile into received[s - 1]) and adds that tile; then it puts the sum into the right neighbour's
received[s] and counts its bytes on the neighbour's arrivals[s, item], or, in the last step, when the
destination is this device, stores it in out. A tile's GEMM never waits; only its add does.

Legend: P ring positions, M rows per device, K this device's share of the contraction, N output columns.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from meshmoe.pallas_kernels import ring


def run(machine, y_ref, w_ref, out_ref, received_ref, arrivals=None, *, p: int) -> None:
  tiles = machine.tiles
  m_tiles, n_tiles = y_ref.shape[1] // tiles.block_m, w_ref.shape[1] // tiles.block_n
  me = ring.index(machine.axes)
  right = machine.peer(1)[1] if p > 1 else None
  for step in range(p):
    destination = lax.rem(me - step - 1 + 2 * p, p)

    @machine.items(m_tiles * n_tiles)
    def _item(i):
      mi, ni = i // n_tiles, lax.rem(i, n_tiles)
      rows = pl.ds(mi * tiles.block_m, tiles.block_m)
      columns = pl.ds(ni * tiles.block_n, tiles.block_n)
      acc = machine.matmul(y_ref.at[destination, rows], w_ref.at[:, columns])
      if step > 0:
        partial = received_ref.at[step - 1, rows, columns]
        machine.await_arrival(arrivals.at[step - 1, i], partial)
        acc = acc + machine.load(partial).astype(jnp.float32)
      if step == p - 1:
        machine.store(acc, out_ref.at[rows, columns])
      else:
        machine.put_value(acc, received_ref.at[step, rows, columns], right, arrivals.at[step, i])
