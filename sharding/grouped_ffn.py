"""The routed experts on one device: the grouped expert FFN and the weighted combine.

Each expert is a gated FFN, down(activation(x @ gate, x @ up)); the model passes the activation (SwiGLU's
silu(gate) * up, models/layers.py). Shape suffixes as in models/layers.py; rows R of a dispatch buffer
each carry one (token, expert) pair. An expert id equal to the number of experts marks a row that must
produce zeros: a padding row, or an assignment dropped by capacity (models/capacity.py). That one
convention lets capacity mode reuse the dropless path (dropped assignments are simply never computed or
sent), and lets expert parallelism pad its receive buffers.

The grouped GEMM has two layouts (`gemm`, the plan's `grouped_gemm`):
- `ragged_dot`: rows sorted by expert, one `jax.lax.ragged_dot` per matrix. The GPU path. XLA:CPU computes
  ragged_dot densely over every group (E x the useful FLOPs), so not for CPU.
- `blocked`: rows sorted by expert into tiles of `rows` rows, each tile holding one expert's rows (groups
  padded to whole tiles, at most E*(rows-1) padding rows); each tile multiplies its expert's gathered
  weights. Executed FLOPs are the useful ones plus the padding: the CPU path. Gathering weights per tile
  costs memory (tiles x D x F), which is why it is not the GPU path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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

Activation = Callable[[jax.Array, jax.Array], jax.Array]  # (gate, up) -> hidden units


def choose_block_rows(num_rows: int, num_experts: int) -> int:
  """Largest power-of-two tile height whose worst-case padding E*(rows-1) stays within 1/8 of the rows."""
  rows = 1
  while num_experts * (2 * rows - 1) <= num_rows // 8:
    rows *= 2
  return rows


def blocked_tiles(num_rows: int, num_experts: int, block_rows: int = 0) -> tuple[int, int]:
  """(tiles, rows per tile) of the blocked layout of `num_rows` rows over `num_experts` experts: every
  expert's rows padded to whole tiles, sized for the worst case; `block_rows` 0 chooses the height."""
  rows = block_rows or choose_block_rows(num_rows, num_experts)
  return (num_rows + num_experts * (rows - 1)) // rows, rows


def grouped_ffn(x_RD: jax.Array, expert_R: jax.Array, w: ExpertWeights, activation: Activation, gemm: str,
                block_rows: int = 0) -> jax.Array:
  """y_RD[r] = the FFN of expert `expert_R[r]` applied to x_RD[r]; zero where expert_R[r] == E. `gemm` is
  the layout, "blocked" or "ragged_dot" (module docstring)."""
  num_experts = w.num_experts
  order_R = jnp.argsort(expert_R, stable=True)  # by expert; the E rows (zeros) last
  sorted_expert_R = expert_R[order_R]
  sizes_E = jnp.bincount(expert_R, length=num_experts)  # ids == E are not counted
  if gemm == "ragged_dot":
    y_sorted = _ragged_ffn(x_RD[order_R], sizes_E, w, activation)
    y_sorted = jnp.where((sorted_expert_R < num_experts)[:, None], y_sorted, 0)
  elif gemm == "blocked":
    y_sorted = _blocked_ffn(x_RD, order_R, sorted_expert_R, sizes_E, w, activation, block_rows)
  else:
    raise ValueError(f"unknown grouped GEMM {gemm!r}; known: 'blocked', 'ragged_dot'")
  return jnp.zeros_like(y_sorted).at[order_R].set(y_sorted, unique_indices=True)


def _ragged_ffn(x_RD, sizes_E, w: ExpertWeights, activation: Activation) -> jax.Array:
  dtype = x_RD.dtype
  gate = jax.lax.ragged_dot(x_RD, w.gate_EDF.astype(dtype), sizes_E)
  up = jax.lax.ragged_dot(x_RD, w.up_EDF.astype(dtype), sizes_E)
  return jax.lax.ragged_dot(activation(gate, up), w.down_EFD.astype(dtype), sizes_E)


def _blocked_ffn(x_RD, order_R, sorted_expert_R, sizes_E, w: ExpertWeights, activation: Activation,
                 rows: int) -> jax.Array:
  """The FFN of each row in sorted order (rows of id E give zeros), computed tile by tile."""
  num_rows, d = x_RD.shape
  num_experts = w.num_experts
  num_tiles, rows = blocked_tiles(num_rows, num_experts, rows)
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
  y_MPD = jnp.einsum("mpf,mfd->mpd", activation(gate, up), w.down_EFD[expert_M].astype(dtype))
  return jnp.take(y_MPD.reshape(num_tiles * rows, d), slot_R, axis=0, mode="fill", fill_value=0)


def combine(y_AD: jax.Array, weight_A: jax.Array, token_A: jax.Array, num_tokens: int) -> jax.Array:
  """sum over each token's assignments of weight * expert output, accumulated in float32."""
  weighted = y_AD.astype(jnp.float32) * weight_A.astype(jnp.float32)[:, None]
  y_TD = jnp.zeros((num_tokens, y_AD.shape[-1]), jnp.float32).at[token_A].add(weighted)
  return y_TD.astype(y_AD.dtype)


def moe_local(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights, activation: Activation, gemm: str,
              block_rows: int = 0) -> jax.Array:
  """sum_k weight_k * FFN_{expert_k}(token) for tokens and experts on one device."""
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  token_A = jnp.arange(b * s * k) // k
  y_AD = grouped_ffn(x_BSD.reshape(b * s, d)[token_A], experts_BSK.reshape(-1), w, activation, gemm, block_rows)
  return combine(y_AD, weights_BSK.reshape(-1), token_A, b * s).reshape(b, s, d)
