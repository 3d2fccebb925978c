"""The routed experts on one device: the grouped expert FFN and the weighted combine.

Each expert is a gated FFN, down(activation(x @ gate, x @ up)); the model passes the activation (SwiGLU's
silu(gate) * up, `swiglu_hidden`). Shape suffixes as in models/layers.py; rows R of a dispatch buffer
each carry one (token, expert) pair. An expert id equal to the number of experts marks a row that must
produce zeros: a padding row, or an assignment dropped by capacity (models/capacity.py). That one
convention lets capacity mode reuse the dropless path (dropped assignments are simply never computed or
sent), and lets expert parallelism pad its receive buffers.

The grouped GEMM (`gemm`, the plan's `grouped_gemm`) is one of:
- `kernels`: rows sorted by expert, the GPU grouped-GEMM kernels the plan chose from measurements for each
  form (forward, input gradient, weight gradient: sharding/ragged_gemm.py, gpu_kernel_table.py; bf16/fp16
  operands), which compute only the tiles holding rows of some expert: the routed rows plus at most one
  partial tile of padding per expert, however large the worst-case buffer. Gate and up are one GEMM
  against the experts' [D, 2F] weights (x is read once). The kernels write nothing for rows outside every
  group and the backward computes garbage for them, so those rows are zeroed on the way in, between the
  GEMMs and on the way out (a `where`, which also zeroes their cotangents). Off GPUs the same path runs
  XLA's ragged dot for each form (dense; to check the path).
- `ragged_dot`: rows sorted by expert, one `jax.lax.ragged_dot` per matrix. XLA lowers it densely over
  every group (E x the useful FLOPs) on CPU and GPU: for platforms without a better kernel.
- `blocked`: rows sorted by expert; each expert's first C rows (its share of the routed rows) in one
  dense [E, C, D] block buffer multiplied by batched GEMMs, the rows past an expert's block in tiles of
  `block_rows` rows run by a loop (sharding/blocked_gemm.py). Under balanced routing it computes the
  routed rows and nothing else, whatever the size of the worst-case buffer: the CPU path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.extend import backend

from meshmoe.sharding import blocked_gemm, ragged_gemm
from meshmoe.sharding.grouped_gemm_kernels import GemmKernels


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


@jax.checkpoint
def swiglu_hidden(gate: jax.Array, up: jax.Array) -> jax.Array:
  """SwiGLU, the activation of every meshmoe model: silu(gate) * up, recomputed in the backward pass from
  gate and up: autodiff would otherwise keep sigmoid(gate) and silu(gate) too, two more [rows, F] buffers
  per layer (the largest activations of an MoE layer), for elementwise work that costs nothing to redo.
  The fused MoE kernels compute it themselves (expert_parallel.py)."""
  return jax.nn.silu(gate) * up


def grouped_ffn(x_RD: jax.Array, expert_R: jax.Array, w: ExpertWeights, activation: Activation, gemm: str,
                block_rows: int = 0, kernels: GemmKernels | None = None,
                routed_rows: int = 0) -> jax.Array:
  """y_RD[r] = the FFN of expert `expert_R[r]` applied to x_RD[r]; zero where expert_R[r] == E. `gemm` is
  the grouped GEMM, "kernels", "ragged_dot" or "blocked" (module docstring); `kernels` the three forms'
  kernels for "kernels" (the plan's; default: XLA's ragged dot for each)."""
  num_experts = w.num_experts
  order_R = jnp.argsort(expert_R, stable=True)  # by expert; the E rows (zeros) last
  sorted_expert_R = expert_R[order_R]
  sizes_E = jnp.bincount(expert_R, length=num_experts)  # ids == E are not counted
  valid_R = (sorted_expert_R < num_experts)[:, None]
  if gemm == "kernels":
    y_sorted = _kernels_ffn(x_RD[order_R], sizes_E, valid_R, w, activation, kernels or GemmKernels.exact())
  elif gemm == "ragged_dot":
    y_sorted = jnp.where(valid_R, _ragged_ffn(x_RD[order_R], sizes_E, w, activation), 0)
  elif gemm == "blocked":  # the blocks and tiles gather their rows and scatter their outputs back
    return _blocked_ffn(x_RD, order_R, sizes_E, w, activation, block_rows, routed_rows)
  else:
    raise ValueError(f"unknown grouped GEMM {gemm!r}; known: 'blocked', 'kernels', 'ragged_dot'")
  return jnp.zeros_like(y_sorted).at[order_R].set(y_sorted, unique_indices=True)


def _ragged_ffn(x_RD, sizes_E, w: ExpertWeights, activation: Activation) -> jax.Array:
  dtype = x_RD.dtype
  gate = jax.lax.ragged_dot(x_RD, w.gate_EDF.astype(dtype), sizes_E)
  up = jax.lax.ragged_dot(x_RD, w.up_EDF.astype(dtype), sizes_E)
  return jax.lax.ragged_dot(activation(gate, up), w.down_EFD.astype(dtype), sizes_E)


def _kernels_ffn(x_RD, sizes_E, valid_R, w: ExpertWeights, activation: Activation,
                 kernels: GemmKernels) -> jax.Array:
  """The FFN of rows sorted by expert, rows past the groups (`valid_R` False) giving zeros (docstring)."""
  dtype = x_RD.dtype
  if kernels.forward.implementation.startswith("tokamax") and backend.get_default_device().platform != "gpu":
    # tokamax picks its kernel variant from the default device, which is this machine's CPU when compiling
    # for GPUs deviceless.
    raise RuntimeError("tokamax's GPU kernels are chosen for the default device, which is "
                       f"{backend.get_default_device()}: lower programs for GPUs you do not have inside "
                       "meshmoe.analysis.deviceless.targeting(mesh)")
  gemm = lambda lhs, rhs: ragged_gemm.ragged_matmul(lhs, rhs, sizes_E, kernels)
  # The kernels tile rows in groups (Kernels.row_multiple): pad to a whole number of them with rows of no group.
  num_rows, width = x_RD.shape[0], w.gate_EDF.shape[-1]
  padding = -num_rows % kernels.row_multiple
  x_RD = jnp.pad(x_RD, ((0, padding), (0, 0)))
  valid_R = jnp.pad(valid_R, ((0, padding), (0, 0)))
  gate_up_RF = gemm(jnp.where(valid_R, x_RD, 0),
                    jnp.concatenate([w.gate_EDF, w.up_EDF], axis=-1).astype(dtype))
  hidden_RF = jnp.where(valid_R, activation(gate_up_RF[:, :width], gate_up_RF[:, width:]), 0)
  return jnp.where(valid_R, gemm(hidden_RF, w.down_EFD.astype(dtype)), 0)[:num_rows]


def _blocked_ffn(x_RD, order_R, sizes_E, w: ExpertWeights, activation: Activation, tile_rows: int,
                 routed_rows: int) -> jax.Array:
  """The FFN of each row (rows of id E give zeros) in capacity blocks and overflow tiles
  (sharding/blocked_gemm.py)."""
  dtype = x_RD.dtype
  capacity = blocked_gemm.capacity_rows(routed_rows or x_RD.shape[0], w.num_experts)
  lay = blocked_gemm.layout(order_R, sizes_E, capacity, tile_rows or blocked_gemm.DEFAULT_TILE_ROWS)
  return blocked_gemm.blocked_ffn(x_RD, lay, w.gate_EDF.astype(dtype), w.up_EDF.astype(dtype),
                                  w.down_EFD.astype(dtype), activation)


def combine(y_AD: jax.Array, weight_A: jax.Array, token_A: jax.Array, num_tokens: int) -> jax.Array:
  """sum over each token's assignments of weight * expert output, accumulated in float32."""
  weighted = y_AD.astype(jnp.float32) * weight_A.astype(jnp.float32)[:, None]
  y_TD = jnp.zeros((num_tokens, y_AD.shape[-1]), jnp.float32).at[token_A].add(weighted)
  return y_TD.astype(y_AD.dtype)


def moe_local(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights, activation: Activation, gemm: str,
              block_rows: int = 0, kernels: GemmKernels | None = None) -> jax.Array:
  """sum_k weight_k * FFN_{expert_k}(token) for tokens and experts on one device."""
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  token_A = jnp.arange(b * s * k) // k
  y_AD = grouped_ffn(x_BSD.reshape(b * s, d)[token_A], experts_BSK.reshape(-1), w, activation, gemm, block_rows,
                     kernels)
  return combine(y_AD, weights_BSK.reshape(-1), token_A, b * s).reshape(b, s, d)
