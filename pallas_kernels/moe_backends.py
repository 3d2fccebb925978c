"""The two Comet kernels (dispatch + grouped GEMM, grouped GEMM + return) of one backend, as a pair, and
the expert weight gradients both backward passes need.

The expert weights' gradients are the grouped weight-gradient kernel's (../grouped_weight_gradient).
Each kernel is the other's backward: the input gradient of dispatch + GEMM is the products' gradients
through the transposed weights, sent home (grouped GEMM + return); the input gradient of GEMM + return is
the returned rows' gradients sent to the experts the way the tokens went and multiplied by the
transposed weights (dispatch + grouped GEMM). Both use the same tile plan. The backward kernels read the
forward's weights as stored and multiply them transposed (`transposed`): a swapaxes here would make XLA
transpose each weight's float32 stack of all layers in memory (3 x 512 MB per device on moe_1b).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from meshmoe.pallas_kernels.grouped_weight_gradient import mosaic_gpu as weight_gradient_mosaic
from meshmoe.pallas_kernels.grouped_weight_gradient import reference as weight_gradient_reference
from meshmoe.pallas_kernels.moe_dispatch_gemm import mosaic_gpu as dispatch_mosaic, tpu as dispatch_tpu
from meshmoe.pallas_kernels.moe_gemm_return import mosaic_gpu as return_mosaic, tpu as return_tpu
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.options import Options
from meshmoe.pallas_kernels.ring import Axes


def dispatch_gemm(options: Options, axes: Axes, swiglu: str | None = None, transposed: bool = False) -> Callable:
  """(xs_SD, weights, plan) -> (xr_RD, *products) on `options.backend` (with `swiglu`, a
  moe_dispatch_gemm/swiglu.py mode: weights (gate, up) and its outputs; with `transposed`, each weight
  multiplied transposed)."""
  if options.backend == "tpu_interpret":
    return functools.partial(dispatch_tpu.dispatch_gemm, axes=axes, num_blocks=options.num_blocks,
                             tiles=options.tiles, swiglu=swiglu, transposed=transposed)
  return functools.partial(dispatch_mosaic.dispatch_gemm, axes=axes, tiles=options.tiles,
                           num_blocks=options.num_blocks, swiglu=swiglu, transposed=transposed)


def swiglu_gradient(options: Options, axes: Axes) -> Callable:
  """(xr_RD, dh_RF, gate, up, plan) -> (dgate_RF, dup_RF) on `options.backend` (moe_dispatch_gemm/swiglu.py)."""
  if options.backend == "tpu_interpret":
    return functools.partial(dispatch_tpu.swiglu_gradient, axes=axes, num_blocks=options.num_blocks,
                             tiles=options.tiles)
  return functools.partial(dispatch_mosaic.swiglu_gradient, tiles=options.tiles, num_blocks=options.num_blocks)


def gemm_return(options: Options, axes: Axes, transposed: bool = False) -> Callable:
  """(hs, weights, plan) -> ret_SD on `options.backend` (with `transposed`, each weight multiplied
  transposed)."""
  if options.backend == "tpu_interpret":
    return functools.partial(return_tpu.gemm_return, axes=axes, num_blocks=options.num_blocks, tiles=options.tiles,
                             transposed=transposed)
  return functools.partial(return_mosaic.gemm_return, axes=axes, tiles=options.tiles, num_blocks=options.num_blocks,
                           transposed=transposed)


def expert_weight_gradient(options: Options, rows_RD: jax.Array, grads_RF: jax.Array, plan: TilePlan,
                           weight: jax.Array) -> jax.Array:
  """[E_l, D, F] in `weight`'s dtype: for each local expert, its receive rows transposed times their
  gradients. A receive buffer holds each expert's rows contiguously, in whole tiles (moe_routing.py)."""
  if options.backend == "mosaic_gpu":
    return weight_gradient_mosaic.weight_gradient(rows_RD, grads_RF.astype(rows_RD.dtype), plan.expert_rows,
                                                  weight, tile_rows=options.tiles.block_m, tiles=options.tiles,
                                                  num_blocks=options.num_blocks)
  return weight_gradient_reference.weight_gradient(rows_RD, grads_RF, plan.expert_rows, weight)
