"""Grouped weight gradient with XLA: the function the kernel computes, and its fallback.

  dw_EDF[e] = x_RD[rows of e]^T @ dy_RF[rows of e]

where expert e's rows are the `rows_E[e]` rows after those of the experts before it (rows past the last
group are ignored). This is the transposed ragged dot; XLA rewrites it into a dense product over every
expert (E times the FLOPs, and an [E, R, D] temporary), which is why the GPU path has a kernel.

Legend: R rows, D and F the two widths, E experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def weight_gradient(x_RD: jax.Array, dy_RF: jax.Array, rows_E: jax.Array, like: jax.Array) -> jax.Array:
  """dw_EDF in `like`'s dtype. The pullback is taken at `like` (an [E, D, F] weight; its value does not
  matter, the map is linear) so that the result has its varying-axis type under shard_map: taken at a
  constant, autodiff would sum it over the devices."""
  # In float32 throughout: the pullback of a 16-bit ragged dot would sum in 16 bits.
  _, pullback = jax.vjp(lambda w: jax.lax.ragged_dot(x_RD.astype(jnp.float32), w.astype(jnp.float32), rows_E),
                        like)
  return pullback(dy_RF.astype(jnp.float32))[0].astype(like.dtype)
