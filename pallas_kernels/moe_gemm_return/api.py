"""Grouped GEMM + return: the public function, which picks the implementation.

  y_AD = gemm_return(hs, weights, plan, axes, backend=...)   # inside shard_map over the expert ring
  then meshmoe.sharding.dispatch.combine(y_AD, ...)         # the owner's weighted top-k sum, float32

Each received tile's expert output (sum_i hs_i @ weights_i[its expert], weights_i [E_l, F_i, D]) goes
straight back to the device whose assignment it is, into the tile of that device's send layout it came
from (reference.py); this returns each assignment's row (zeros for dropped ones). The combine, each
token's k rows weighted and summed, runs on the owner once its rows are home: a token's k rows come from
up to k devices, so only the owner can sum them. Backends as in moe_dispatch_gemm/api.py; the fused ones
share one custom gradient (moe_backends.py): the rows' gradients go to the experts the way the tokens
did and through the transposed weights (the dispatch + GEMM kernel, which also returns the dispatched
gradients for the weights' gradient). `meshmoe.sharding.expert_parallel` calls this for
`parallel.impl="pallas"`.

Legend: A assignments, D model width, F_i input widths, R receive rows, S send rows (moe_routing.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax

from meshmoe.pallas_kernels import moe_backends, moe_routing, mosaic_tiles, ring
from meshmoe.pallas_kernels.grouped_weight_gradient import api as weight_gradient
from meshmoe.pallas_kernels.moe_dispatch_gemm import mosaic_gpu as dispatch_mosaic
from meshmoe.pallas_kernels.moe_gemm_return import mosaic_gpu, reference
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.options import Options


def gemm_return(hs: Sequence[jax.Array], weights: Sequence[jax.Array], plan: TilePlan, axes, *, backend: str,
                tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_sms: int | None = None) -> jax.Array:
  """y_AD: each assignment's expert output, back on its owner."""
  ring.check_backend(backend)
  axes = ring.normalize_axes(axes)
  if backend == "collectives":
    ret_SD = reference.gemm_return(tuple(hs), tuple(weights), plan, axes)
  else:
    ret_SD = _fused(Options.of(backend, tiles, num_sms), axes, tuple(hs), tuple(weights), plan)
  return moe_routing.returned_rows(ret_SD, plan)


def unsupported(widths: Sequence[int], d: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why the Mosaic GPU kernels cannot take these widths, forward or backward (None when they can)."""
  return (mosaic_gpu.unsupported(widths, d, dtype, tiles) or dispatch_mosaic.unsupported(d, widths, dtype, tiles)
          or next(filter(None, (weight_gradient.unsupported(f, d, dtype, tiles) for f in widths)), None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(options: Options, axes, hs, weights, plan):
  return _forward(options, axes, hs, weights, plan)[0]


def _forward(options, axes, hs, weights, plan):
  return moe_backends.gemm_return(options, axes)(hs, weights, plan), (hs, weights, plan)


def _backward(options, axes, residuals, dret_SD):
  hs, weights, plan = residuals
  dy_RD, *dhs = moe_backends.dispatch_gemm(options, axes, transposed=True)(dret_SD.astype(hs[0].dtype), weights,
                                                                           plan)
  dweights = tuple(moe_backends.expert_weight_gradient(options, h, dy_RD, plan, w) for h, w in zip(hs, weights))
  return tuple(dhs), dweights, None


_fused.defvjp(_forward, _backward)
