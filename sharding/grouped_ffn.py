"""The routed experts on one device: the grouped expert FFN and the weighted combine.

Each expert is a gated FFN, down(activation(x @ gate, x @ up)); the model passes the activation (SwiGLU's
silu(gate) * up, models/layers.py). Shape suffixes as in models/layers.py; rows R of a dispatch buffer
each carry one (token, expert) pair. An expert id equal to the number of experts marks a row that must
produce zeros: a padding row, or an assignment dropped by capacity (models/capacity.py). That one
convention lets capacity mode reuse the dropless path (dropped assignments are simply never computed or
sent), and lets expert parallelism pad its receive buffers.

The grouped GEMM (`gemm`, the plan's `grouped_gemm`) is one of:
- `tokamax`: rows sorted by expert, tokamax's grouped GEMM (`tokamax.ragged_dot`): on GPUs its Mosaic GPU
  kernels (sm80, sm90, sm100; bf16/fp16 operands), which compute only the tiles holding rows of some
  expert: the routed rows plus at most one partial tile of padding per expert, however large the
  worst-case buffer. Gate and up are one GEMM against the experts' [D, 2F] weights (x is read once).
  The kernels write nothing for rows outside every group and the backward computes garbage for them,
  so those rows are zeroed on the way in, between the GEMMs and on the way out (a `where`, which also
  zeroes their cotangents). Elsewhere tokamax runs its XLA version (dense; for tests only).
- `ragged_dot`: rows sorted by expert, one `jax.lax.ragged_dot` per matrix. XLA lowers it densely over
  every group (E x the useful FLOPs) on CPU and GPU: for platforms without a better kernel.
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
from jax.extend import backend

from meshmoe.sharding import tokamax_gemm


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
                block_rows: int = 0, kernels: tokamax_gemm.Kernels | None = None) -> jax.Array:
  """y_RD[r] = the FFN of expert `expert_R[r]` applied to x_RD[r]; zero where expert_R[r] == E. `gemm` is
  the grouped GEMM, "tokamax", "ragged_dot" or "blocked" (module docstring); `kernels` tokamax's
  implementations (the plan's; default: its XLA version)."""
  num_experts = w.num_experts
  order_R = jnp.argsort(expert_R, stable=True)  # by expert; the E rows (zeros) last
  sorted_expert_R = expert_R[order_R]
  sizes_E = jnp.bincount(expert_R, length=num_experts)  # ids == E are not counted
  valid_R = (sorted_expert_R < num_experts)[:, None]
  if gemm == "tokamax":
    y_sorted = _tokamax_ffn(x_RD[order_R], sizes_E, valid_R, w, activation,
                            kernels or tokamax_gemm.Kernels("xla", "xla"))
  elif gemm == "ragged_dot":
    y_sorted = jnp.where(valid_R, _ragged_ffn(x_RD[order_R], sizes_E, w, activation), 0)
  elif gemm == "blocked":
    y_sorted = _blocked_ffn(x_RD, order_R, sorted_expert_R, sizes_E, w, activation, block_rows)
  else:
    raise ValueError(f"unknown grouped GEMM {gemm!r}; known: 'blocked', 'tokamax', 'ragged_dot'")
  return jnp.zeros_like(y_sorted).at[order_R].set(y_sorted, unique_indices=True)


def _ragged_ffn(x_RD, sizes_E, w: ExpertWeights, activation: Activation) -> jax.Array:
  dtype = x_RD.dtype
  gate = jax.lax.ragged_dot(x_RD, w.gate_EDF.astype(dtype), sizes_E)
  up = jax.lax.ragged_dot(x_RD, w.up_EDF.astype(dtype), sizes_E)
  return jax.lax.ragged_dot(activation(gate, up), w.down_EFD.astype(dtype), sizes_E)


def _tokamax_ffn(x_RD, sizes_E, valid_R, w: ExpertWeights, activation: Activation,
                 kernels: tokamax_gemm.Kernels) -> jax.Array:
  """The FFN of rows sorted by expert, rows past the groups (`valid_R` False) giving zeros (docstring)."""
  dtype = x_RD.dtype
  if kernels.rows != "xla" and backend.get_default_device().platform != "gpu":
    # tokamax picks its kernel variant from the default device, which is this machine's CPU when compiling
    # for GPUs deviceless.
    raise RuntimeError("tokamax's GPU kernels are chosen for the default device, which is "
                       f"{backend.get_default_device()}: lower programs for GPUs you do not have inside "
                       "meshmoe.analysis.deviceless.targeting(mesh)")
  gemm = lambda lhs, rhs: tokamax_gemm.ragged_matmul(lhs, rhs, sizes_E, kernels)
  # The kernels tile rows in groups of 8: pad to a whole number of them with rows of no group.
  num_rows, width = x_RD.shape[0], w.gate_EDF.shape[-1]
  padding = -num_rows % _TOKAMAX_ROW_TILE
  x_RD = jnp.pad(x_RD, ((0, padding), (0, 0)))
  valid_R = jnp.pad(valid_R, ((0, padding), (0, 0)))
  gate_up_RF = gemm(jnp.where(valid_R, x_RD, 0),
                    jnp.concatenate([w.gate_EDF, w.up_EDF], axis=-1).astype(dtype))
  hidden_RF = jnp.where(valid_R, activation(gate_up_RF[:, :width], gate_up_RF[:, width:]), 0)
  return jnp.where(valid_R, gemm(hidden_RF, w.down_EFD.astype(dtype)), 0)[:num_rows]


_TOKAMAX_ROW_TILE = 8


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
              block_rows: int = 0, kernels: tokamax_gemm.Kernels | None = None) -> jax.Array:
  """sum_k weight_k * FFN_{expert_k}(token) for tokens and experts on one device."""
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  token_A = jnp.arange(b * s * k) // k
  y_AD = grouped_ffn(x_BSD.reshape(b * s, d)[token_A], experts_BSK.reshape(-1), w, activation, gemm, block_rows,
                     kernels)
  return combine(y_AD, weights_BSK.reshape(-1), token_A, b * s).reshape(b, s, d)
