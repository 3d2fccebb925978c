"""all-gather + GEMM as one Mosaic GPU kernel (Hopper), the protocol of PROTOCOL.md.

A persistent kernel of `num_sms` blocks runs P steps. In step s every block computes its share of the
output tiles of row block (me - s) mod P; the A tiles it loads for the first column tile of each row tile
are also written (TMA, from shared memory) into the right neighbour's `gathered` buffer, so the block
travels as a by-product of the matmul that uses it. Then every block signals the right neighbour's
semaphore once and waits until its own semaphore counts (s + 1) x num_sms signals: the left neighbour has
delivered the next block.

Legend: P ring positions, M rows per device, K contraction, N output columns.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.pallas_kernels import mosaic_tiles, ring
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes


def unsupported(m: int, k: int, n: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why this kernel cannot take these shapes (None when it can)."""
  return mosaic_tiles.unsupported(dtype, {"M": (m, tiles.block_m), "N": (n, tiles.block_n),
                                          "K": (k, tiles.block_k)}, tiles)


def allgather_matmul(x_MK: jax.Array, w_KN: jax.Array, axes: Axes, *, tiles: Tiles = mosaic_tiles.DEFAULT_TILES,
                     num_sms: int = mosaic_tiles.H100_SMS, interpret=None) -> tuple[jax.Array, jax.Array]:
  """(out_PMN, x_PMK), as tpu.allgather_matmul. `interpret` runs it in the Mosaic GPU interpreter, which
  has no semaphores: there, only a ring of one device (the compute path)."""
  p = ring.size(axes)
  (m, k), n = x_MK.shape, w_KN.shape[1]
  reason = unsupported(m, k, n, x_MK.dtype, tiles)
  if reason:
    raise ValueError(f"all-gather GEMM kernel: {reason}")
  m_tiles, n_tiles = m // tiles.block_m, n // tiles.block_n

  def body(x_ref, w_ref, out_ref, gathered_ref, *semaphores):
    me = ring.index(axes)
    right = ring.device(axes, ring.shift(axes, 1))
    for step in range(p):
      block = lax.rem(me - step + p, p)
      source = x_ref if step == 0 else gathered_ref.at[block]

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _output_tile(info):
        mi, ni = info.index[0] // n_tiles, lax.rem(info.index[0], n_tiles)
        rows = pl.ds(mi * tiles.block_m, tiles.block_m)

        def forward(ki, a_smem):  # each A tile is loaded once per row tile for column tile 0
          columns = pl.ds(ki * tiles.block_k, tiles.block_k)
          if step == 0:  # my own block joins the gathered blocks (for the backward pass)
            pl.when(ni == 0)(lambda: plgpu.copy_smem_to_gmem(a_smem, gathered_ref.at[me, rows, columns]))
          if step < p - 1:
            pl.when(ni == 0)(lambda: plgpu.copy_smem_to_gmem(
                a_smem, plgpu.remote_ref(gathered_ref, right).at[block, rows, columns]))

        acc = mosaic_tiles.matmul_tile(source.at[rows], w_ref.at[:, pl.ds(ni * tiles.block_n, tiles.block_n)],
                                       tiles, on_a_tile=forward)
        mosaic_tiles.store_tile(acc, out_ref.at[block, rows, pl.ds(ni * tiles.block_n, tiles.block_n)])

      if step < p - 1:
        (received,) = semaphores
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # my part of the block is in my neighbour's memory
        pl.semaphore_signal(received, 1, device_id=right)
        pl.semaphore_wait(received, (step + 1) * num_sms, decrement=False)  # the next block is here
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  out_PMN, x_PMK = plgpu.kernel(
      body,
      out_type=(ring.out_type((p, m, n), x_MK.dtype, x_MK, w_KN, axes=axes),
                ring.out_type((p, m, k), x_MK.dtype, x_MK, w_KN, axes=axes)),
      # The interpreter cannot allocate semaphores; a ring of one never signals.
      scratch_types=[plgpu.SemaphoreType.REGULAR] if p > 1 else [],
      grid=(num_sms,), grid_names=("sm",),
      compiler_params=mosaic_tiles.compiler_params(),
      interpret=interpret,
  )(x_MK, w_KN)
  return tuple(ring.varying_like(out, x_MK, w_KN, axes=axes) for out in (out_PMN, x_PMK))
