"""MoE dispatch + grouped GEMM, the twin: protocol.py on twin_machine.py, in Pallas' TPU interpreter on CPU
devices. Tile plan and legend: moe_routing.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshmoe.pallas_kernels import ring, twin_machine
from meshmoe.pallas_kernels.moe_dispatch_gemm import protocol, swiglu as swiglu_epilogue
from meshmoe.pallas_kernels.moe_dispatch_gemm.mosaic_gpu import SCALARS
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes


def dispatch_gemm(xs_SD: jax.Array, weights: Sequence[jax.Array], plan: TilePlan, axes: Axes, *, num_blocks: int,
                  tiles: Tiles, swiglu: str | None = None, transposed: bool = False,
                  interpret=ring.INTERPRET_PARAMS) -> tuple[jax.Array, ...]:
  """(xr_RD, *products), as reference.dispatch_gemm (with `swiglu`, a swiglu.MODES mode, the products
  silu(gate) * up, and for "keep" gate and up, of weights (gate, up)). weights_i: [E_l, D, F_i], or
  [E_l, F_i, D] multiplied transposed (`transposed`)."""
  r_tiles, tm, d = plan.recv_expert.shape[0], tiles.block_m, xs_SD.shape[1]
  out_shape = [ring.out_type((r_tiles * tm, d), xs_SD.dtype, xs_SD, *weights, axes=axes)]
  out_shape += [ring.out_type((r_tiles * tm, w.shape[1 if transposed else 2]), xs_SD.dtype, xs_SD, *weights,
                              axes=axes)
                for w in ([weights[0]] * swiglu_epilogue.num_outputs(swiglu) if swiglu else weights)]
  scalars = [getattr(plan, name) for name in SCALARS]
  return tuple(twin_machine.launch(
      functools.partial(protocol.run, twin_machine.TwinMachine(axes, num_blocks, tiles), p=ring.size(axes),
                        num_weights=len(weights), swiglu=swiglu, transposed=transposed),
      name="moe_dispatch_gemm", axes=axes, operands=(*scalars, xs_SD, *weights), out_shape=out_shape,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * len(scalars)
      + [pl.BlockSpec(memory_space=pl.ANY)] * (1 + len(weights)),
      scratch_shapes=[twin_machine.arrival_type((r_tiles,))], num_blocks=num_blocks, params=interpret))


def swiglu_gradient(xr_RD: jax.Array, dh_RF: jax.Array, gate: jax.Array, up: jax.Array, plan: TilePlan, *,
                    axes: Axes, num_blocks: int, tiles: Tiles, interpret=ring.INTERPRET_PARAMS):
  """(dgate_RF, dup_RF), as reference.swiglu_gradient: swiglu.gradient_kernel, local to each device."""
  operands = (xr_RD, dh_RF, gate, up)
  out_shape = [ring.out_type(dh_RF.shape, xr_RD.dtype, *operands)] * 2
  return tuple(twin_machine.launch(
      functools.partial(swiglu_epilogue.gradient_kernel, twin_machine.TwinMachine(axes, num_blocks, tiles)),
      name="moe_swiglu_gradient", axes=axes, operands=(plan.recv_expert, plan.num_recv, *operands),
      out_shape=out_shape, in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * 2
      + [pl.BlockSpec(memory_space=pl.ANY)] * len(operands),
      scratch_shapes=[], num_blocks=num_blocks, params=interpret))
