"""Basic layers: parameters with logical axis names, RMSNorm, token embedding, rotary embedding, SwiGLU.

Shape suffixes used across meshmoe.models:
  B batch, S sequence, D model dim, N query heads, G key/value heads, H head dim, F MLP width,
  E experts, K experts per token (top-k), V vocabulary, T tokens (flattened), A assignments (token, choice
  pairs), I assignments in capacity-priority order, R rows of a dispatch buffer, M tiles of rows,
  C expert capacity.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshmoe.sharding import embedding_lookup, tensor_parallel
from meshmoe.sharding.grouped_ffn import swiglu_hidden  # the one SwiGLU of dense layers and experts


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

  def __init__(self, vocab_size: int, dim: int, *, std: float, rngs: nnx.Rngs, tied: bool):
    self.table_VD = param(rngs, (vocab_size, dim), ("vocab", "embed"), std)
    self.tied = tied  # whether `attend` uses the table too (then its gradient is summed as one weight's)

  def __call__(self, tokens_BS: jax.Array, dtype: jnp.dtype) -> jax.Array:
    if self.tied:
      return jnp.take(self.table_VD[...], tokens_BS, axis=0).astype(dtype)
    return embedding_lookup.lookup(self.table_VD[...], tokens_BS, dtype)

  def attend(self, x_BSD: jax.Array) -> jax.Array:
    return jnp.einsum("bsd,vd->bsv", x_BSD, self.table_VD[...].astype(x_BSD.dtype))


@dataclasses.dataclass(frozen=True)
class Rope:
  """Rotary position embedding settings (ModelConfig's rope_theta, rope_interleave and yarn_* fields)."""

  theta: float
  interleave: bool = False
  yarn_factor: float = 1.0
  yarn_original_max_len: int = 4096
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_mscale: float = 1.0
  yarn_mscale_all_dim: float = 0.0

  @classmethod
  def of(cls, cfg) -> "Rope":
    return cls(cfg.rope_theta, cfg.rope_interleave, cfg.yarn_factor, cfg.yarn_original_max_len, cfg.yarn_beta_fast,
               cfg.yarn_beta_slow, cfg.yarn_mscale, cfg.yarn_mscale_all_dim)

  def inv_freq(self, dim: int) -> jax.Array:
    """The rotation frequency of each of the dim/2 pairs. With YaRN, interpolated (divided by the factor)
    below beta_slow rotations over the original length, kept above beta_fast, linearly ramped between,
    as transformers' _compute_yarn_parameters computes them (float32)."""
    half = dim // 2
    if self.yarn_factor <= 1:
      return self.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    extrapolated = 1.0 / (np.float32(self.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    interpolated = extrapolated / np.float32(self.yarn_factor)
    rotations_at = lambda n: dim * math.log(self.yarn_original_max_len / (n * 2 * math.pi)) / (2 * math.log(self.theta))
    low = max(math.floor(rotations_at(self.yarn_beta_fast)), 0)
    high = min(math.ceil(rotations_at(self.yarn_beta_slow)), dim - 1)
    ramp = np.clip((np.arange(half, dtype=np.float32) - low) / ((high - low) or 0.001), 0, 1)
    keep = 1 - ramp
    return jnp.asarray(interpolated * (1 - keep) + extrapolated * keep, jnp.float32)

  def _mscale(self, m: float) -> float:
    return 1.0 if self.yarn_factor <= 1 else 0.1 * m * math.log(self.yarn_factor) + 1.0

  def rotation_scale(self) -> float:
    """YaRN's factor on cos and sin (1 without YaRN)."""
    if self.yarn_mscale and self.yarn_mscale_all_dim:
      return self._mscale(self.yarn_mscale) / self._mscale(self.yarn_mscale_all_dim)
    return self._mscale(1.0)

  def score_scale(self) -> float:
    """YaRN's factor on the attention scores (1 without YaRN or without yarn_mscale_all_dim)."""
    return self._mscale(self.yarn_mscale_all_dim) ** 2 if self.yarn_mscale_all_dim else 1.0


class Documents(NamedTuple):
  """The documents of packed rows (data.document_mask), for attention: each token's `starts_BS`, the place
  in its row of its document's first token (it attends to the keys from there to its own place), and
  `rope_positions_BS`, the positions its rotary embedding uses (its place in the row, or with
  data.restart_positions its place in its document). In the order of the tokens (the plan's
  sequence_order), like the positions."""

  starts_BS: jax.Array
  rope_positions_BS: jax.Array


def rotate(x_BSNH: jax.Array, positions_BS: jax.Array, rope: Rope | float) -> jax.Array:
  """Rotary position embedding applied to the last dimension: its two halves rotated pairwise, or with
  `rope.interleave` its even and odd entries (the result then holds the rotated evens, then the odds: a
  fixed permutation of the dimension, the same for queries and keys, so their products are those of the
  interleaved rotation)."""
  rope = rope if isinstance(rope, Rope) else Rope(rope)
  half = x_BSNH.shape[-1] // 2
  angles_BSH = positions_BS[..., None].astype(jnp.float32) * rope.inv_freq(x_BSNH.shape[-1])
  scale = rope.rotation_scale()
  sin, cos = (scale * f(angles_BSH)[:, :, None, :] for f in (jnp.sin, jnp.cos))
  x = x_BSNH.astype(jnp.float32)
  x1, x2 = (x[..., 0::2], x[..., 1::2]) if rope.interleave else (x[..., :half], x[..., half:])
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BSNH.dtype)


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
