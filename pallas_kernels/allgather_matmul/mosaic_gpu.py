"""all-gather + GEMM as one Mosaic GPU kernel (Hopper): protocol.py on gpu_machine.py.

Legend: P ring positions, M rows per device, K contraction, N output columns.
"""

from __future__ import annotations

import functools

import jax

from meshmoe.pallas_kernels import gpu_kernel, gpu_machine, mosaic_tiles, ring
from meshmoe.pallas_kernels.allgather_matmul import protocol
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes


def unsupported(m: int, k: int, n: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why this kernel cannot take these shapes (None when it can)."""
  return mosaic_tiles.unsupported(dtype, {"M": (m, tiles.block_m), "N": (n, tiles.block_n),
                                          "K": (k, tiles.block_k)}, tiles)


def allgather_matmul(x_MK: jax.Array, w_KN: jax.Array, axes: Axes, *, num_blocks: int,
                     tiles: Tiles = mosaic_tiles.DEFAULT_TILES, interpret=None) -> tuple[jax.Array, jax.Array]:
  """(out_PMN, x_PMK), as reference.allgather_matmul plus the gathered blocks. `interpret` runs it in the
  Mosaic GPU interpreter, which has no semaphores: there, only a ring of one device (the compute path)."""
  p = ring.size(axes)
  (m, k), n = x_MK.shape, w_KN.shape[1]
  reason = unsupported(m, k, n, x_MK.dtype, tiles)
  if reason:
    raise ValueError(f"all-gather GEMM kernel: {reason}")
  machine = gpu_machine.GpuMachine(axes, num_blocks, tiles)
  steps, m_tiles = max(p - 1, 1), m // tiles.block_m
  scratch = [gpu_machine.arrival_type((steps, m_tiles)), gpu_machine.notice_type(num_blocks, (steps, m_tiles))]
  outs = gpu_kernel.launch(
      functools.partial(protocol.run, p=p), machine,
      out_type=(ring.out_type((p, m, n), x_MK.dtype, x_MK, w_KN, axes=axes),
                ring.out_type((p, m, k), x_MK.dtype, x_MK, w_KN, axes=axes)),
      scratch_types=scratch if p > 1 else [], interpret=interpret,
  )(x_MK, w_KN)
  return tuple(ring.varying_like(out, x_MK, w_KN, axes=axes) for out in outs)
