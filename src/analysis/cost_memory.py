"""Cost model, memory part: bytes one device holds at the peak of a training step.

- Parameters, gradients and optimizer state: exact, from each variable's shape and its placement under the
  preset (parameters and gradients by the parameter rules, AdamW's two moments by the optimizer rules:
  ZeRO-1 and FSDP split them, data parallelism replicates them). All float32.
- Activations kept for the backward pass of one micro-batch, by remat policy:
  `none` keeps every layer's intermediates; `full` keeps each layer's input and rebuilds one layer at a
  time; `dots` keeps the matmul outputs without batch dimensions (projections) and rebuilds the rest.
  Per layer, the intermediates are counted in units of this device's residual block [B, S, D]
  (normed inputs, q/k/v/o, MLP hidden units) plus the attention probabilities [B, N, S_q, S_k] in float32
  and the MoE dispatch buffers (the [ep*A, D] receive buffer, its tiled copy, the [rows, F] gate, up and
  hidden units: silu(gate) is recomputed, see dispatch.swiglu_hidden), which dominate at small sizes.
The compiled step also holds the batch, temporary buffers XLA schedules between ops and the logits;
the logits [B, S, V] in float32 and their gradient are counted, the rest is not.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.analysis import cost_kernels
from meshmoe.config import Config, resolve_mesh_sizes
from meshmoe.models.decoder import Transformer
from meshmoe.sharding.dispatch import choose_block_rows
from meshmoe.sharding.rules import get_preset, logical_to_spec
from meshmoe.sharding.shardings import logical_axes_of


@dataclasses.dataclass(frozen=True)
class MemoryCost:
  params: float
  gradients: float
  optimizer: float
  activations: float

  @property
  def total(self) -> float:
    return self.params + self.gradients + self.optimizer + self.activations


def memory_per_device(config: Config, num_devices: int, platform: str = "cpu") -> MemoryCost:
  sizes = resolve_mesh_sizes(config.mesh, num_devices)
  preset = get_preset(config.mesh.preset)
  abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
  params = nnx.state(abstract, nnx.Param)
  shapes = jax.tree.leaves(jax.tree.map(lambda v: v.get_value().shape, params, is_leaf=_is_variable),
                           is_leaf=lambda x: isinstance(x, tuple))
  names = jax.tree.leaves(logical_axes_of(params), is_leaf=lambda x: isinstance(x, tuple))

  def placed_bytes(rules) -> float:
    return sum(4 * math.prod(shape) / _shards(logical_to_spec(n, rules), sizes)
               for shape, n in zip(shapes, names))

  param_bytes = placed_bytes(preset.params)
  return MemoryCost(params=param_bytes, gradients=param_bytes,
                    optimizer=2 * placed_bytes(preset.optimizer_rules()),
                    activations=_activation_bytes(config, sizes, preset, platform))


def _activation_bytes(config: Config, sizes, preset, platform: str) -> float:
  m, t = config.model, config.train
  c = jnp.dtype(m.dtype).itemsize
  acts = preset.activations
  micro = t.global_batch_size // t.grad_accum_steps
  tokens = micro * t.seq_len / _shards(logical_to_spec(("act_batch", "act_seq"), acts), sizes)
  residual = tokens * m.embed_dim * c
  attention, qkvo = _attention_layer(config, sizes, preset, residual)
  moe_layer, moe_transient = _moe_layer(config, sizes, preset, tokens, residual, platform)
  mlp_width = m.mlp_dim / _shards(logical_to_spec(("mlp",), preset.params), sizes)
  dense_layer = 2 * residual + tokens * 3 * mlp_width * c
  num_moe = m.num_layers - m.num_dense_layers
  layers = [attention + dense_layer] * m.num_dense_layers + [attention + moe_layer] * num_moe
  if m.remat == "none":
    kept = sum(layers)
  elif m.remat == "full":
    kept = m.num_layers * residual + max(layers)
  else:  # dots: projections' outputs kept, the rest of one layer rebuilt at a time
    kept = m.num_layers * (residual + qkvo) + max(layers)
  vocab_split = _shards(logical_to_spec(("act_batch", "act_seq", "act_vocab"), acts), sizes)
  logits = 2 * micro * t.seq_len * m.vocab_size * 4 / vocab_split  # logits and their gradient
  return kept + (moe_transient if num_moe else 0.0) + logits


def _attention_layer(config: Config, sizes, preset, residual: float) -> tuple[float, float]:
  """(bytes one attention layer keeps, of which q/k/v/o)."""
  m, t = config.model, config.train
  c = jnp.dtype(m.dtype).itemsize
  acts = preset.activations
  micro = t.global_batch_size // t.grad_accum_steps
  batch_split = _shards(logical_to_spec(("act_batch",), acts), sizes)
  seq_split = _shards(logical_to_spec((None, "act_attn_seq"), acts), sizes)
  heads_split = _shards(logical_to_spec((None, None, "act_heads"), acts), sizes)
  rows = micro / batch_split * t.seq_len / seq_split
  qkvo = rows * m.head_dim * (2 * m.num_heads + 2 * m.num_kv_heads) * c / heads_split
  probs = rows * m.num_heads / heads_split * t.seq_len * 4  # each query's scores over the whole sequence
  gathered_kv = 0.0
  if seq_split > 1 and config.parallel.attention == "allgather":
    gathered_kv = 2 * micro / batch_split * t.seq_len * m.num_kv_heads / heads_split * m.head_dim * c
  return 2 * residual + qkvo + probs + gathered_kv, qkvo


def _moe_layer(config: Config, sizes, preset, tokens: float, residual: float,
               platform: str) -> tuple[float, float]:
  """(bytes one MoE layer keeps for its backward pass, bytes live only at the backward's peak, once).

  Blocked GEMM: each tile's gathered expert weights are kept; their gradients are per-tile buffers of the
  same size. Under remat the backward rebuilds one layer's gathered weights and each gradient takes the
  buffer its weight frees once used; without remat the saved weights of all layers live in one stacked
  buffer (the layer scan's) until the backward loop ends, so the gradients need buffers of their own.
  ragged_dot: XLA rewrites it into dense products over every local expert, and [E/ep, rows, F] buffers
  for gate, up and their gradients are live at the backward's peak."""
  m, moe = config.model, config.model.moe
  c = jnp.dtype(m.dtype).itemsize
  d = m.embed_dim
  ep = _shards(logical_to_spec(("exp",), preset.params), sizes)
  local_experts = moe.num_experts // ep
  width = moe.expert_mlp_dim / _shards(logical_to_spec(("exp_mlp",), preset.params), sizes)
  # Tokens are gathered over the expert-width axes that also split them (tp_sp).
  width_axes = set(_axes(logical_to_spec((None, "exp_mlp"), preset.params)))
  token_axes = _axes(logical_to_spec(("act_batch", "act_seq"), preset.activations))
  gathered = tokens * math.prod(sizes[a] for a in token_axes if a in width_axes)
  buffers = 2 * (gathered - tokens) * d * c  # the gathered tokens and their gradient
  assignments = gathered * moe.top_k
  rows = ep * assignments  # the receive buffer
  buffers += assignments * d * c * 2 + (2 * 2 * rows * d * c if ep > 1 else 0)  # copied, sent/returned
  gemm = moe.gemm_impl if moe.gemm_impl != "auto" else ("blocked" if platform == "cpu" else "ragged_dot")
  if cost_kernels.moe_kernels_apply(config, platform, ep, width):
    # The tile plan's buffers: send and returned rows, received rows with their gate, up and hidden units;
    # the backward's dispatched gradients [R, D + F] are transient.
    send_rows, receive_rows = cost_kernels.moe_buffer_rows(int(assignments), ep, local_experts)
    buffers = 2 * (gathered - tokens) * d * c + assignments * d * c * 2 + 2 * send_rows * d * c
    hidden = receive_rows * (d + 3 * width) * c
    return 2 * residual + buffers + hidden + gathered * moe.num_experts * 4 * 3, receive_rows * (d + width) * c
  if gemm == "blocked":
    height = moe.gemm_block_rows or choose_block_rows(int(rows), local_experts)
    tiles = (rows + local_experts * (height - 1)) // height
    tiled_rows = tiles * height
    weights = 3 * tiles * d * width * c
    transient = weights if m.remat == "none" else 0.0
  else:
    tiled_rows, weights = rows, 0.0
    transient = 4 * local_experts * rows * width * c
  hidden = tiled_rows * (2 * d + 3 * width) * c  # tile inputs and outputs, gate/up/hidden units
  router = gathered * moe.num_experts * 4 * 3
  return 2 * residual + buffers + hidden + weights + router, transient


def _axes(spec) -> list[str]:
  return [a for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)]


def _shards(spec, sizes) -> int:
  return math.prod(sizes[a] for a in _axes(spec))


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)
