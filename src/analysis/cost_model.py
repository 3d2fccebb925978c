"""Analytic cost model of a training step: FLOPs here; collectives in cost_collectives.py, memory in
cost_memory.py; `step_cost` gathers all three.

Useful model FLOPs count the matmuls a perfect implementation must execute (2 per multiply-add):
projections, the causal half of the attention scores and values, the router, the top-k experts each token
actually uses, shared experts, dense layers and the output logits. A training step is forward + backward
= 3 x forward. MFU uses these.

Executed FLOPs per device count what meshmoe's implementation runs on one device: attention over the
blocks it really computes (all S x S pairs on one device, or 2n+1 of 4n blocks with the load-balanced
all-gather), the grouped GEMM's padding (tile padding, and the dropless worst-case receive buffer of
expert parallelism), work repeated on devices that hold the same tokens (the router and logits under
`megascale`, which leaves `tensor` out of the token split), and the forward again under remat.
Elementwise work (norms, softmax, activations) is counted by neither; compiled programs count it.
"""

from __future__ import annotations

import dataclasses
import math

from meshmoe.analysis import cost_kernels
from meshmoe.config import Config, ModelConfig, resolve_mesh_sizes
from meshmoe.sharding.dispatch import choose_block_rows
from meshmoe.sharding.rules import get_preset, logical_to_spec


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


def executed_flops_per_device(config: Config, num_devices: int, platform: str = "cpu") -> ForwardFlops:
  """FLOPs one device executes per training step, by part (forward, backward and remat together)."""
  m, moe, t = config.model, config.model.moe, config.train
  sizes = resolve_mesh_sizes(config.mesh, num_devices)
  preset = get_preset(config.mesh.preset)
  split = lambda logical, rules: math.prod(
      sizes[a] for entry in logical_to_spec(logical, rules) if entry is not None
      for a in ((entry,) if isinstance(entry, str) else entry))
  useful = forward_flops(m, t.global_batch_size, t.seq_len)
  per_device = {name: value / num_devices for name, value in vars(useful).items()}
  # Work done once per group of devices holding the same tokens is repeated on each of them.
  token_split = split(("act_batch", "act_seq"), preset.activations)
  per_device["router"] = useful.router / token_split
  per_device["logits"] = useful.logits / split(("act_batch", "act_seq", "act_vocab"), preset.activations)
  n = split(("act_attn_seq",), preset.activations)
  dense_scores = useful.attention_scores * t.seq_len / (t.seq_len + 1) * 2  # all S x S pairs
  computed = {"allgather": (2 * n + 1) / (4 * n)}.get(config.parallel.attention, 1.0) if n > 1 else 1.0
  per_device["attention_scores"] = dense_scores * computed / num_devices
  per_device["routed_experts"] = _expert_flops(config, sizes, preset, split, platform)
  forward = ForwardFlops(**per_device)
  recompute = {"none": 0.0, "full": 1.0, "dots": 0.0}[m.remat]
  scale = {name: 3.0 + recompute for name in per_device}
  if m.remat == "dots":  # dots with batch dimensions (attention, per-tile expert GEMMs) are recomputed
    scale["attention_scores"] = scale["routed_experts"] = 4.0
  return ForwardFlops(**{name: scale[name] * value for name, value in vars(forward).items()})


def _expert_flops(config: Config, sizes, preset, split, platform: str) -> float:
  """Forward FLOPs of one device's routed-expert GEMMs, as the dispatch lays them out."""
  m, moe, t = config.model, config.model.moe, config.train
  num_moe = m.num_layers - m.num_dense_layers
  micro = t.global_batch_size // t.grad_accum_steps
  ep = split(("exp",), preset.params)
  width_split = split(("exp_mlp",), preset.params)
  token_split = split(("act_batch", "act_seq"), preset.activations)
  # Tokens this device routes: its share, gathered over the expert-width axes that also split tokens.
  token_axes = [a for e in logical_to_spec(("act_batch", "act_seq"), preset.activations) if e is not None
                for a in ((e,) if isinstance(e, str) else e)]
  width_axes = logical_to_spec((None, "exp_mlp"), preset.params)[1]
  width_axes = () if width_axes is None else (width_axes,) if isinstance(width_axes, str) else width_axes
  gathered = math.prod(sizes[a] for a in width_axes if a in token_axes)
  assignments = micro * t.seq_len // token_split * gathered * moe.top_k
  rows = ep * assignments  # the receive buffer: dropless worst case
  local_experts = moe.num_experts // ep
  gemm = moe.gemm_impl if moe.gemm_impl != "auto" else ("blocked" if platform == "cpu" else "ragged_dot")
  if cost_kernels.moe_kernels_apply(config, platform, ep, moe.expert_mlp_dim / width_split):
    computed_rows, _ = cost_kernels.moe_rows(assignments, ep, local_experts)  # used tiles only
  elif gemm == "blocked":
    height = moe.gemm_block_rows or choose_block_rows(rows, local_experts)
    computed_rows = (rows + local_experts * (height - 1)) // height * height
  else:  # XLA (CPU and GPU alike) rewrites ragged_dot into a dense dot over every local expert
    computed_rows = rows * local_experts
  per_step_micro = computed_rows * 2 * 3 * m.embed_dim * moe.expert_mlp_dim / width_split
  return num_moe * per_step_micro * t.grad_accum_steps


def flops_in_kernels(config: Config, num_devices: int, platform: str = "gpu") -> float:
  """Of `executed_flops_per_device`, the FLOPs inside the `pallas` tier's fused kernels, which compiled
  HLO does not show: the routed experts' every GEMM (forward, input and weight gradients), and of a
  tensor-parallel block's projections the forward (with its remat repeat) and input-gradient GEMMs (the
  weight gradients are local XLA matmuls)."""
  from meshmoe.analysis import cost_collectives

  ops = cost_collectives.fused_ops(config, num_devices, platform)
  executed = executed_flops_per_device(config, num_devices, platform)
  recompute = 1.0 if config.model.remat == "full" else 0.0
  share = (2.0 + recompute) / (3.0 + recompute)
  parts = {"attention": executed.attention_projections, "dense_mlp": executed.dense_mlp,
           "shared_experts": executed.shared_experts}
  return (sum(share * flops for op, flops in parts.items() if op in ops)
          + (executed.routed_experts if "moe" in ops else 0.0))


@dataclasses.dataclass(frozen=True)
class StepCost:
  """The cost model's figures for one training step of a (config, device count)."""

  model_flops: float  # useful FLOPs, whole step, all devices
  executed_flops_per_device: ForwardFlops  # by part, forward + backward + remat
  collectives: list  # cost_collectives.CollectiveCost, per device
  memory: object  # cost_memory.MemoryCost, per device


def step_cost(config: Config, num_devices: int, platform: str = "cpu") -> StepCost:
  from meshmoe.analysis import cost_collectives, cost_memory  # they import this module's neighbours only

  t = config.train
  return StepCost(
      model_flops=train_step_flops(config.model, t.global_batch_size, t.seq_len),
      executed_flops_per_device=executed_flops_per_device(config, num_devices, platform),
      collectives=cost_collectives.collective_costs(config, num_devices, platform),
      memory=cost_memory.memory_per_device(config, num_devices, platform))
