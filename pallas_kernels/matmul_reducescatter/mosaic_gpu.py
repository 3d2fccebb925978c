"""GEMM + reduce-scatter as one Mosaic GPU kernel (Hopper): protocol.py on gpu_machine.py.

Legend: P ring positions, M rows per device, K this device's share of the contraction, N output columns.
"""

from __future__ import annotations

import functools

import jax

from meshmoe.pallas_kernels import gpu_kernel, gpu_machine, mosaic_tiles, ring
from meshmoe.pallas_kernels.matmul_reducescatter import protocol
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes


def unsupported(m: int, k: int, n: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why this kernel cannot take these shapes (None when it can)."""
  return mosaic_tiles.unsupported(dtype, {"M": (m, tiles.block_m), "N": (n, tiles.block_n),
                                          "K": (k, tiles.block_k)}, tiles)


def matmul_reducescatter(y_PMK: jax.Array, w_KN: jax.Array, axes: Axes, *, num_blocks: int,
                         tiles: Tiles = mosaic_tiles.DEFAULT_TILES, interpret=None) -> jax.Array:
  """out_MN, as reference.matmul_reducescatter. `interpret`: see allgather_matmul.mosaic_gpu."""
  p = ring.size(axes)
  (_, m, k), n = y_PMK.shape, w_KN.shape[1]
  if y_PMK.shape[0] != p:
    raise ValueError(f"y_PMK has {y_PMK.shape[0]} blocks for a ring of {p} devices")
  reason = unsupported(m, k, n, y_PMK.dtype, tiles)
  if reason:
    raise ValueError(f"GEMM reduce-scatter kernel: {reason}")
  machine = gpu_machine.GpuMachine(axes, num_blocks, tiles)
  steps, items = max(p - 1, 1), (m // tiles.block_m) * (n // tiles.block_n)
  out_MN, _ = gpu_kernel.launch(
      functools.partial(protocol.run, p=p), machine,
      out_type=(ring.out_type((m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes),
                # Per step, the partial sums my left neighbour puts here; each slot is written once.
                ring.out_type((steps, m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes)),
      scratch_types=[gpu_machine.arrival_type((steps, items))] if p > 1 else [],
      interpret=interpret,
  )(y_PMK, w_KN)
  return ring.varying_like(out_MN, y_PMK, w_KN, axes=axes)
