"""Per-device MoE arithmetic: grouped expert SwiGLU, the weighted combine, and capacity priority.

Shape suffixes as in models/layers.py; rows R of a dispatch buffer each carry one (token, expert) pair.
An expert id equal to the number of experts marks a row that must produce zeros: a padding row, or an
assignment dropped by capacity. That one convention lets capacity mode reuse the dropless path (dropped
assignments are simply never computed or sent), and lets expert parallelism pad its receive buffers.

The grouped GEMM has two layouts (`gemm_impl`):
- `ragged_dot`: rows sorted by expert, one `jax.lax.ragged_dot` per matrix. The GPU path. XLA:CPU computes
  ragged_dot densely over every group (E x the useful FLOPs), so not for CPU.
- `blocked`: rows sorted by expert into tiles of `rows` rows, each tile holding one expert's rows (groups
  padded to whole tiles, at most E*(rows-1) padding rows); each tile multiplies its expert's gathered
  weights. Executed FLOPs are the useful ones plus the padding: the CPU path. Gathering weights per tile
  costs memory (tiles x D x F), which is why it is not the GPU path.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass
class ExpertWeights:
  gate_EDF: jax.Array
  up_EDF: jax.Array
  down_EFD: jax.Array

  @property
  def num_experts(self) -> int:
    return self.gate_EDF.shape[0]


jax.tree_util.register_dataclass(ExpertWeights)


def choose_block_rows(num_rows: int, num_experts: int) -> int:
  """Largest power-of-two tile height whose worst-case padding E*(rows-1) stays within 1/8 of the rows."""
  rows = 1
  while num_experts * (2 * rows - 1) <= num_rows // 8:
    rows *= 2
  return rows


def grouped_swiglu(x_RD: jax.Array, expert_R: jax.Array, w: ExpertWeights, impl: str,
                   block_rows: int = 0) -> jax.Array:
  """y_RD[r] = SwiGLU of expert `expert_R[r]` applied to x_RD[r]; zero where expert_R[r] == E."""
  num_rows, num_experts = x_RD.shape[0], w.num_experts
  order_R = jnp.argsort(expert_R, stable=True)  # by expert; the E rows (zeros) last
  sorted_expert_R = expert_R[order_R]
  sizes_E = jnp.bincount(expert_R, length=num_experts)  # ids == E are not counted
  if impl == "ragged_dot":
    y_sorted = _ragged_swiglu(x_RD[order_R], sizes_E, w)
    y_sorted = jnp.where((sorted_expert_R < num_experts)[:, None], y_sorted, 0)
  elif impl == "blocked":
    y_sorted = _blocked_swiglu(x_RD, order_R, sorted_expert_R, sizes_E, w, block_rows)
  else:
    raise ValueError(f"unknown grouped GEMM {impl!r}; known: 'blocked', 'ragged_dot'")
  return jnp.zeros_like(y_sorted).at[order_R].set(y_sorted, unique_indices=True)


@jax.checkpoint
def swiglu_hidden(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up, recomputed in the backward pass from gate and up: autodiff would otherwise keep
  sigmoid(gate) and silu(gate) too, two more [rows, F] buffers per layer (the largest activations of an
  MoE layer), for elementwise work that costs nothing to redo."""
  return jax.nn.silu(gate) * up


def _ragged_swiglu(x_RD, sizes_E, w: ExpertWeights) -> jax.Array:
  dtype = x_RD.dtype
  gate = jax.lax.ragged_dot(x_RD, w.gate_EDF.astype(dtype), sizes_E)
  up = jax.lax.ragged_dot(x_RD, w.up_EDF.astype(dtype), sizes_E)
  return jax.lax.ragged_dot(swiglu_hidden(gate, up), w.down_EFD.astype(dtype), sizes_E)


def _blocked_swiglu(x_RD, order_R, sorted_expert_R, sizes_E, w: ExpertWeights, rows: int) -> jax.Array:
  """The SwiGLU of each row in sorted order (rows of id E give zeros), computed tile by tile."""
  num_rows, d = x_RD.shape
  num_experts = w.num_experts
  rows = rows or choose_block_rows(num_rows, num_experts)
  num_tiles = (num_rows + num_experts * (rows - 1)) // rows
  tiles_E = (sizes_E + rows - 1) // rows
  first_tile_E = jnp.cumsum(tiles_E) - tiles_E
  first_sorted_E = jnp.cumsum(sizes_E) - sizes_E
  valid_R = sorted_expert_R < num_experts
  expert_R = jnp.minimum(sorted_expert_R, num_experts - 1)
  # Buffer slot of each sorted row: its expert's first tile, then its rank inside the expert. Zero rows
  # point past the buffer, so they are neither written nor read back.
  slot_R = jnp.where(valid_R, first_tile_E[expert_R] * rows + jnp.arange(num_rows) - first_sorted_E[expert_R],
                     num_tiles * rows)
  # Unused buffer slots read row `num_rows`: an all-zero row appended to x.
  source_P = jnp.full((num_tiles * rows,), num_rows, jnp.int32).at[slot_R].set(order_R, mode="drop")
  x_PD = jnp.concatenate([x_RD, jnp.zeros_like(x_RD[:1])])[source_P]
  # Tiles past the last used one get expert E-1; their rows are zero and never read back.
  expert_M = jnp.minimum(jnp.searchsorted(jnp.cumsum(tiles_E), jnp.arange(num_tiles), side="right"),
                         num_experts - 1)
  dtype = x_RD.dtype
  x_MPD = x_PD.reshape(num_tiles, rows, d)
  gate = jnp.einsum("mpd,mdf->mpf", x_MPD, w.gate_EDF[expert_M].astype(dtype))
  up = jnp.einsum("mpd,mdf->mpf", x_MPD, w.up_EDF[expert_M].astype(dtype))
  y_MPD = jnp.einsum("mpf,mfd->mpd", swiglu_hidden(gate, up), w.down_EFD[expert_M].astype(dtype))
  return jnp.take(y_MPD.reshape(num_tiles * rows, d), slot_R, axis=0, mode="fill", fill_value=0)


def combine(y_AD: jax.Array, weight_A: jax.Array, token_A: jax.Array, num_tokens: int) -> jax.Array:
  """sum over each token's assignments of weight * expert output, accumulated in float32."""
  weighted = y_AD.astype(jnp.float32) * weight_A.astype(jnp.float32)[:, None]
  y_TD = jnp.zeros((num_tokens, y_AD.shape[-1]), jnp.float32).at[token_A].add(weighted)
  return y_TD.astype(y_AD.dtype)


def moe_local(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights, impl: str, block_rows: int = 0) -> jax.Array:
  """sum_k weight_k * SwiGLU_{expert_k}(token) for tokens and experts on one device."""
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  token_A = jnp.arange(b * s * k) // k
  y_AD = grouped_swiglu(x_BSD.reshape(b * s, d)[token_A], experts_BSK.reshape(-1), w, impl, block_rows)
  return combine(y_AD, weights_BSK.reshape(-1), token_A, b * s).reshape(b, s, d)


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
