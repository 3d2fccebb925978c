"""Basic layers: parameters with logical axis names, RMSNorm, token embedding, rotary embedding, SwiGLU.

Shape suffixes used across meshmoe.models:
  B batch, S sequence, D model dim, N query heads, G key/value heads, H head dim, F MLP width,
  E experts, K experts per token (top-k), V vocabulary, T tokens (flattened), A assignments (token, choice
  pairs), I assignments in capacity-priority order, R rows of a dispatch buffer, M tiles of rows,
  C expert capacity.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.sharding import tensor_parallel


def param(rngs: nnx.Rngs, shape: Sequence[int], logical_axes: Sequence[str | None], std: float) -> nnx.Param:
  """A float32 parameter drawn from N(0, std^2), tagged with logical axis names for the rules table."""
  value = std * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
  return nnx.Param(value, logical_axes=tuple(logical_axes))


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float):
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), logical_axes=("norm",))
    self.eps = eps

  def __call__(self, x_BSD: jax.Array) -> jax.Array:
    x = x_BSD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * self.scale[...]).astype(x_BSD.dtype)


class Embed(nnx.Module):
  """Token embedding; `attend` gives output logits with the same table (tied embeddings)."""

  def __init__(self, vocab_size: int, dim: int, *, std: float, rngs: nnx.Rngs):
    self.table_VD = param(rngs, (vocab_size, dim), ("vocab", "embed"), std)

  def __call__(self, tokens_BS: jax.Array, dtype: jnp.dtype) -> jax.Array:
    return jnp.take(self.table_VD[...], tokens_BS, axis=0).astype(dtype)

  def attend(self, x_BSD: jax.Array) -> jax.Array:
    return jnp.einsum("bsd,vd->bsv", x_BSD, self.table_VD[...].astype(x_BSD.dtype))


def rotate(x_BSNH: jax.Array, positions_BS: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (rotate-half convention) applied to the last dimension."""
  half = x_BSNH.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles_BSH = positions_BS[..., None].astype(jnp.float32) * inv_freq
  sin, cos = jnp.sin(angles_BSH)[:, :, None, :], jnp.cos(angles_BSH)[:, :, None, :]
  x = x_BSNH.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BSNH.dtype)


@jax.checkpoint
def swiglu_hidden(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up, recomputed in the backward pass from gate and up: autodiff would otherwise keep
  sigmoid(gate) and silu(gate) too, two more [rows, F] buffers per layer (the largest activations of an
  MoE layer), for elementwise work that costs nothing to redo."""
  return jax.nn.silu(gate) * up


class SwiGLU(nnx.Module):
  """Dense gated MLP: down(silu(x @ gate) * (x @ up)). Used for dense layers and shared experts."""

  def __init__(self, dim: int, width: int, *, std: float, rngs: nnx.Rngs):
    self.gate_DF = param(rngs, (dim, width), ("embed", "mlp"), std)
    self.up_DF = param(rngs, (dim, width), ("embed", "mlp"), std)
    self.down_FD = param(rngs, (width, dim), ("mlp", "embed"), std)

  def __call__(self, x_BSD: jax.Array) -> jax.Array:
    # Column- then row-parallel under tensor parallelism (sharding/tensor_parallel.py).
    gate_BSF, up_BSF = tensor_parallel.project_in(x_BSD, [self.gate_DF[...], self.up_DF[...]],
                                                  [("embed", "mlp")] * 2)
    return tensor_parallel.project_out(swiglu_hidden(gate_BSF, up_BSF), self.down_FD[...], ("mlp", "embed"))
