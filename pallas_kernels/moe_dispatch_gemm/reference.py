"""MoE dispatch + grouped GEMM with plain collectives: the function every backend computes, and the fallback.

Per device, inside jax.shard_map over the expert ring `axes` (P devices), with the tile plan of
moe_routing.py (legend there; D model width, F_i the width of weight i):
  xr_RD: the receive buffer: receive tile m holds tile recv_src_tile[m] of device recv_src[m]'s send
         buffer for m < num_recv, zeros after;
  products_i [R, F_i] = xr_RD @ weights_i[recv_expert of the row's tile], zeros in unused tiles; with
         `swiglu`, weights (gate, up) and the one product silu(gate) * up.
Here the send buffers are all-gathered and each device picks its tiles from them.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from meshmoe.pallas_kernels.moe_dispatch_gemm import swiglu as swiglu_epilogue
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.ring import Axes


def dispatch_gemm(xs_SD: jax.Array, weights: Sequence[jax.Array], plan: TilePlan,
                  axes: Axes, swiglu: bool = False) -> tuple[jax.Array, ...]:
  """(xr_RD, *products): see the module docstring. weights_i: [E_l, D, F_i]."""
  s_tiles, r_tiles = plan.send_dst.shape[0], plan.recv_expert.shape[0]
  tm, d = xs_SD.shape[0] // s_tiles, xs_SD.shape[1]
  xs_all = lax.all_gather(xs_SD.reshape(s_tiles, tm, d), axes)  # [P, S_tiles, TM, D]
  used_M = (jnp.arange(r_tiles) < plan.num_recv[0])[:, None, None]
  xr_MTD = jnp.where(used_M, xs_all[plan.recv_src, plan.recv_src_tile], 0)
  products = [jnp.einsum("mtd,mdf->mtf", xr_MTD, w[plan.recv_expert],
                         preferred_element_type=jnp.float32).astype(xs_SD.dtype) for w in weights]
  if swiglu:  # from the rounded products, recomputed in the backward (autodiff keeps gate and up only)
    hidden = jax.checkpoint(lambda g, u: swiglu_epilogue.hidden(g.astype(jnp.float32), u.astype(jnp.float32)))
    products = [hidden(*products).astype(xs_SD.dtype)]
  return (xr_MTD.reshape(r_tiles * tm, d), *(p.reshape(r_tiles * tm, -1) for p in products))


def swiglu_gradient(xr_RD: jax.Array, dh_RF: jax.Array, gate: jax.Array, up: jax.Array,
                    plan: TilePlan) -> tuple[jax.Array, jax.Array]:
  """(dgate_RF, dup_RF): the gate and up products of the received rows recomputed, then SwiGLU's
  gradients for the hidden units' gradient dh_RF; zeros in unused tiles. Local to a device."""
  r_tiles = plan.recv_expert.shape[0]
  xr_MTD = xr_RD.reshape(r_tiles, -1, xr_RD.shape[1])
  gate_MTF, up_MTF = (jnp.einsum("mtd,mdf->mtf", xr_MTD, w[plan.recv_expert], preferred_element_type=jnp.float32)
                      for w in (gate, up))
  dh_MTF = dh_RF.reshape(gate_MTF.shape).astype(jnp.float32)
  used_M = (jnp.arange(r_tiles) < plan.num_recv[0])[:, None, None]
  return tuple(jnp.where(used_M, g, 0).reshape(dh_RF.shape).astype(xr_RD.dtype)
               for g in swiglu_epilogue.gradients(gate_MTF, up_MTF, dh_MTF))
