"""MoE dispatch + grouped GEMM: the public function, which picks the implementation.

  products = dispatch_gemm(rows_AD, weights, plan, axes, tile_rows=TM, backend=...)   # inside shard_map

Each assignment's row (rows_AD, in assignment order) goes to the device holding its expert, into that
device's receive buffer laid out by the tile plan (moe_routing.py), where it is multiplied by each of
`weights` ([E_l, D, F_i], the local experts): products_i [R, F_i], zeros in unused tiles
(reference.py). Backends: "collectives" (all_gather and pick, plain autodiff), "tpu_interpret" (the
twin: protocol.py in Pallas' TPU interpreter) and "mosaic_gpu" (the Hopper kernel; `unsupported` says which
shapes it takes). The fused backends share one custom gradient (moe_backends.py): the rows' gradient is
the GEMM + return kernel of the products' gradients with the transposed weights, and the weights'
gradients are per-expert products of the received rows (saved by the forward kernel) and the products'
gradients. `meshmoe.sharding.expert_parallel` calls this for `parallel.impl="pallas"`.

  hidden_RF = dispatch_swiglu(rows_AD, gate, up, plan, axes, tile_rows=TM, backend=...)

is the same with SwiGLU fused into the kernel (swiglu.py): one [R, F] output silu(gate) * up instead of
the two products, and a backward that recomputes gate and up per tile (`gradient="recompute"`) or reads
them, kept by the forward kernel (`"keep"`).

Legend: A assignments, D model width, F_i weight widths, R receive rows (moe_routing.py).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from meshmoe.pallas_kernels import moe_backends, moe_routing, mosaic_tiles, ring
from meshmoe.pallas_kernels.grouped_weight_gradient import api as weight_gradient
from meshmoe.pallas_kernels.moe_dispatch_gemm import mosaic_gpu, reference, swiglu as swiglu_epilogue
from meshmoe.pallas_kernels.moe_gemm_return import mosaic_gpu as return_mosaic
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.options import Options


def dispatch_gemm(rows_AD: jax.Array, weights: Sequence[jax.Array], plan: TilePlan, axes, *, tile_rows: int,
                  backend: str, tiles: Tiles = mosaic_tiles.DEFAULT_TILES,
                  num_sms: int | None = None) -> tuple[jax.Array, ...]:
  ring.check_backend(backend)
  axes = ring.normalize_axes(axes)
  xs_SD = moe_routing.send_buffer(rows_AD, plan, tile_rows, plan.send_dst.shape[0])
  if backend == "collectives":
    return reference.dispatch_gemm(xs_SD, tuple(weights), plan, axes)[1:]
  _check_tile_rows(tile_rows, tiles)
  return _fused(Options.of(backend, tiles, num_sms), axes, None, xs_SD, tuple(weights), plan)


def dispatch_swiglu(rows_AD: jax.Array, gate: jax.Array, up: jax.Array, plan: TilePlan, axes, *, tile_rows: int,
                    backend: str, tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_sms: int | None = None,
                    gradient: str = "recompute") -> jax.Array:
  """hidden_RF = silu(xr_RD @ gate) * (xr_RD @ up) per receive tile's expert: dispatch_gemm's products
  through SwiGLU, computed in float32 and rounded once; `gradient`: swiglu.MODES."""
  ring.check_backend(backend)
  swiglu_epilogue.epilogue(gradient)  # checks the mode
  axes = ring.normalize_axes(axes)
  xs_SD = moe_routing.send_buffer(rows_AD, plan, tile_rows, plan.send_dst.shape[0])
  if backend == "collectives":
    return reference.dispatch_gemm(xs_SD, (gate, up), plan, axes, swiglu=True)[1]
  _check_tile_rows(tile_rows, tiles)
  return _fused(Options.of(backend, tiles, num_sms), axes, gradient, xs_SD, (gate, up), plan)[0]


def _check_tile_rows(tile_rows: int, tiles: Tiles) -> None:
  if tile_rows != tiles.block_m:
    raise ValueError(f"the plan's tile_rows={tile_rows} must be the kernel's block_m={tiles.block_m}")


def unsupported(d: int, widths: Sequence[int], dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why the Mosaic GPU kernels cannot take these widths, forward or backward (None when they can)."""
  return (mosaic_gpu.unsupported(d, widths, dtype, tiles) or return_mosaic.unsupported(widths, d, dtype, tiles)
          or next(filter(None, (weight_gradient.unsupported(d, f, dtype, tiles) for f in widths)), None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused(options: Options, axes, swiglu: str | None, xs_SD, weights, plan):
  """The products (with `swiglu`, a swiglu.MODES mode: the hidden units only)."""
  return _forward(options, axes, swiglu, xs_SD, weights, plan)[0]


def _forward(options, axes, swiglu, xs_SD, weights, plan):
  xr_RD, *products = moe_backends.dispatch_gemm(options, axes, swiglu)(xs_SD, weights, plan)
  kept = tuple(products[1:]) if swiglu == "keep" else ()  # gate and up, for the gradient
  return tuple(products[:1] if swiglu else products), (xr_RD, weights, plan, kept)


def _backward(options, axes, swiglu, residuals, dproducts):
  xr_RD, weights, plan, kept = residuals
  dproducts = tuple(d.astype(xr_RD.dtype) for d in dproducts)
  # With SwiGLU, the products' gradients are gate's and up's, from the hidden units' gradient.
  if swiglu == "keep":
    f32 = lambda a: a.astype(jnp.float32)
    dproducts = tuple(g.astype(xr_RD.dtype) for g in swiglu_epilogue.gradients(*map(f32, (*kept, dproducts[0]))))
  elif swiglu == "recompute":
    dproducts = moe_backends.swiglu_gradient(options, axes)(xr_RD, dproducts[0], *weights, plan)
  dxs_SD = moe_backends.gemm_return(options, axes, transposed=True)(dproducts, weights, plan)
  dweights = tuple(moe_backends.expert_weight_gradient(options, xr_RD, d, plan, w) for d, w in zip(dproducts, weights))
  return dxs_SD, dweights, None


_fused.defvjp(_forward, _backward)
