"""Grouped GEMM + return to the owners with plain collectives: the function every backend computes, and
the fallback.

Per device, inside jax.shard_map over the expert ring `axes` (P devices), with the tile plan of
moe_routing.py (legend there; D model width, F_i the width of input i):
  y tile m = sum_i hs_i tile m @ weights_i[recv_expert[m]]   (m < num_recv)
  ret_SD: this device's send buffer layout, tile s holding the y tile that came from its send tile s
          (zeros in unused tiles).
Here every device's y tiles are all-gathered and each device picks the ones addressed to it.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from meshmoe.pallas_kernels import ring
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.ring import Axes


def gemm_return(hs: Sequence[jax.Array], weights: Sequence[jax.Array], plan: TilePlan, axes: Axes) -> jax.Array:
  """ret_SD: see the module docstring. hs_i: [R, F_i]; weights_i: [E_l, F_i, D]."""
  s_tiles, r_tiles = plan.send_dst.shape[0], plan.recv_expert.shape[0]
  tm, d = hs[0].shape[0] // r_tiles, weights[0].shape[2]
  y_MTD = sum(jnp.einsum("mtf,mfd->mtd", h.reshape(r_tiles, tm, -1), w[plan.recv_expert],
                         preferred_element_type=jnp.float32) for h, w in zip(hs, weights))
  used = jnp.arange(r_tiles) < plan.num_recv[0]
  y_all = lax.all_gather(y_MTD.astype(hs[0].dtype), axes)  # [P, R_tiles, TM, D]
  src_all, src_tile_all, used_all = (lax.all_gather(a, axes) for a in (plan.recv_src, plan.recv_src_tile, used))
  mine = used_all & (src_all == ring.index(axes))
  target = jnp.where(mine, src_tile_all, s_tiles).reshape(-1)  # s_tiles: out of bounds, dropped
  ret = jnp.zeros((s_tiles, tm, d), hs[0].dtype).at[target].set(y_all.reshape(-1, tm, d), mode="drop")
  return ret.reshape(s_tiles * tm, d)
