"""Cost model, memory part: bytes one device holds at the peak of a training step.

- Parameters, gradients and optimizer state: exact, from each variable's shape and its placement under the
  preset (parameters and gradients by the parameter rules, the optimizer's statistics by the optimizer
  rules: ZeRO-1 and FSDP split them, data parallelism replicates them; AdamW keeps two per element, Muon
  one for its matrices, Lion one, Adafactor a row and a column for a factored weight: their shapes read
  from optax's own state, training/optimizer.statistic_shapes). All float32 (the statistics in
  `optimizer.moments_dtype`); with gradient accumulation
  the gradients twice (the running sum and the current micro-batch's). Counted with the optimizer state:
  the error-feedback residual of a compressed gradient sum (one float32 copy of the device's expert weights;
  the per-replica copies of the weights themselves are views of the parameters, and their gradient takes
  the place of the parameters'). Under a distributed optimizer (`mesh.optimizer_storage`;
  training/master_weights.py) the parameters are the resident copy in each weight's compute dtype where the
  parameter rules put it, and the optimizer state is the float32 master and both moments where the
  optimizer rules put them, with the gradients' float32 sum (and one micro-batch's, in the compute dtype).
- Activations kept for the backward pass of one micro-batch, by remat policy:
  `none` keeps every layer's intermediates (with the float32 copies the norms and routers make:
  `_float32_norm_copies`); `full` keeps each layer's input and rebuilds one layer at a time; `dots` keeps
  the matmul outputs without batch dimensions (projections) and rebuilds the rest.
  Per layer, the intermediates are counted in units of this device's residual block [B, S, D]
  (normed inputs, q/k/v/o, MLP hidden units) plus the attention probabilities [B, N, S_q, S_k] in float32
  (under a flash-attention kernel only its output and softmax statistics) and the MoE dispatch buffers
  (the [ep*S, D] receive buffer, its tiled copy, the [rows, F] gate, up and hidden units: silu(gate) is
  recomputed, see sharding/grouped_ffn.py swiglu_hidden), which dominate at small sizes; the token
  exchanges' own buffers live for one layer at a time. Which buffers exist is the parallel plan's choice of
  implementation (meshmoe.sharding.plan).
The compiled step also holds the batch, temporary buffers XLA schedules between ops and the output layer's
logits; the logits are counted (one chunk of them in float32, and the weight-gradient part the chunks sum
into: `_output_layer`), the rest is not.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.analysis import cost_collectives, cost_kernels
from meshmoe.config import Config
from meshmoe.models import output
from meshmoe.models.decoder import Transformer
from meshmoe.sharding import blocked_gemm, expert_parallel, moe_pipeline, parallel
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.projection_blocks import attention_width
from meshmoe.training import master_weights
from meshmoe.training import optimizer as optimizer_lib


@dataclasses.dataclass(frozen=True)
class MemoryCost:
  params: float
  gradients: float
  optimizer: float
  activations: float

  @property
  def total(self) -> float:
    return self.params + self.gradients + self.optimizer + self.activations


def memory_per_device(config: Config, plan: ParallelPlan) -> MemoryCost:
  shapes, names, paths = _parameters(config.model)
  float32 = [4] * len(shapes)

  def placed_bytes(spec_of, itemsizes=float32) -> float:
    return sum(size * math.prod(shape) / _shards(plan, spec_of(n))
               for shape, n, size in zip(shapes, names, itemsizes))

  accumulating = config.train.grad_accum_steps > 1
  activations = _activation_bytes(config, plan)
  if config.model.remat == "none":
    activations += _layer_weight_copies(config, plan, shapes, names)
  if plan.distributed_optimizer:
    # The weights in their compute dtype where the parameter rules put them; the float32 master, the
    # moments and the gradients' float32 sum where the optimizer rules put them, with each micro-batch's
    # gradient (compute dtype) summed into those slices (training/master_weights.py).
    compute = [master_weights.compute_dtype(path, n, config.model.dtype).itemsize for path, n in zip(paths, names)]
    param_bytes, master = placed_bytes(plan.param_spec, compute), placed_bytes(plan.optimizer_spec)
    gradients = master + (placed_bytes(plan.optimizer_spec, compute) if accumulating else 0.0)
    optimizer = master + _statistics_bytes(config, plan, shapes, names)
  else:
    param_bytes = placed_bytes(plan.param_spec)
    # With gradient accumulation the micro-batch loop carries the float32 sum beside each micro-batch's.
    gradients = param_bytes * (2 if accumulating else 1)
    optimizer = _statistics_bytes(config, plan, shapes, names)
  experts = sum(math.prod(shape) / _shards(plan, plan.weight_spec(n)) for shape, n in zip(shapes, names)
                if "exp" in n)
  if plan.gradient_feedback:  # gradient_sync.py's error-feedback residual, float32, beside the optimizer state
    optimizer += 4 * experts
  return MemoryCost(params=param_bytes, gradients=gradients, optimizer=optimizer, activations=activations)


def _parameters(model) -> tuple[list[tuple[int, ...]], list[tuple[str | None, ...]], list[list[str]]]:
  """Every parameter's shape, logical axis names and path: an abstract model traced once per model config
  (the planner asks for thousands of layouts of one), keyed by its repr (configs are mutable, so unhashable)."""
  key = repr(model)
  if key not in _PARAMETERS:
    abstract = nnx.eval_shape(lambda: Transformer(model, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_variable)[0]
    if len(_PARAMETERS) > 16:
      _PARAMETERS.clear()
    _PARAMETERS[key] = ([v.get_value().shape for _, v in leaves],
                        [tuple(v.get_metadata().get("logical_axes", ())) for _, v in leaves],
                        [master_weights.path_names(path) for path, _ in leaves])
  return _PARAMETERS[key]


_PARAMETERS: dict[str, tuple[list, list, list]] = {}


def _statistics_bytes(config: Config, plan: ParallelPlan, shapes, names) -> float:
  """The optimizer's statistics on one device (float32, or `optimizer.moments_dtype`), each placed as
  optimizer.statistic_spec says beside its parameter's optimizer placement (their shapes read from optax's
  state once per model and optimizer)."""
  key = repr((config.model, config.optimizer))
  if key not in _STATISTICS:
    abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
    if len(_STATISTICS) > 16:
      _STATISTICS.clear()
    _STATISTICS[key] = optimizer_lib.statistic_shapes(config.optimizer, nnx.state(abstract, nnx.Param))
  itemsize = jnp.dtype(config.optimizer.moments_dtype).itemsize  # every statistic is kept in it
  total = 0.0
  for shape, n, statistics in zip(shapes, names, _STATISTICS[key]):
    spec = plan.optimizer_spec(n)
    for statistic in statistics:
      placed = optimizer_lib.statistic_spec(spec, shape, statistic)
      total += itemsize * math.prod(statistic) / (1 if placed is None else _shards(plan, placed))
  return total


_STATISTICS: dict[str, list[list[tuple[int, ...]]]] = {}


def _layer_weight_copies(config: Config, plan: ParallelPlan, shapes, names) -> float:
  """Without remat, the backward pass reads each layer's weights as its ops used them. Where those are new
  values (gathered from their FSDP shards, or cast to the compute dtype where the stored weights are the
  float32 parameters), the layer scan keeps one per layer; weights used as stored are read from the stacked
  parameters (and gathered again where `cost_collectives.weights_regathered`)."""
  c = jnp.dtype(config.model.dtype).itemsize
  experts_regathered = cost_collectives.weights_regathered(config, plan, experts=True)
  copies = 0.0
  for shape, logical in zip(shapes, names):
    if not logical or logical[0] != "layers" or (experts_regathered and "exp" in logical):
      continue
    gathered = _shards(plan, plan.weight_spec(logical)) != _shards(plan, plan.param_spec(logical))
    if gathered or (c != 4 and not plan.distributed_optimizer):  # resident weights are cast already
      copies += c * math.prod(shape) / _shards(plan, plan.weight_spec(logical))
  return copies


def _activation_bytes(config: Config, plan: ParallelPlan) -> float:
  m, t = config.model, config.train
  c = jnp.dtype(m.dtype).itemsize
  micro = t.global_batch_size // t.grad_accum_steps
  tokens = micro * t.seq_len / _shards(plan, plan.activation_spec(("act_batch", "act_seq")))
  residual = tokens * m.embed_dim * c
  attention, projections = _attention_layer(config, plan, residual)
  moe_layer, moe_transient = _moe_layer(config, plan, tokens, residual)
  mlp_width = m.mlp_dim / _shards(plan, plan.param_spec(("mlp",)))
  dense_layer = 2 * residual + tokens * 3 * mlp_width * c
  num_moe = m.num_layers - m.num_dense_layers
  layers = [attention + dense_layer] * m.num_dense_layers + [attention + moe_layer] * num_moe
  if m.remat == "none":
    kept = sum(layers) + _float32_norm_copies(config, plan, tokens)
  elif m.remat == "full":
    kept = m.num_layers * residual + max(layers)
  else:  # dots: projections' outputs kept, the rest of one layer rebuilt at a time
    kept = m.num_layers * (residual + projections) + max(layers)
  return kept + (moe_transient if num_moe else 0.0) + _output_layer(config, plan)


def moe_tokens_per_device(config: Config, plan: ParallelPlan) -> float:
  """Tokens one device routes through an MoE layer per micro-batch: its share of the residual stream's,
  gathered over the expert-width axes that also split the tokens (tp_sp); what the xla tier's MoE pipeline
  cuts into `parallel.moe_chunks` chunks."""
  t = config.train
  micro = t.global_batch_size // t.grad_accum_steps
  tokens = micro * t.seq_len / _shards(plan, plan.activation_spec(("act_batch", "act_seq")))
  return tokens * plan.axis_size(plan.expert_layout().gather)


def _float32_norm_copies(config: Config, plan: ParallelPlan, tokens: float) -> float:
  """Without remat, what the layers keep in float32 for their backward pass beside the compute-dtype
  intermediates: every RMSNorm (models/layers.py normalises in float32) its input and normalised value,
  and every router its float32 input (models/router.py). XLA saves these converts rather than recomputing
  them: five float32 [B, S, D] per layer of moe_1b's compiled step, 5 GB of its 25."""
  m = config.model
  d = m.embed_dim
  num_moe = m.num_layers - m.num_dense_layers
  per_layer = 2 * 2 * tokens * d * 4  # the attention's and the FFN's norms
  if m.attention == "mla":
    per_layer += 2 * tokens * (m.q_lora_rank + m.kv_lora_rank) * 4
  elif m.qk_norm:
    heads_split = _shards(plan, plan.activation_spec((None, None, "act_heads")))
    per_layer += 2 * tokens * (m.num_heads + m.num_kv_heads) * attention_width(m) / heads_split * 4
  routed = 0.0
  if num_moe:
    routed = num_moe * tokens * plan.axis_size(plan.expert_layout().gather) * d * 4
  return m.num_layers * per_layer + routed


def _output_layer(config: Config, plan: ParallelPlan) -> float:
  """Bytes the loss's output layer adds at the peak (models/output.py): one chunk's float32 logits (their
  gradient, softmax - one-hot, takes the same buffer), and with several chunks this device's part of the
  weight gradient [D, V] float32 (the vocabulary split as the logits'), summed over the chunks."""
  m, t = config.model, config.train
  micro = t.global_batch_size // t.grad_accum_steps
  batch, seq, vocab = plan.activation_sharding(output.LOGITS).shard_shape((micro, t.seq_len, m.vocab_size))
  nb, ns = cost_collectives.output_chunks(config, plan)
  chunk = batch * seq // (nb * ns) * vocab * 4
  return chunk + (m.embed_dim * vocab * 4 if nb * ns > 1 else 0.0)


def _attention_layer(config: Config, plan: ParallelPlan, residual: float) -> tuple[float, float]:
  """(bytes one attention layer keeps, bytes of its projections' outputs, what remat "dots" keeps)."""
  m, t = config.model, config.train
  c = jnp.dtype(m.dtype).itemsize
  micro = t.global_batch_size // t.grad_accum_steps
  batch_split = _shards(plan, plan.activation_spec(("act_batch",)))
  seq_split = _shards(plan, plan.activation_spec((None, "act_attn_seq")))
  heads_split = _shards(plan, plan.activation_spec((None, None, "act_heads")))
  rows = micro / batch_split * t.seq_len / seq_split
  width = attention_width(m)
  qkvo = rows * width * (2 * m.num_heads + 2 * m.num_kv_heads) * c / heads_split
  if m.attention == "mla":  # and the latents the up-projections read (the gathered rows of each)
    qkvo += rows * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) * c
  # Each query's scores over the whole sequence, twice: autodiff of the einsum blocks' softmax keeps the
  # exponentials and the normalised probabilities.
  probs = 2 * rows * m.num_heads / heads_split * t.seq_len * 4
  if plan.ops["attention"].kernel_backend in ("mosaic", "triton"):
    # A flash kernel keeps no scores: its output and float32 log-sum-exp statistics (max, denominator).
    probs = rows * m.num_heads / heads_split * (width * c + 2 * 4)
  gathered_kv = 0.0
  if seq_split > 1 and plan.ops["attention"].implementation == "allgather":
    gathered_kv = 2 * micro / batch_split * t.seq_len * m.num_kv_heads / heads_split * width * c
  # What `dots` keeps: the projections' outputs, q, k and v, and the out-projection's [B, S, D] (not the
  # heads' [B, S, H, head_dim] it reads, an einsum's output with batch dimensions: where H x head_dim is
  # not D, Qwen3's 4096 against 2048, the two differ).
  projections = qkvo - rows * width * m.num_heads * c / heads_split + residual
  return 2 * residual + qkvo + probs + gathered_kv, projections


def _moe_layer(config: Config, plan: ParallelPlan, tokens: float, residual: float) -> tuple[float, float]:
  """(bytes one MoE layer keeps for its backward pass, bytes live only at the backward's peak, once).

  Blocked GEMM: each tile's gathered expert weights are kept; their gradients are per-tile buffers of the
  same size. Under remat the backward rebuilds one layer's gathered weights and each gradient takes the
  buffer its weight frees once used; without remat the saved weights of all layers live in one stacked
  buffer (the layer scan's) until the backward loop ends, so the gradients need buffers of their own.
  tokamax: the receive buffer as is, and the backward's [R, 2F] gate/up cotangent. ragged_dot: XLA
  rewrites it into dense products over every local expert, and [E/ep, rows, F] buffers for gate, up and
  their gradients are live at the backward's peak."""
  choice = plan.ops.get("moe")
  if choice is None:  # no MoE layer
    return 0.0, 0.0
  m, moe = config.model, config.model.moe
  c = jnp.dtype(m.dtype).itemsize
  d = m.embed_dim
  experts = plan.expert_layout()
  ep = experts.ep
  local_experts = moe.num_experts // ep
  width = moe.expert_mlp_dim / plan.axis_size(experts.width_axes)
  # Tokens are gathered over the expert-width axes that also split them (tp_sp).
  gathered = tokens * plan.axis_size(experts.gather)
  buffers = 2 * (gathered - tokens) * d * c  # the gathered tokens and their gradient
  assignments = gathered * moe.top_k
  # The receive buffer: the dropless worst case, or capped (`parallel.moe_buffer_factor`).
  rows = expert_parallel.receive_rows(gathered, moe.top_k, local_experts, ep, choice.buffer_factor)
  slots = ep * expert_parallel.peer_slot(gathered, moe.top_k, local_experts)  # the worst case's [ep, S]
  buffers += assignments * d * c * 2  # copied rows
  # The exchanges' buffers, with their cotangents: the receive buffer and the returned rows, [ep, S] padded
  # slots on CPU (which moves them whole even where the buffer is capped, then copies the rows it keeps),
  # the assignments' [A] rows where ragged_all_to_all returns them (expert_parallel.py).
  # Ragged exchanges' buffers live while one layer runs, not until the backward pass, whose exchanges move
  # cotangents and read neither (compiled deviceless, Mixtral-8x7B without remat keeps no layer's copy:
  # RESULTS.md); XLA:CPU keeps the padded ones of every layer (tests/test_cost_model.py).
  ragged = choice.exchange == "ragged_all_to_all"
  returned = assignments if ragged else slots
  exchange = 2 * ((rows if ragged else slots) + returned) * d * c if ep > 1 else 0.0
  if not ragged:
    buffers, exchange = buffers + exchange + (2 * rows * d * c if rows < slots else 0.0), 0.0
  if choice.implementation == "fused":
    # The tile plan's buffers: send and returned rows, received rows with their hidden units (and gate and
    # up unless the kernels recompute them); the backward's dispatched gradients [R, D + F] are transient,
    # and when recomputing the gate and up gradients [R, 2F] the SwiGLU gradient kernel writes.
    tile_rows = cost_kernels.tile_rows(choice)
    send_rows, receive_rows = cost_kernels.moe_buffer_rows(int(assignments), ep, local_experts, tile_rows)
    buffers = 2 * (gathered - tokens) * d * c + assignments * d * c * 2 + 2 * send_rows * d * c
    recomputed = cost_kernels.swiglu_recomputed(choice)
    hidden = receive_rows * (d + (1 if recomputed else 3) * width) * c
    transient = receive_rows * (d + (3 if recomputed else 1) * width) * c
    weights = 0.0
    if cost_kernels.in_custom_calls(choice):
      transient += _gather_transposes(config, plan)
    else:
      # The kernels' plain-XLA versions (reference.py) multiply every receive tile by its expert's weights,
      # gathered per tile and kept for the backward pass as the blocked GEMM's are, and all-gather every
      # device's send and receive buffers.
      weights = 3 * receive_rows // tile_rows * d * width * c
      transient += (weights if m.remat == "none" else 0.0) + ep * (send_rows + receive_rows) * d * c
    return 2 * residual + buffers + hidden + weights + gathered * moe.num_experts * 4 * 3, transient
  if choice.grouped_gemm == "blocked":
    # The blocks and overflow tiles (sharding/blocked_gemm.py) read the rows in place and keep gate and up
    # of every chunk's rows, by sorted position, plus one tile of slack; the output rows are [R, D].
    kept_rows = sum(expert_parallel.receive_rows(tokens, moe.top_k, local_experts, ep, choice.buffer_factor)
                    + (choice.block_rows or blocked_gemm.DEFAULT_TILE_ROWS)
                    for tokens in moe_pipeline.chunk_sizes(int(gathered), choice.chunks))
    hidden = rows * d * c + 2 * kept_rows * width * c
    router = gathered * moe.num_experts * 4 * 3
    # The GEMMs read one layer's weights sliced out of the stacked parameters (a copy: a loop cannot read a
    # slice in place). The backward adds the input gradient [R, D], float32 weight-gradient sums, and the
    # blocks' operands and results: rows, their cotangents and input gradients [E, C, D], gate, up, the
    # hidden units, their cotangents and dgate, dup [E, C, F].
    layer_weights = 3 * local_experts * d * width
    blocks = sum(local_experts * blocked_gemm.capacity_rows(tokens * moe.top_k, local_experts)
                 for tokens in moe_pipeline.chunk_sizes(int(gathered), choice.chunks))
    transient = layer_weights * (c + 4) + rows * d * c + blocks * (3 * d + 6 * width) * c + exchange
    return 2 * residual + buffers + hidden + router, transient
  elif choice.grouped_gemm == "kernels":  # the receive buffer as is; the kernels make no dense intermediate
    logical = ("exp", "embed", "exp_mlp")
    tiled_rows, weights = rows, 0.0
    # The backward's gate/up cotangent [R, 2F], and the stacked experts' weights of every layer transposed:
    # the input gradient multiplies by each layer's transposed (cast) weights, and XLA's layout assignment
    # transposes the stored float32 stack once for all layers instead (seen on every moe_1b layout with
    # remat). Without remat the layer loop keeps each layer's cast (and gathered) weights and XLA transposes
    # those compute-dtype copies (moe_1b, dp and fsdp on 8 H100s: bf16[16, 32, 1024, 1024] and
    # [16, 32, 1024, 512] transposed), besides any float32 stack GSPMD gathers from (`_gather_transposes`).
    elements = 3 * (m.num_layers - m.num_dense_layers) * moe.num_experts * d * moe.expert_mlp_dim
    stored = elements * _stored_itemsize(config, plan) / _shards(plan, plan.param_spec(logical))
    if m.remat == "none":
      stored = elements * c / _shards(plan, plan.weight_spec(logical)) + _gather_transposes(config, plan)
    transient = 2 * rows * width * c + stored + exchange
  else:  # XLA's ragged_dot: dense over every local expert
    tiled_rows, weights = rows, 0.0
    transient = 4 * local_experts * rows * width * c + exchange
  hidden = tiled_rows * (2 * d + 3 * width) * c  # tile inputs and outputs, gate/up/hidden units
  router = gathered * moe.num_experts * 4 * 3
  return 2 * residual + buffers + hidden + weights + router, transient


def _gather_transposes(config: Config, plan: ParallelPlan) -> float:
  """Expert weights stored split along `embed` over axes that do not split the tokens reach the MoE op
  whole along it, gathered by GSPMD at the op's boundary: XLA all-gathers each layer's slice along `embed`,
  which it first makes the major dimension, and it transposes the stacked float32 weights of all layers
  once, outside the layer loop: one such stack per expert matrix (gate, up, down). The op gathers the other
  storage axes itself, along a new leading dimension (expert_parallel._gather_stored): no transposed stack."""
  logical = ("exp", "embed", "exp_mlp")
  stored, used = _shards(plan, plan.param_spec(logical)), _shards(plan, plan.weight_spec(logical))
  if stored == used * plan.axis_size(plan.expert_layout().weight_gather):
    return 0.0
  m, moe = config.model, config.model.moe
  return (3 * (m.num_layers - m.num_dense_layers) * moe.num_experts * m.embed_dim * moe.expert_mlp_dim
          * _stored_itemsize(config, plan) / stored)


def _stored_itemsize(config: Config, plan: ParallelPlan) -> int:
  """Bytes per element of the weights the layers read: float32 parameters, or a distributed optimizer's
  copy in the compute dtype."""
  return jnp.dtype(config.model.dtype).itemsize if plan.distributed_optimizer else 4


def _shards(plan: ParallelPlan, spec) -> int:
  return plan.axis_size(parallel.all_axes(spec))


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)
