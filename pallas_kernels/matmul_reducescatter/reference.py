"""GEMM + reduce-scatter with plain collectives: the function every backend computes, and the fallback.

Per device, inside jax.shard_map over the ring `axes` of P devices (legend: P ring positions, M rows per
device, K this device's share of the contraction, N output columns):
  out_MN on device i = sum over devices d of (y_PMK[i] @ w_KN) computed on d,
in y's dtype: the partial products accumulate in float32 and are summed in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from meshmoe.pallas_kernels.ring import Axes


def matmul_reducescatter(y_PMK: jax.Array, w_KN: jax.Array, axes: Axes) -> jax.Array:
  partial_PMN = jnp.einsum("pmk,kn->pmn", y_PMK, w_KN, preferred_element_type=jnp.float32)
  return lax.psum_scatter(partial_PMN, axes, scatter_dimension=0).astype(y_PMK.dtype)
