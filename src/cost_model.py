"""Analytic cost model: useful model FLOPs of a training step.

Counts the matmul FLOPs a perfect implementation must execute (2 per multiply-add): projections, the
causal half of the attention scores and values, the router, the top-k experts each token actually uses,
shared experts, dense layers and the output logits. A training step is forward + backward = 3 x forward.
Elementwise work (norms, softmax, activations) is not counted; compiled programs count it, which is one
reason their FLOPs exceed these.
"""

from __future__ import annotations

import dataclasses

from meshmoe.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ForwardFlops:
  attention_projections: float
  attention_scores: float  # QK^T and PV over the causal (lower-triangular) part
  router: float
  routed_experts: float
  shared_experts: float
  dense_mlp: float
  logits: float

  @property
  def total(self) -> float:
    return sum(dataclasses.astuple(self))


def forward_flops(cfg: ModelConfig, batch: int, seq_len: int) -> ForwardFlops:
  tokens = batch * seq_len
  d, n, g, h = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  moe = cfg.moe
  num_moe = cfg.num_layers - cfg.num_dense_layers
  swiglu = lambda width: 2 * 3 * d * width  # gate, up and down matmuls per token
  # Query i attends to i + 1 keys: sum over a sequence is S(S+1)/2; scores and values each 2*N*H per pair.
  causal_pairs = batch * seq_len * (seq_len + 1) / 2
  return ForwardFlops(
      attention_projections=cfg.num_layers * tokens * 2 * d * h * (2 * n + 2 * g),
      attention_scores=cfg.num_layers * causal_pairs * 2 * 2 * n * h,
      router=num_moe * tokens * 2 * d * moe.num_experts,
      routed_experts=num_moe * tokens * moe.top_k * swiglu(moe.expert_mlp_dim),
      shared_experts=num_moe * tokens * swiglu(moe.num_shared_experts * moe.expert_mlp_dim),
      dense_mlp=cfg.num_dense_layers * tokens * swiglu(cfg.mlp_dim),
      logits=tokens * 2 * d * cfg.vocab_size,
  )


def train_step_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
  """Useful FLOPs of one forward + backward pass (backward = 2 x forward)."""
  return 3 * forward_flops(cfg, batch, seq_len).total


def active_params(cfg: ModelConfig) -> dict[str, int]:
  """Parameter counts: total, and active per token (top-k of the routed experts)."""
  d, moe = cfg.embed_dim, cfg.moe
  attn = d * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 2 * d
  expert = 3 * d * moe.expert_mlp_dim
  num_moe = cfg.num_layers - cfg.num_dense_layers
  moe_common = d * moe.num_experts + moe.num_shared_experts * expert
  embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + d
  common = cfg.num_layers * attn + cfg.num_dense_layers * 3 * d * cfg.mlp_dim + num_moe * moe_common + embed
  return {
      "total": common + num_moe * moe.num_experts * expert,
      "active": common + num_moe * moe.top_k * expert,
  }
