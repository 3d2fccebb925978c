"""Grouped GEMM + return to the owners, the twin: protocol.py on twin_machine.py, in Pallas' TPU interpreter
on CPU devices. Tile plan and legend: moe_routing.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshmoe.pallas_kernels import ring, twin_machine
from meshmoe.pallas_kernels.moe_gemm_return import protocol
from meshmoe.pallas_kernels.moe_gemm_return.mosaic_gpu import SCALARS
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes


def gemm_return(hs: Sequence[jax.Array], weights: Sequence[jax.Array], plan: TilePlan, axes: Axes, *,
                num_blocks: int, tiles: Tiles, transposed: bool = False,
                interpret=ring.INTERPRET_PARAMS) -> jax.Array:
  """ret_SD, as reference.gemm_return. hs_i: [R, F_i]; weights_i: [E_l, F_i, D], or [E_l, D, F_i]
  multiplied transposed (`transposed`)."""
  s_tiles, d = plan.send_dst.shape[0], weights[0].shape[1 if transposed else 2]
  scalars = [getattr(plan, name) for name in SCALARS]
  return twin_machine.launch(
      functools.partial(protocol.run, twin_machine.TwinMachine(axes, num_blocks, tiles), p=ring.size(axes),
                        num_inputs=len(hs), transposed=transposed),
      name="moe_gemm_return", axes=axes, operands=(*scalars, *hs, *weights),
      out_shape=ring.out_type((s_tiles * tiles.block_m, d), hs[0].dtype, *hs, *weights, axes=axes),
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * len(scalars)
      + [pl.BlockSpec(memory_space=pl.ANY)] * (2 * len(hs)),
      scratch_shapes=[twin_machine.arrival_type((s_tiles * (d // tiles.block_n),))], num_blocks=num_blocks,
      params=interpret)
