"""Token dispatch -> expert SwiGLU -> weighted combine, in three interchangeable forms.

All take the tokens of a batch, each token's K expert ids and combine weights, and the expert weights, and
return sum_k weight_k * SwiGLU_{expert_k}(token) (shape legend in layers.py). They differ in how the grouped
GEMM is laid out:

- `dropless_ragged`: all B*S*K assignments sorted by expert, one `jax.lax.ragged_dot` per matrix. The GPU
  path. XLA:CPU computes ragged_dot densely over every group (E x the useful FLOPs), so not for CPU.
- `dropless_blocked`: all assignments sorted by expert into tiles of `rows` rows, each tile holding one
  expert's tokens (groups padded to whole tiles, at most E*(rows-1) padding rows); each tile multiplies its
  expert's gathered weights. Executed FLOPs are the useful ones plus the padding: the CPU path. Gathering
  weights per tile costs memory (tiles x D x F), which is why it is not the GPU path. Sorting the whole
  batch at once (not per sequence) keeps groups large, so tiles can be tall and few.
- `capacity`: per sequence, each expert takes at most C tokens, first choices before second choices and
  earlier tokens first (GShard priority); the rest are dropped and counted. A dense [E, C] GEMM.

Routing is per token, so the two dropless forms give the same result whatever the batch layout; capacity
is decided per sequence, so a sequence's drops do not depend on how the batch is sharded.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from meshmoe.sharding.shardings import constrain


@dataclasses.dataclass
class ExpertWeights:
  gate_EDF: jax.Array
  up_EDF: jax.Array
  down_EFD: jax.Array


jax.tree_util.register_dataclass(ExpertWeights)


def choose_block_rows(num_assignments: int, num_experts: int) -> int:
  """Largest power-of-two tile height whose worst-case padding E*(rows-1) stays within 1/8 of the rows."""
  rows = 1
  while num_experts * (2 * rows - 1) <= num_assignments // 8:
    rows *= 2
  return rows


def dropless_ragged(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights) -> jax.Array:
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  num_experts = w.gate_EDF.shape[0]
  x_TD = x_BSD.reshape(b * s, d)
  expert_A = experts_BSK.reshape(-1)
  order_A = jnp.argsort(expert_A, stable=True)
  token_A = order_A // k
  sizes_E = jnp.bincount(expert_A, length=num_experts).astype(jnp.int32)
  x_AD = x_TD[token_A]
  dtype = x_BSD.dtype
  gate = jax.lax.ragged_dot(x_AD, w.gate_EDF.astype(dtype), sizes_E)
  up = jax.lax.ragged_dot(x_AD, w.up_EDF.astype(dtype), sizes_E)
  y_AD = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w.down_EFD.astype(dtype), sizes_E)
  y_TD = _combine(y_AD, weights_BSK.reshape(-1)[order_A], token_A, b * s)
  return y_TD.reshape(b, s, d)


def dropless_blocked(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights, rows: int = 0) -> jax.Array:
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  num_experts = w.gate_EDF.shape[0]
  num_assignments = b * s * k
  rows = rows or choose_block_rows(num_assignments, num_experts)
  expert_A = experts_BSK.reshape(-1)
  order_A = jnp.argsort(expert_A, stable=True)  # assignments sorted by expert
  sorted_expert_A = expert_A[order_A]
  sizes_E = jnp.bincount(expert_A, length=num_experts)
  tiles_E = (sizes_E + rows - 1) // rows
  first_tile_E = jnp.cumsum(tiles_E) - tiles_E
  first_sorted_E = jnp.cumsum(sizes_E) - sizes_E
  # Buffer row of each sorted assignment: its expert's first tile, then its rank inside the expert.
  row_A = first_tile_E[sorted_expert_A] * rows + jnp.arange(num_assignments) - first_sorted_E[sorted_expert_A]
  num_tiles = (num_assignments + num_experts * (rows - 1)) // rows
  # Padding rows point at token T, an all-zero row appended to the tokens.
  x_TD = x_BSD.reshape(b * s, d)
  token_R = jnp.full((num_tiles * rows,), b * s, jnp.int32).at[row_A].set(order_A // k)
  x_RD = jnp.concatenate([x_TD, jnp.zeros_like(x_TD[:1])])[token_R]
  # Tiles past the last used one get expert E-1; their rows are zero and never read back.
  expert_M = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles_E), jnp.arange(num_tiles), side="right"),
                         num_experts - 1)
  dtype = x_BSD.dtype
  # Tiles are independent: spread them over the devices that hold different tokens.
  x_MRD = constrain(x_RD.reshape(num_tiles, rows, d), ("act_tokens", None, "act_embed"))
  gate = jnp.einsum("mrd,mdf->mrf", x_MRD, w.gate_EDF[expert_M].astype(dtype))
  up = jnp.einsum("mrd,mdf->mrf", x_MRD, w.up_EDF[expert_M].astype(dtype))
  y_MRD = jnp.einsum("mrf,mfd->mrd", jax.nn.silu(gate) * up, w.down_EFD[expert_M].astype(dtype))
  y_AD = y_MRD.reshape(num_tiles * rows, d)[row_A]
  y_TD = _combine(y_AD, weights_BSK.reshape(-1)[order_A], order_A // k, b * s)
  return y_TD.reshape(b, s, d)


def expert_capacity(seq_len: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  return max(1, math.ceil(capacity_factor * seq_len * top_k / num_experts))


def capacity(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights,
             capacity_factor: float) -> tuple[jax.Array, jax.Array]:
  """Returns (output_BSD, dropped assignments per sequence_B)."""
  s, k = experts_BSK.shape[1:]
  cap = expert_capacity(s, k, w.gate_EDF.shape[0], capacity_factor)
  one_sequence = lambda x, e, g: _capacity_sequence(x, e, g, w, cap)
  return jax.vmap(one_sequence)(x_BSD, experts_BSK, weights_BSK)


def _capacity_sequence(x_SD, experts_SK, weights_SK, w: ExpertWeights, cap: int):
  s, k = experts_SK.shape
  num_experts = w.gate_EDF.shape[0]
  # Priority order i = choice * S + token: every first choice before any second choice.
  expert_I = experts_SK.T.reshape(-1)
  token_I = jnp.arange(k * s) % s
  onehot_IE = jax.nn.one_hot(expert_I, num_experts, dtype=jnp.int32)
  position_I = jnp.sum(jnp.cumsum(onehot_IE, axis=0) * onehot_IE, axis=-1) - 1
  kept_I = position_I < cap
  slot_I = jnp.where(kept_I, expert_I * cap + position_I, num_experts * cap)  # out of range = dropped
  token_R = jnp.full((num_experts * cap,), s, jnp.int32).at[slot_I].set(token_I, mode="drop")
  x_ECD = jnp.concatenate([x_SD, jnp.zeros_like(x_SD[:1])])[token_R].reshape(num_experts, cap, -1)
  dtype = x_SD.dtype
  gate = jnp.einsum("ecd,edf->ecf", x_ECD, w.gate_EDF.astype(dtype))
  up = jnp.einsum("ecd,edf->ecf", x_ECD, w.up_EDF.astype(dtype))
  y_ECD = jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w.down_EFD.astype(dtype))
  y_RD = jnp.concatenate([y_ECD.reshape(num_experts * cap, -1), jnp.zeros_like(x_SD[:1])])
  y_SD = _combine(y_RD[slot_I], weights_SK.T.reshape(-1), token_I, s)
  return y_SD, k * s - jnp.sum(kept_I)


def _combine(y_AD, weight_A, token_A, num_tokens: int) -> jax.Array:
  """sum over each token's assignments of weight * expert output, accumulated in float32."""
  weighted = y_AD.astype(jnp.float32) * weight_A.astype(jnp.float32)[:, None]
  y_TD = jnp.zeros((num_tokens, y_AD.shape[-1]), jnp.float32).at[token_A].add(weighted)
  return y_TD.astype(y_AD.dtype)
