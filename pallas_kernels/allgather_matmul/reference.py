"""all-gather + GEMM with plain collectives: the function every backend computes, and the fallback.

Per device, inside jax.shard_map over the ring `axes` of P devices (legend: P ring positions, M rows per
device, K contraction, N output columns):
  out_PMN[j] = x_MK of device j @ w_KN, for every j, accumulated in float32, in x's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshmoe.pallas_kernels.ring import Axes


def allgather_matmul(x_MK: jax.Array, w_KN: jax.Array, axes: Axes) -> jax.Array:
  x_PMK = lax.all_gather(x_MK, axes, axis=0)
  return jnp.einsum("pmk,kn->pmn", x_PMK, w_KN, preferred_element_type=jnp.float32).astype(x_MK.dtype)
