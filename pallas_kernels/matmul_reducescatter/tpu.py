"""GEMM + reduce-scatter, the twin: protocol.py on twin_machine.py, in Pallas' TPU interpreter on CPU devices.

Legend: P ring positions, M rows per device, K this device's share of the contraction, N output columns.
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from meshmoe.pallas_kernels import ring, twin_machine
from meshmoe.pallas_kernels.matmul_reducescatter import protocol
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes


def matmul_reducescatter(y_PMK: jax.Array, w_KN: jax.Array, axes: Axes, *, num_blocks: int, tiles: Tiles,
                         interpret=ring.INTERPRET_PARAMS) -> jax.Array:
  """out_MN: the sum over the ring of every device's y_PMK[me] @ w_KN, in y's dtype."""
  p = ring.size(axes)
  (_, m, _), n = y_PMK.shape, w_KN.shape[1]
  if y_PMK.shape[0] != p:
    raise ValueError(f"y_PMK has {y_PMK.shape[0]} blocks for a ring of {p} devices")
  machine = twin_machine.TwinMachine(axes, num_blocks, tiles)
  steps, items = max(p - 1, 1), (m // tiles.block_m) * (n // tiles.block_n)
  out_MN, _ = twin_machine.launch(
      functools.partial(protocol.run, machine, p=p), name="matmul_reducescatter", axes=axes,
      operands=(y_PMK, w_KN),
      out_shape=(ring.out_type((m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes),
                 ring.out_type((steps, m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
      scratch_shapes=[twin_machine.arrival_type((steps, items))],
      num_blocks=num_blocks, params=interpret)
  return out_MN
