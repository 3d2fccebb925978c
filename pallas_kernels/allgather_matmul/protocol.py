"""all-gather + GEMM: the protocol the GPU kernel and its twin both run (PROTOCOL.md), on a machine
(gpu_machine.py or twin_machine.py).

P steps. In step s a device computes block (me - s) mod P: items (mi, ni), row tile mi and column tile ni
of out[block], flat index mi * N_t + ni, each run by block item mod B. Item (mi, 0) also forwards row tile
mi of the block (its A tiles, as the GEMM streams them) into the right neighbour's gathered[block] and
counts its bytes on the neighbour's arrivals[s, mi]; in step 0 it also copies my own block into
gathered[me]. In step s > 0, item (mi, 0) lands row tile mi (it awaits arrivals[s - 1, mi], which the left
neighbour's block of the same index filled) and notifies the blocks of items (mi, 1..N_t-1), which await
that notice before reading the row tile.

Legend: P ring positions, M rows per device, K contraction, N output columns; M_t, N_t tiles; B blocks.
"""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl

from meshmoe.pallas_kernels import ring


def run(machine, x_ref, w_ref, out_ref, gathered_ref, arrivals=None, notices=None, *, p: int) -> None:
  tiles = machine.tiles
  m_tiles, n_tiles = x_ref.shape[0] // tiles.block_m, w_ref.shape[1] // tiles.block_n
  me = ring.index(machine.axes)
  right = machine.peer(1)[1] if p > 1 else None
  for step in range(p):
    block = lax.rem(me - step + p, p)
    source = x_ref if step == 0 else gathered_ref.at[block]

    @machine.items(m_tiles * n_tiles)
    def _item(i):
      mi, ni = i // n_tiles, lax.rem(i, n_tiles)
      rows = pl.ds(mi * tiles.block_m, tiles.block_m)
      columns = pl.ds(ni * tiles.block_n, tiles.block_n)
      if step > 0:
        @pl.when(ni == 0)
        def _land():
          machine.await_arrival(arrivals.at[step - 1, mi], gathered_ref.at[block, rows])

          @pl.loop(1, n_tiles)
          def _tell(nj):
            machine.notify(notices, (step - 1, mi), machine.owner(mi * n_tiles + nj))

        @pl.when(ni > 0)
        def _wait():
          machine.await_notice(notices, (step - 1, mi))

      copies = []
      if step == 0:  # my own block joins the gathered blocks (for the backward pass)
        copies.append((gathered_ref.at[me, rows], None, None))
      if step < p - 1:
        copies.append((gathered_ref.at[block, rows], right, arrivals.at[step, mi]))
      acc = machine.matmul(source.at[rows], w_ref.at[:, columns], copies=tuple(copies), copy_when=ni == 0)
      machine.store(acc, out_ref.at[block, rows, columns])
