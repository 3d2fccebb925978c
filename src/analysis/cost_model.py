"""Analytic cost model of a training step: FLOPs here; collectives in cost_collectives.py, memory in
cost_memory.py; `step_cost` gathers all three.

Useful model FLOPs count the matmuls a perfect implementation must execute (2 per multiply-add):
projections, the causal half of the attention scores and values, the router, the top-k experts each token
actually uses, shared experts, dense layers and the output logits. A training step is forward + backward
= 3 x forward. MFU uses these.

Executed FLOPs per device count what meshmoe's implementation runs on one device, as the parallel plan
says it runs (meshmoe.sharding.plan: the same object the ops dispatch on): attention over the blocks it
really computes (all S x S pairs on one device or in the plain ring, 2n+1 of 4n blocks with the
load-balanced all-gather or the zigzag ring), the grouped GEMM's padding (tile padding, and the dropless
worst-case receive buffer of expert parallelism), work repeated on devices that hold the same tokens (the
router and logits under `megascale`, which leaves `tensor` out of the token split), and the forward again
under remat (the layers': the output layer runs outside the remat'd loop). Elementwise work (norms,
softmax, activations) is counted by neither; compiled programs count it.
"""

from __future__ import annotations

import dataclasses

from meshmoe.analysis import cost_collectives, cost_kernels, cost_memory
from meshmoe.config import Config, ModelConfig
from meshmoe.sharding import blocked_gemm, expert_parallel, moe_pipeline, parallel
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.projection_blocks import attention_width, projection_blocks


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
  d, n = cfg.embed_dim, cfg.num_heads
  moe = cfg.moe
  num_moe = cfg.num_layers - cfg.num_dense_layers
  swiglu = lambda width: 2 * 3 * d * width  # gate, up and down matmuls per token
  # Query i attends to i + 1 keys: sum over a sequence is S(S+1)/2; per pair, scores 2*N*H_qk and values
  # 2*N*H_v (H_qk = H_v = head_dim but under MLA).
  causal_pairs = batch * seq_len * (seq_len + 1) / 2
  qk, v = _score_widths(cfg)
  attention = [b for b in projection_blocks(Config(model=cfg)) if b.name.startswith("attention")]
  return ForwardFlops(
      attention_projections=tokens * sum(b.layers * b.flops_per_token for b in attention),
      attention_scores=cfg.num_layers * causal_pairs * 2 * n * (qk + v),
      router=num_moe * tokens * 2 * d * moe.num_experts,
      routed_experts=num_moe * tokens * moe.top_k * swiglu(moe.expert_mlp_dim),
      shared_experts=num_moe * tokens * swiglu(moe.num_shared_experts * moe.expert_mlp_dim),
      dense_mlp=cfg.num_dense_layers * tokens * swiglu(cfg.mlp_dim),
      logits=tokens * 2 * d * cfg.vocab_size,
  )


def _score_widths(cfg: ModelConfig) -> tuple[int, int]:
  """(query/key width, value width) of a head."""
  if cfg.attention == "mla":
    return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
  return cfg.head_dim, cfg.head_dim


def train_step_flops(cfg: ModelConfig, batch: int, seq_len: int) -> float:
  """Useful FLOPs of one forward + backward pass (backward = 2 x forward)."""
  return 3 * forward_flops(cfg, batch, seq_len).total


def active_params(cfg: ModelConfig) -> dict[str, int]:
  """Parameter counts: total, and active per token (top-k of the routed experts)."""
  d, moe = cfg.embed_dim, cfg.moe
  norms = 2 * d + (2 * cfg.head_dim if cfg.qk_norm else 0)  # the layer's two norms; Qwen3's q and k norms
  if cfg.attention == "mla":  # the latents' norms
    norms += cfg.kv_lora_rank + cfg.q_lora_rank
  attention = [b for b in projection_blocks(Config(model=cfg)) if b.name.startswith("attention")]
  attn = sum(b.flops_per_token // 2 for b in attention) + norms  # a weight is one multiply-add per token
  expert = 3 * d * moe.expert_mlp_dim
  num_moe = cfg.num_layers - cfg.num_dense_layers
  moe_common = d * moe.num_experts + moe.num_shared_experts * expert
  embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2) + d
  common = cfg.num_layers * attn + cfg.num_dense_layers * 3 * d * cfg.mlp_dim + num_moe * moe_common + embed
  return {
      "total": common + num_moe * moe.num_experts * expert,
      "active": common + num_moe * moe.top_k * expert,
  }


def executed_flops_per_device(config: Config, plan: ParallelPlan) -> ForwardFlops:
  """FLOPs one device executes per training step, by part (forward, backward and remat together)."""
  m, t = config.model, config.train
  split = lambda *logical: plan.axis_size(parallel.all_axes(plan.activation_spec(logical)))
  useful = forward_flops(m, t.global_batch_size, t.seq_len)
  per_device = {name: value / plan.mesh.size for name, value in vars(useful).items()}
  # Work done once per group of devices holding the same tokens is repeated on each of them.
  per_device["router"] = useful.router / split("act_batch", "act_seq")
  per_device["logits"] = useful.logits / split("act_batch", "act_seq", "act_vocab")
  for name in ("attention_projections", "dense_mlp", "shared_experts"):
    per_device[name] = 0.0
  for block in projection_blocks(config):
    per_device[_flops_part(block.name)] += _block_tokens(config, plan, block) * block.layers * block.flops_per_token
  n = plan.axis_size(plan.attention_axes())
  dense_scores = useful.attention_scores * t.seq_len / (t.seq_len + 1) * 2  # all S x S pairs
  attention = plan.ops["attention"]
  causal_blocks = attention.implementation in ("allgather", "zigzag_ring")
  computed = (2 * n + 1) / (4 * n) if n > 1 and causal_blocks else 1.0
  if attention_in_kernels(attention) and attention.implementation in ("local", "ulysses"):
    # A flash kernel over the whole sequence skips the key blocks a query block cannot see: the causal
    # half, plus the diagonal blocks' masked half.
    computed = (t.seq_len + FLASH_BLOCK) / (2 * t.seq_len)
  # Under MLA, values narrower than queries (or the other way) are padded to the wider: both products run
  # at that width.
  qk, v = _score_widths(m)
  padded = 2 * attention_width(m) / (qk + v)
  per_device["attention_scores"] = dense_scores * computed * padded / plan.mesh.size
  per_device["routed_experts"] = _expert_flops(config, plan)
  forward = ForwardFlops(**per_device)
  recompute = {"none": 0.0, "full": 1.0, "dots": 0.0}[m.remat]
  scale = {name: 3.0 + recompute for name in per_device}
  # Under remat "full" the layer's last matmul, the MLP's (or shared experts') out-projection, is not run
  # again: its result is the layer's output, which no gradient reads (jax's remat recomputes only what the
  # backward uses; cost_collectives.py's ring passes alike).
  not_recomputed = {name: 0.0 for name in per_device}
  if recompute:
    for block in projection_blocks(config):
      if block.ends_layer:
        out = 2 * block.weight_out[1] * block.weight_out_width
        not_recomputed[_flops_part(block.name)] += _block_tokens(config, plan, block) * block.layers * out
  # The output layer runs outside the remat'd layer loop, and its loss computes the logits' gradients in the
  # forward chunks (models/output.py): forward, input and weight gradient, whatever the remat policy.
  scale["logits"] = 3.0
  if m.remat == "dots":  # dots with batch dimensions (attention, per-tile expert GEMMs) and custom-call
    scale["attention_scores"] = 4.0  # kernels are recomputed
  if attention_in_kernels(attention):
    # Flash attention's backward recomputes the scores: 5 GEMMs against the plain backward's 4.
    scale["attention_scores"] += 0.5
  scale["routed_experts"] = expert_flops_scale(config, plan)
  return ForwardFlops(**{name: scale[name] * value - not_recomputed[name] for name, value in vars(forward).items()})


def expert_flops_scale(config: Config, plan: ParallelPlan) -> float:
  """The routed experts' executed FLOPs per forward pass's: forward, input and weight gradients, the forward
  again under remat ("dots" too: its per-tile expert GEMMs have batch dimensions), and the SwiGLU gradient
  kernel's recomputed gate and up (2 of the 3 GEMMs)."""
  scale = _expert_passes(config.model.remat)
  if cost_kernels.swiglu_recomputed(plan.ops.get("moe")):
    scale += 2 / 3
  return scale


def _expert_passes(remat: str) -> float:
  """Passes over the routed experts' GEMMs per step: forward, input and weight gradients, and the forward
  again under remat ("dots" too: the expert GEMMs are not the dots it keeps)."""
  return 3.0 + (remat != "none")


# Key/value rows per block of tokamax's flash attention kernels (the unit of their causal skipping).
FLASH_BLOCK = 128


def attention_in_kernels(choice) -> bool:
  """Whether attention's blocks are a flash-attention kernel on a GPU (custom calls the HLO cannot show)."""
  return choice.kernel_backend in ("mosaic", "triton")


def _expert_flops(config: Config, plan: ParallelPlan, worst_case: bool = False) -> float:
  """Forward FLOPs of one device's routed-expert GEMMs, as the dispatch lays them out: under balanced
  routing, or with `worst_case` the most the buffers allow (where that differs: kernels that skip
  empty tiles)."""
  m, moe, t = config.model, config.model.moe, config.train
  num_moe = m.num_layers - m.num_dense_layers
  if not num_moe:
    return 0.0
  micro = t.global_batch_size // t.grad_accum_steps
  lay = plan.expert_layout()
  choice = plan.ops["moe"]
  token_split = plan.axis_size(parallel.all_axes(plan.activation_spec(("act_batch", "act_seq"))))
  # Tokens this device routes: its share, gathered over the expert-width axes that also split tokens.
  assignments = micro * t.seq_len // token_split * plan.axis_size(lay.gather) * moe.top_k
  local_experts = moe.num_experts // lay.ep
  # The receive buffer of a chunk of `tokens` tokens: the dropless worst case, or capped
  # (`parallel.moe_buffer_factor`; expert_parallel.receive_rows).
  buffer_rows = lambda tokens: expert_parallel.receive_rows(tokens, moe.top_k, local_experts, lay.ep,
                                                            choice.buffer_factor)
  rows = buffer_rows(assignments // moe.top_k)
  tile_rows = cost_kernels.tile_rows(choice)
  if cost_kernels.in_custom_calls(choice) and worst_case:
    _, computed_rows = cost_kernels.moe_buffer_rows(assignments, lay.ep, local_experts, tile_rows)
  elif cost_kernels.in_custom_calls(choice):
    computed_rows, _ = cost_kernels.moe_rows(assignments, lay.ep, local_experts, tile_rows)  # used tiles only
  elif choice.implementation == "fused":  # the kernels' plain-XLA versions multiply every buffer tile
    _, computed_rows = cost_kernels.moe_buffer_rows(assignments, lay.ep, local_experts, tile_rows)
  elif cost_kernels.gemm_in_kernels(choice):  # GPU kernels: per chunk, each expert's rows in whole tiles
    chunks = moe_pipeline.chunk_sizes(assignments // moe.top_k, choice.chunks)
    tiles = cost_kernels.gemm_tiles(choice)
    computed_rows = sum(cost_kernels.kernel_worst_rows(buffer_rows(tokens), local_experts, tiles) if worst_case
                        else cost_kernels.kernel_rows(tokens * moe.top_k / local_experts, local_experts, tiles)
                        for tokens in chunks)
  elif choice.grouped_gemm == "blocked":  # each chunk's capacity blocks (and overflow tiles: worst case)
    computed_rows = sum(blocked_gemm.computed_rows(tokens * moe.top_k, buffer_rows(tokens), local_experts,
                                                   choice.block_rows, worst_case)
                        for tokens in moe_pipeline.chunk_sizes(assignments // moe.top_k, choice.chunks))
  else:  # XLA (CPU and GPU alike) rewrites ragged_dot into a dense dot over every local expert
    computed_rows = rows * local_experts
  per_step_micro = computed_rows * 2 * 3 * m.embed_dim * moe.expert_mlp_dim / plan.axis_size(lay.width_axes)
  return num_moe * per_step_micro * t.grad_accum_steps


def flops_in_kernels(config: Config, plan: ParallelPlan, worst_case: bool = False) -> dict[str, float]:
  """Of `executed_flops_per_device`, the FLOPs inside custom-call kernels, which compiled HLO does not
  show, by part: the routed experts' every GEMM (forward, input and weight gradients) when a kernel runs
  them, attention's scores and values under a flash kernel, and of a fused tensor-parallel projection the
  forward (with its remat repeat) and input-gradient GEMMs (the weight gradients are local XLA matmuls).
  Modelled: from the tiles the kernels compute (balanced routing, or `worst_case`)."""
  executed = executed_flops_per_device(config, plan)
  recompute = 1.0 if config.model.remat == "full" else 0.0
  in_kernel_passes = 2.0 + recompute  # the forward, its remat repeat and the input gradient, of 3 + recompute
  projections = 0.0
  for block in projection_blocks(config):
    tokens = _block_tokens(config, plan, block)
    flops = {"project_in": 2 * sum(width * in_width for _, width, in_width in block.weights_in),
             "project_out": 2 * block.weight_out[1] * block.weight_out_width if block.weight_out else 0}
    for direction, per_token in flops.items():
      if per_token and cost_kernels.in_custom_calls(plan.ops.get(f"{block.name}.{direction}")):
        last = direction == "project_out" and block.ends_layer  # not recomputed
        projections += (in_kernel_passes - recompute * last) * tokens * block.layers * per_token
  found = {"projections": projections, "attention": 0.0, "routed_experts": 0.0}
  if attention_in_kernels(plan.ops["attention"]):
    found["attention"] = executed.attention_scores
  moe = plan.ops.get("moe")
  if cost_kernels.in_custom_calls(moe) or cost_kernels.gemm_in_kernels(moe):
    found["routed_experts"] = executed.routed_experts
    if worst_case:
      found["routed_experts"] *= _expert_flops(config, plan, worst_case=True) / _expert_flops(config, plan)
  return found


def _block_tokens(config: Config, plan: ParallelPlan, block) -> float:
  """Tokens one device runs a projection block's matmuls for: its share of the tokens, gathered over the
  axes that split the weights and the sequence, times its weights' share (under megascale a dense MLP,
  whose width no axis splits, runs whole on every `tensor` device for the same tokens)."""
  t = config.train
  split = plan.axis_size(parallel.all_axes(plan.activation_spec(("act_batch", "act_seq"))))
  tp_axes, gathered = plan.projection_axes([names for names, _, _ in block.weights_in])
  return t.global_batch_size * t.seq_len / (split // plan.axis_size(gathered) * plan.axis_size(tp_axes))


def _flops_part(block: str) -> str:
  """The ForwardFlops field of a projection block's FLOPs."""
  return "attention_projections" if block.startswith("attention") else block


def useful_expert_flops_per_device(config: Config, plan: ParallelPlan) -> float:
  """The routed experts' useful FLOPs on one device (routed rows only, balanced), forward + backward and
  the forward again where remat recomputes them (kernels are: `executed_flops_per_device`)."""
  m, t = config.model, config.train
  return forward_flops(m, t.global_batch_size, t.seq_len).routed_experts * _expert_passes(m.remat) / plan.mesh.size


@dataclasses.dataclass(frozen=True)
class StepCost:
  """The cost model's figures for one training step of a (config, plan)."""

  model_flops: float  # useful FLOPs, whole step, all devices
  executed_flops_per_device: ForwardFlops  # by part, forward + backward + remat
  collectives: list  # cost_collectives.CollectiveCost, per device
  memory: object  # cost_memory.MemoryCost, per device


def step_cost(config: Config, plan: ParallelPlan) -> StepCost:
  """FLOPs, collectives and memory of one training step of `config` run as `plan` says."""
  t = config.train
  return StepCost(
      model_flops=train_step_flops(config.model, t.global_batch_size, t.seq_len),
      executed_flops_per_device=executed_flops_per_device(config, plan),
      collectives=cost_collectives.collective_costs(config, plan),
      memory=cost_memory.memory_per_device(config, plan))
