"""GEMM + reduce-scatter as one Mosaic GPU kernel (Hopper), the protocol of PROTOCOL.md.

A persistent kernel of `num_sms` blocks runs P steps. In step s every block computes its share of the
partial-sum tiles for destination (me - s - 1) mod P; from step 1 on it adds the matching tile of the
partial sum its left neighbour sent in step s - 1 (waiting, before its first add of the step, until that
neighbour's blocks have all signalled), then writes the tile into the right neighbour's `received[s]`
slot, or into `out` in the last step, when the destination is this device. After each step but the last
every block signals the right neighbour once. A tile's matmul never waits for the network; only its add
does, so a step's GEMMs overlap the transfer of the step before.

Legend: P ring positions, M rows per device, K this device's share of the contraction, N output columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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


def matmul_reducescatter(y_PMK: jax.Array, w_KN: jax.Array, axes: Axes, *,
                         tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_sms: int = mosaic_tiles.H100_SMS,
                         interpret=None) -> jax.Array:
  """out_MN, as tpu.matmul_reducescatter. `interpret`: see allgather_matmul.mosaic_gpu."""
  p = ring.size(axes)
  (_, m, k), n = y_PMK.shape, w_KN.shape[1]
  if y_PMK.shape[0] != p:
    raise ValueError(f"y_PMK has {y_PMK.shape[0]} blocks for a ring of {p} devices")
  reason = unsupported(m, k, n, y_PMK.dtype, tiles)
  if reason:
    raise ValueError(f"GEMM reduce-scatter kernel: {reason}")
  m_tiles, n_tiles = m // tiles.block_m, n // tiles.block_n
  steps = max(p - 1, 1)

  def body(y_ref, w_ref, out_ref, received_ref, *semaphores):
    me = ring.index(axes)
    right = ring.device(axes, ring.shift(axes, 1))
    for step in range(p):
      destination = lax.rem(me - step - 1 + 2 * p, p)

      @plgpu.nd_loop((m_tiles * n_tiles,), collective_axes="sm")
      def _partial_tile(info):
        mi, ni = info.index[0] // n_tiles, lax.rem(info.index[0], n_tiles)
        tile = (pl.ds(mi * tiles.block_m, tiles.block_m), pl.ds(ni * tiles.block_n, tiles.block_n))
        acc = mosaic_tiles.matmul_tile(y_ref.at[destination, tile[0]], w_ref.at[:, tile[1]], tiles)
        if step > 0:
          (received,) = semaphores
          pl.semaphore_wait(received, step * num_sms, decrement=False)
          acc = acc + mosaic_tiles.load_tile(received_ref.at[step - 1, *tile]).astype(jnp.float32)
        if step == p - 1:
          mosaic_tiles.store_tile(acc, out_ref.at[tile])
        else:
          mosaic_tiles.store_tile(acc, plgpu.remote_ref(received_ref, right).at[step, *tile])

      if step < p - 1:
        (received,) = semaphores
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        pl.semaphore_signal(received, 1, device_id=right)
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)

  out_MN, _ = plgpu.kernel(
      body,
      out_type=(ring.out_type((m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes),
                # Per step, the partial sum my left neighbour sends me; each slot is written once.
                ring.out_type((steps, m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes)),
      scratch_types=[plgpu.SemaphoreType.REGULAR] if p > 1 else [],
      grid=(num_sms,), grid_names=("sm",),
      compiler_params=mosaic_tiles.compiler_params(),
      interpret=interpret,
  )(y_PMK, w_KN)
  return ring.varying_like(out_MN, y_PMK, w_KN, axes=axes)
