"""all-gather + GEMM, the twin: protocol.py on twin_machine.py, in Pallas' TPU interpreter on CPU devices.

Legend: P ring positions, M rows per device, K contraction, N output columns.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from meshmoe.pallas_kernels import ring, twin_machine
from meshmoe.pallas_kernels.allgather_matmul import protocol
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes


def allgather_matmul(x_MK: jax.Array, w_KN: jax.Array, axes: Axes, *, num_blocks: int, tiles: Tiles,
                     interpret=ring.INTERPRET_PARAMS) -> tuple[jax.Array, jax.Array]:
  """(out_PMN, x_PMK): every device's block times w_KN, and the gathered blocks (for the backward)."""
  p = ring.size(axes)
  (m, k), n = x_MK.shape, w_KN.shape[1]
  machine = twin_machine.TwinMachine(axes, num_blocks, tiles)
  steps, m_tiles = max(p - 1, 1), m // tiles.block_m  # semaphore arrays cannot be empty
  return twin_machine.launch(
      functools.partial(protocol.run, machine, p=p), name="allgather_matmul", axes=axes,
      operands=(x_MK, w_KN),
      out_shape=(ring.out_type((p, m, n), x_MK.dtype, x_MK, w_KN, axes=axes),
                 ring.out_type((p, m, k), x_MK.dtype, x_MK, w_KN, axes=axes)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
      scratch_shapes=[twin_machine.arrival_type((steps, m_tiles)),
                      twin_machine.notice_type(num_blocks, (steps, m_tiles))],
      num_blocks=num_blocks, params=interpret)
