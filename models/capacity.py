"""Expert capacity: which assignments a capacity-limited MoE layer drops (shape legend in layers.py).

With `moe.capacity_factor` set, each expert takes at most C = ceil(capacity_factor * S * K / E) of a
sequence's assignments, in GShard's priority: every first choice before any second choice, earlier
positions first. A dropped assignment gets expert id E (the number of experts): the parallel ops never
send or compute it (meshmoe.sharding.grouped_ffn), so capacity mode runs the dropless path. A masked
token's assignments arrive with id E already (MoEBlock.route): they take no slot.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def expert_capacity(seq_len: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  return max(1, math.ceil(capacity_factor * seq_len * top_k / num_experts))


def capacity_keep(experts_BSK: jax.Array, positions_BS: jax.Array, num_experts: int,
                  capacity_factor: float) -> jax.Array:
  """Which assignments fit their expert's capacity (GShard priority, per sequence): every first choice
  before any second choice, earlier positions first. Positions need not be sorted (context-parallel
  attention permutes the sequence), so a layout change never changes which tokens are dropped."""
  s, k = experts_BSK.shape[1:]
  cap = expert_capacity(s, k, num_experts, capacity_factor)
  by_position_BS = jnp.argsort(positions_BS, axis=1)
  experts_in_order = jnp.take_along_axis(experts_BSK, by_position_BS[:, :, None], axis=1)
  kept_in_order = jax.vmap(lambda e: _capacity_keep_sequence(e, num_experts, cap))(experts_in_order)
  kept_BSK = jnp.zeros_like(kept_in_order)
  return jax.vmap(lambda kept, pos, src: kept.at[pos].set(src))(kept_BSK, by_position_BS, kept_in_order)


def _capacity_keep_sequence(experts_SK: jax.Array, num_experts: int, cap: int) -> jax.Array:
  s, k = experts_SK.shape
  expert_I = experts_SK.T.reshape(-1)  # priority order i = choice * S + position
  onehot_IE = jax.nn.one_hot(expert_I, num_experts, dtype=jnp.int32)
  position_I = jnp.sum(jnp.cumsum(onehot_IE, axis=0) * onehot_IE, axis=-1) - 1
  return (position_I < cap).reshape(k, s).T
