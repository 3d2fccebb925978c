"""Cost model, communication part: the bytes each collective of a training step moves, per device.

Derived from the parallel plan the ops run by (meshmoe.sharding.plan: its rules, layouts and each op's
implementation) and the same per-op algorithms as the parallel ops (sharding/), so a change in either
shows up as a mismatch against the compiled HLO (tests/test_cost_model.py). Bytes are
counted as in hlo_collectives.py (e.g. an all-gather moves (g-1)/g of its result). Per layer and
micro-batch, forward then backward (the transpose of each op: all-gather <-> reduce-scatter, all-to-all
<-> all-to-all, psum <-> nothing); recomputation under remat repeats the forward's collectives.

Weight gradients: a weight that enters an op whole on devices that compute different tokens gets its
gradient summed over those devices inside the op's backward (an all-reduce per micro-batch); that is data
parallelism's gradient all-reduce (twice per MoE layer under the two-halves layer schedule, which calls
each op once per half). Weights outside the explicit ops (embedding, output projection, router,
norms) are handled by GSPMD the same way. Where the plan compresses the routed experts' sum over their
replicas (sharding/gradient_sync.py), it is an all-to-all and an all-gather (or a bfloat16 all-reduce)
per weight and micro-batch for all layers, after the layer loop. Under a distributed optimizer
(`mesh.optimizer_storage`) the sum lands in the optimizer's slices: a reduce-scatter over the axes its
storage adds, per micro-batch (the router's too, and on GPUs the untied output table's where its vocabulary
is split over token axes: `_output_table_gradient`), and the weights are gathered from the master once per
step.

Not modelled (small, and listed so nobody hunts for them): int32 routing and position arrays moved by
GSPMD for the zigzag permutation and capacity priority, a capped receive buffer's float32 max of its use
over the devices per layer, scalar loss reductions, the gathers GSPMD adds around the vocabulary-parallel
logits of `tp_sp`, and under MLA with remat the recomputed forward's gather of the rotary cos/sin tables.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math

import jax.numpy as jnp

from meshmoe.analysis import cost_kernels
from meshmoe.analysis.hlo_collectives import moved_bytes
from meshmoe.config import Config
from meshmoe.models import output
from meshmoe.sharding import embedding_lookup, exchange_formats, expert_parallel, gradient_sync, moe_pipeline
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.projection_blocks import attention_weights, attention_width, projection_blocks


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
  op: str  # which parallel op issues it ("<block>.projections" for a tensor-parallel block), or "gradients"
  kind: str  # HLO name (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute), or one of
  # cost_kernels.FUSED_KINDS for communication inside a fused kernel
  group_size: int
  bytes: float  # per device, per training step, all occurrences together (as the HLO count has them)
  axes: tuple[str, ...] = ()  # the mesh axes of its groups (which links it crosses: the planner's timing)
  # What the links carry where it is less than `bytes`: a ragged exchange is counted by its output buffer,
  # sized for the dropless worst case (every peer's rows could come to one device), but moves only the rows
  # routing sends, the other devices' share of them with balanced routing. None: `bytes`.
  link_bytes: float | None = None

  @property
  def transferred(self) -> float:
    """Bytes one device sends over its links per step (the planner's timing)."""
    return self.bytes if self.link_bytes is None else self.link_bytes


class _Layout:
  """Mesh-axis arithmetic for one config and plan: which axes split what, and local sizes."""

  def __init__(self, config: Config, plan: ParallelPlan):
    self.config, self.plan = config, plan

  def act(self, *logical) -> list[tuple[str, ...]]:
    return _dims(self.plan.activation_spec(logical))

  def weight(self, *logical) -> list[tuple[str, ...]]:
    """Placement inside the parallel ops (`embed` whole)."""
    return _dims(self.plan.weight_spec(logical))

  def stored(self, *logical) -> list[tuple[str, ...]]:
    return _dims(self.plan.param_spec(logical))

  def updated(self, *logical) -> list[tuple[str, ...]]:
    return _dims(self.plan.optimizer_spec(logical))

  def size(self, axes) -> int:
    return self.plan.axis_size(axes)

  def in_mesh_order(self, axes) -> tuple[str, ...]:
    return tuple(a for a in self.plan.mesh.axis_names if a in axes)

  @property
  def expert_axes(self) -> tuple[str, ...]:
    """The axes of the expert-parallel groups (their product is `ep`)."""
    return self.plan.expert_layout().expert_axes


def _dims(spec) -> list[tuple[str, ...]]:
  return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def collective_costs(config: Config, plan: ParallelPlan) -> list[CollectiveCost]:
  """Every collective of one training step (all micro-batches), per device, as the plan runs the ops."""
  lay = _Layout(config, plan)
  m, moe, t = config.model, config.model.moe, config.train
  c = jnp.dtype(m.dtype).itemsize
  micro = t.global_batch_size // t.grad_accum_steps
  batch_axes, seq_axes, _ = lay.act("act_batch", "act_seq", None)
  b_local, s_local = micro // lay.size(batch_axes), t.seq_len // lay.size(seq_axes)
  residual = b_local * s_local * m.embed_dim * c  # bytes of this device's residual block
  costs: list[CollectiveCost] = []
  forward_repeats = 1 if m.remat == "none" else 2  # remat recomputes the forward, collectives included

  def add(op, kind, axes, nbytes, forward: bool, link_bytes: float | None = None, label: str | None = None,
          recomputed: bool = True):
    count = t.grad_accum_steps * (forward_repeats if forward and recomputed else 1) * per_layer[op]
    group = lay.size(axes)
    if group > 1 and nbytes:
      # A fused kernel's bytes are its own accounting of what it moves; a collective's, its result size.
      moved = nbytes if kind in cost_kernels.FUSED_KINDS else moved_bytes(kind, group, nbytes)
      link = None if link_bytes is None else count * link_bytes
      costs.append(CollectiveCost(label or op, kind, group, count * moved, tuple(axes), link))

  num_moe = m.num_layers - m.num_dense_layers
  per_layer = {"attention": m.num_layers, "dense_mlp": m.num_dense_layers,
               "shared_experts": num_moe if moe.num_shared_experts else 0, "moe": num_moe,
               "gradients": 1}
  blocks = projection_blocks(config)
  per_layer.update({block.name: block.layers for block in blocks})

  for block in blocks:
    tp_axes, gather = plan.projection_axes([names for names, _, _ in block.weights_in])
    g = lay.size(gather)
    gathered = residual * block.gathered // m.embed_dim  # what project_in gathers (MLA: the latents)
    directions = {"project_in": (gathered, block.gathered)}
    if block.weight_out:
      directions["project_out"] = (residual, m.embed_dim)
    # Under remat the layer's last op, the MLP's (or shared experts') project_out, is not run again: its
    # result is the layer's output, which no gradient reads (compiled deviceless, DeepSeek-V3: the recomputed
    # forward's ring passes stop before it).
    last = block.ends_layer
    for direction, (nbytes, width) in directions.items():
      out_last = functools.partial(add, recomputed=not (last and direction == "project_out"))
      _projection(out_last, block.name, direction, plan.ops[f"{block.name}.{direction}"], gather, g, nbytes,
                  cost_kernels.projection_bytes(g, b_local * s_local, width, c))
    r = tuple(a for a in tp_axes if a not in gather)
    label = projection_label(block.name)
    if block.weight_out:  # project_out's psum over axes that do not split tokens
      add(block.name, "all-reduce", r, residual, True, label=label, recomputed=not last)
    add(block.name, "all-reduce", r, gathered, False, label=label)  # project_in's input gradient over the same axes
  _attention(lay, add, c, micro)
  if num_moe:
    _moe(lay, add, c, residual)
  _weight_gradients(lay, costs)
  _weight_gathers(lay, costs)
  _embedding_lookup(lay, costs, micro, batch_axes, seq_axes)
  return costs


def projection_label(block: str) -> str:
  """The `op` of a tensor-parallel block's collectives: the block's name and ".projections" (attention's
  block would otherwise share "attention" with the context-parallel attention's own collectives)."""
  return f"{block}.projections"


def _projection(add, block: str, direction: str, choice, axes, g: int, residual: int, kernel_bytes: float) -> None:
  """One direction of a tensor-parallel block, forward and backward (each kernel's or collective's
  transpose is the other direction's: all-gather <-> reduce-scatter)."""
  gathers = direction == "project_in"
  add = functools.partial(add, label=projection_label(block))
  if cost_kernels.in_custom_calls(choice):  # the fused kernel, and its dual as the backward
    first, second = ("fused all-gather", "fused reduce-scatter")[::1 if gathers else -1]
    add(block, first, axes, kernel_bytes, True)
    add(block, second, axes, kernel_bytes, False)
  elif choice.implementation == "ring":  # g-1 residual blocks per device, forward and backward
    for forward in (True, False):
      for _ in range(g - 1):
        add(block, "collective-permute", axes, residual, forward)
  elif choice.implementation in ("collectives", "fused"):  # "fused" on the kernels' plain-XLA backend
    gathered, scattered = ("all-gather", residual * g), ("reduce-scatter", residual)
    first, second = (gathered, scattered) if gathers else (scattered, gathered)
    add(block, first[0], axes, first[1], True)
    add(block, second[0], axes, second[1], False)


def _attention(lay: _Layout, add, c: int, micro: int) -> None:
  m, t = lay.config.model, lay.config.train
  batch, seq, heads, _ = lay.act("act_batch", "act_attn_seq", "act_heads", None)
  kv_heads = lay.act("act_kv_heads")[0]
  n = lay.size(seq)
  rows = micro // lay.size(batch) * t.seq_len // n
  width = attention_width(m)
  kv = rows * m.num_kv_heads // lay.size(kv_heads) * width * c  # one of K or V, this device
  q = rows * m.num_heads // lay.size(heads) * width * c
  positions = rows * 4
  if m.attention == "mla":
    # The rotary key, one per token for every head, comes out of the latent projection in the residual
    # stream's layout; GSPMD gathers it over the token axes attention does not split (tp_sp's `tensor`, which
    # splits heads there) and reduce-scatters its gradient, summed over the heads, back. (Under remat the
    # recomputed forward gathers the cos/sin tables and the unrotated key instead: not counted.)
    residual_axes = {a for dim in lay.act("act_batch", "act_seq") for a in dim}
    gathered = lay.in_mesh_order(residual_axes - {a for dim in (batch, seq) for a in dim})
    rope = rows * m.qk_rope_head_dim * c
    add("attention", "all-gather", gathered, rope, True)
    add("attention", "reduce-scatter", gathered, rope / lay.size(gathered), False)
  implementation = lay.plan.ops["attention"].implementation
  if implementation == "allgather":
    add("attention", "all-gather", seq, 2 * kv * n, True)
    add("attention", "all-gather", seq, positions * n, True)
    add("attention", "reduce-scatter", seq, 2 * kv, False)
  elif implementation in ("ring", "zigzag_ring"):
    for _ in range(n - 1):
      add("attention", "collective-permute", seq, 2 * kv + positions, True)
      add("attention", "collective-permute", seq, 2 * kv, False)
  elif implementation == "ulysses":  # q, k, v to head-split and the output back; the backward mirrors them
    for nbytes in (q, kv, kv, q):
      add("attention", "all-to-all", seq, nbytes, True)
      add("attention", "all-to-all", seq, nbytes, False)
    add("attention", "all-gather", seq, positions * n, True)


def _moe(lay: _Layout, add, c: int, residual: int) -> None:
  moe, d = lay.config.model.moe, lay.config.model.embed_dim
  experts = lay.plan.expert_layout()
  g = lay.size(experts.gather)
  tokens = residual * g // (d * c)  # tokens this device routes, after gathering
  k = moe.top_k
  routing = tokens * k * (4 + 4)  # expert ids and combine weights
  add("moe", "all-gather", experts.gather, residual * g + routing, True)
  add("moe", "reduce-scatter", experts.gather, residual + tokens * k * 4, False)
  choice = lay.plan.ops["moe"]
  ep, local_experts = experts.ep, moe.num_experts // experts.ep
  if cost_kernels.in_custom_calls(choice):
    _fused_moe(lay, add, c, int(tokens * k), ep, local_experts, cost_kernels.tile_rows(choice))
  elif choice.implementation == "fused":
    _moe_kernels_as_collectives(lay, add, c, int(tokens * k), ep, local_experts, cost_kernels.tile_rows(choice))
  elif choice.implementation == "all_to_all":
    _exchanges(lay, add, tokens, k, ep, choice)
  add("moe", "reduce-scatter", experts.gather, residual, True)
  add("moe", "all-gather", experts.gather, residual * g, False)
  add("moe", "all-reduce", experts.reduce, residual, True)
  add("moe", "all-reduce", experts.reduce, residual, False)


def _fused_moe(lay: _Layout, add, c: int, assignments: int, ep: int, local_experts: int, tile_rows: int) -> None:
  """The Comet kernels: the group sizes all-gathered (each forward; the backward reuses the plan), then
  the dispatch and the return, each also run by the backward's dual kernel, all in the kernels."""
  add("moe", "all-gather", lay.expert_axes, ep * ep * local_experts * 4, True)
  _, remote_rows = cost_kernels.moe_rows(assignments, ep, local_experts, tile_rows)
  nbytes = remote_rows * lay.config.model.embed_dim * c
  for forward in (True, False):
    add("moe", "fused all-to-all", lay.expert_axes, nbytes, forward)  # dispatch (backward: the return kernel)
    add("moe", "fused all-to-all", lay.expert_axes, nbytes, forward)  # return (backward: the dispatch kernel)


def _moe_kernels_as_collectives(lay: _Layout, add, c: int, assignments: int, ep: int, local_experts: int,
                                tile_rows: int) -> None:
  """The Comet kernels' plain-XLA versions (kernel backend "collectives"; their reference.py): the group
  sizes all-gathered, every device's whole send buffer all-gathered for the dispatch and every device's
  whole receive buffer (with its tiles' sources, int32, int32 and bool) for the return; autodiff's
  backward reduce-scatters the two buffers' gradients."""
  d = lay.config.model.embed_dim
  send_rows, receive_rows = cost_kernels.moe_buffer_rows(assignments, ep, local_experts, tile_rows)
  receive_tiles = receive_rows // tile_rows
  add("moe", "all-gather", lay.expert_axes, ep * ep * local_experts * 4, True)
  add("moe", "all-gather", lay.expert_axes, ep * send_rows * d * c, True)
  add("moe", "reduce-scatter", lay.expert_axes, send_rows * d * c, False)
  add("moe", "all-gather", lay.expert_axes, ep * receive_rows * d * c, True)
  add("moe", "all-gather", lay.expert_axes, ep * receive_tiles * (4 + 4 + 1), True)
  add("moe", "reduce-scatter", lay.expert_axes, receive_rows * d * c, False)


def _exchanges(lay: _Layout, add, tokens: float, k: int, ep: int, choice) -> None:
  """The token exchanges of the `all_to_all` implementation (expert_parallel.py), each in its wire format
  (exchange_formats.py: a float8 row is D bytes plus a float32 scale per 128 channels)."""
  moe, m = lay.config.model.moe, lay.config.model
  d = m.embed_dim

  def row(wire_format: str) -> float:
    return exchange_formats.row_bytes(wire_format, d, m.dtype)

  # [ep, S]: the padded exchange's slots, the dropless worst case (expert_parallel.peer_slot); the ragged
  # one's receive buffer, that or capped (`parallel.moe_buffer_factor`; expert_parallel.receive_rows)
  local_experts = moe.num_experts // ep
  slots = ep * expert_parallel.peer_slot(tokens, k, local_experts)
  received = expert_parallel.receive_rows(tokens, k, local_experts, ep, choice.buffer_factor)
  # Group sizes first, once per chunk of the pipeline (moe_pipeline.py); the chunks' token buffers add up
  # to the unchunked ones. A ragged exchange also tells its peers where rows start (int32, ep of them):
  # where each sender's rows for the return are read, and where a capped buffer keeps them (ep x 2); the
  # backward tells both exchanges' offsets back, 4 of ep, one of which the forward already told (the
  # dispatch's first rows are where the return reads): 3 (compiled deviceless, DeepSeek-V3).
  ragged = choice.exchange != "padded_all_to_all"
  capped = received < slots
  for _ in range(moe_pipeline.num_chunks(int(tokens), choice.chunks)):
    add("moe", "all-to-all", lay.expert_axes, moe.num_experts * 4, True)
    if ragged:
      add("moe", "all-to-all", lay.expert_axes, ep * 4 * (1 + 2 * capped), True)
      add("moe", "all-to-all", lay.expert_axes, 3 * ep * 4, False)
  dispatch, combine = choice.dispatch_formats, choice.combine_formats
  if choice.exchange == "padded_all_to_all":  # whole [ep, S, D] buffers, each transposed in the backward
    for forward, backward in (dispatch, combine):
      add("moe", "all-to-all", lay.expert_axes, slots * row(forward), True)
      add("moe", "all-to-all", lay.expert_axes, slots * row(backward), False)
  else:  # ragged_all_to_all, counted by its output buffer (hlo_collectives: an upper bound); each moves the
    # A rows routing sends, (ep-1)/ep of them to other devices with balanced routing (`link_bytes`)
    assignments = tokens * k
    ep_axes = lay.expert_axes
    sent = lambda wire_format: assignments * row(wire_format) * (ep - 1) / ep
    add("moe", "ragged-all-to-all", ep_axes, received * row(dispatch[0]), True, sent(dispatch[0]))  # [A] in, buffer out
    add("moe", "ragged-all-to-all", ep_axes, assignments * row(combine[0]), True, sent(combine[0]))  # into [A] rows
    add("moe", "ragged-all-to-all", ep_axes, received * row(combine[1]), False, sent(combine[1]))  # its transpose
    add("moe", "ragged-all-to-all", ep_axes, assignments * row(dispatch[1]), False, sent(dispatch[1]))


def _weight_gradients(lay: _Layout, costs: list[CollectiveCost]) -> None:
  """Each weight's gradient is all-reduced over the devices that hold the same slice of it but compute
  different tokens; once per micro-batch for weights inside parallel ops, once per step for the rest. The
  routed experts' weights stored split along `embed` are gathered inside the MoE op (expert_parallel.py),
  so their gradient is first reduce-scattered over those axes, then all-reduced over the rest as a shard."""
  m, moe, t = lay.config.model, lay.config.model.moe, lay.config.train
  c = jnp.dtype(m.dtype).itemsize
  num_moe = m.num_layers - m.num_dense_layers
  d = m.embed_dim
  # (logical names, number of elements, layers holding it, bytes per element, inside a parallel op)
  # An MoE layer run in two halves (ParallelPlan.two_halves) calls each of its ops twice: its in-op weights'
  # gradients are summed twice per micro-batch, counted here as twice the layers.
  moe_calls = num_moe * (2 if lay.plan.two_halves else 1)
  # Devices that differ only along axes the tokens are not split over (megascale's `tensor`) compute the
  # same gradient: the sum runs over the token axes that do not also split the weight.
  token_axes = {a for dim in lay.act("act_batch", "act_seq") for a in dim}
  totals: dict[tuple[str, tuple[str, ...]], float] = collections.defaultdict(float)
  # The lookup's gradient, where sharding/embedding_lookup.py places it (the table split over token axes):
  # the tokens' gradients moved to the table's layout and the partial sums of its slice summed
  # (`_lookup_gradient`). The untied output table's gradient XLA partitions into the whole table on every
  # device, all-reduced once per micro-batch, when the table is stored split along D over token axes
  # (compiled deviceless: DeepSeek-V3's 3.7 GB table, 480 times a step; modelled over every token axis,
  # compiled over a subgroup of them).
  lookup_placed = not m.tie_embeddings and embedding_lookup.gradient_layout(lay.plan) is not None
  if lookup_placed:
    _lookup_gradient(lay, totals, token_axes)
  summed_whole = _tied_table_summed_whole if m.tie_embeddings else _embedding_summed_whole
  whole_tables = int(summed_whole(lay, token_axes))  # one table at most: the tied one, or the output table
  if whole_tables:
    axes = lay.in_mesh_order(token_axes)
    totals["all-reduce", axes] += t.grad_accum_steps * moved_bytes("all-reduce", lay.size(axes),
                                                                   m.vocab_size * d * 4)
  tables = (1 if m.tie_embeddings else 2) - whole_tables - lookup_placed
  if tables and lookup_placed and _output_table_summed_per_micro_batch(lay, token_axes):
    _output_table_gradient(lay, totals, token_axes)
    tables = 0
  # Under a distributed optimizer on GPUs each layer's gradient is placed like its master inside the layer
  # loop (training/master_weights.py), so the router's and the norms' are summed there, per micro-batch
  # (compiled deviceless: Mixtral-8x7B's and DeepSeek-V3's norms all-reduced 64 and 80 times a step; tiny_moe's
  # once, a difference of a few KB left alone).
  per_micro_batch = lay.plan.distributed_optimizer and lay.plan.hardware.platform != "cpu"
  weights = [
      *((names, elements, m.num_dense_layers + moe_calls, c, True) for names, elements in attention_weights(m)),
      (("embed", "mlp"), d * m.mlp_dim * 3, m.num_dense_layers, c, True),
      (("embed", "mlp"), d * moe.num_shared_experts * moe.expert_mlp_dim * 3, moe_calls, c, True),
      (("exp", "embed", "exp_mlp"), moe.num_experts * d * moe.expert_mlp_dim * 3, moe_calls, c, True),
      (("embed", None), d * moe.num_experts, num_moe, 4, per_micro_batch),  # router, float32
      (("vocab", "embed"), m.vocab_size * d * tables, 1, 4, False),
      (("norm",), d, 1, 4, False),  # the final norm
      (("norm",), 2 * d + _layer_norm_extras(m), m.num_layers, 4, per_micro_batch),  # each layer's
  ]
  compression = lay.plan.gradient_compression
  for names, elements, layers, itemsize, in_op in weights:
    if not elements or not layers:
      continue
    weight_axes = {a for dim in lay.weight(*names) for a in dim}
    shards = lay.size(tuple(weight_axes))
    summed = token_axes - weight_axes
    repeats = (t.grad_accum_steps if in_op else 1) * layers
    if compression != "none" and "exp" in names:
      # One compressed sum per micro-batch of every MoE layer's gradient of each of the 3 weights, after the
      # layer loop (gradient_sync.py; LayerStack), whatever the layer schedule.
      replica_axes = lay.in_mesh_order(summed)
      replicas = lay.size(replica_axes)
      summed = set()
      for kind, nbytes in gradient_sync.result_bytes(num_moe * elements // 3 // shards, compression, replicas,
                                                       lay.plan.hardware.platform).items():
        totals[kind, replica_axes] += t.grad_accum_steps * 3 * moved_bytes(kind, replicas, nbytes)
    gathered_in_op = lay.plan.expert_layout().weight_gather if "exp" in names else ()
    if not gathered_in_op and lay.plan.distributed_optimizer and lay.plan.hardware.platform != "cpu":
      # The gradient is summed into the optimizer's slices of the float32 accumulator
      # (training/master_weights.py): GPU compiles reduce-scatter it over the axes the optimizer storage adds
      # (the layers' weights per micro-batch, the tables' once per step but `_output_table_gradient`'s);
      # XLA:CPU all-reduces it, then slices.
      gathered_in_op = lay.in_mesh_order(({a for dim in lay.updated(*names) for a in dim} - weight_axes) & summed)
    if gathered_in_op:
      shards *= lay.size(gathered_in_op)
      summed -= set(gathered_in_op)
      totals["reduce-scatter", gathered_in_op] += repeats * moved_bytes(
          "reduce-scatter", lay.size(gathered_in_op), elements * itemsize / shards)
    group = lay.size(tuple(summed))
    totals["all-reduce", lay.in_mesh_order(summed)] += repeats * moved_bytes("all-reduce", group,
                                                                            elements * itemsize / shards)
  for (kind, axes), nbytes in totals.items():
    if lay.size(axes) > 1:
      costs.append(CollectiveCost("gradients", kind, lay.size(axes), nbytes, axes))


def _layer_norm_extras(m) -> int:
  """A layer's norm scales besides its two of the model width: MLA's latents', or Qwen3's per-head q and k."""
  if m.attention == "mla":
    return m.kv_lora_rank + m.q_lora_rank
  return 2 * m.head_dim if m.qk_norm else 0


def _output_table_summed_per_micro_batch(lay: _Layout, token_axes: set[str]) -> bool:
  """Whether the untied output table's gradient is summed per micro-batch as `_output_table_gradient` counts:
  under a distributed optimizer on GPUs, where the table is stored split over axes that split the tokens
  (tp_sp's vocabulary over `tensor`), so GSPMD gathers it whole for the logits (`_weight_gathers`) and forms
  its gradient whole on every device."""
  if not lay.plan.distributed_optimizer or lay.plan.hardware.platform == "cpu" or lay.config.model.tie_embeddings:
    return False
  return bool({a for dim in lay.stored("embed", "vocab") for a in dim if lay.size((a,)) > 1} & token_axes)


def _output_table_gradient(lay: _Layout, totals: dict, token_axes: set[str]) -> None:
  """The untied output table's gradient where `_output_table_summed_per_micro_batch`, per micro-batch
  (compiled deviceless, tiny_moe and DeepSeek-V3 under tp_sp): formed whole [D, V] in float32 on every
  device, reduce-scattered over the token axes the table is stored over (the transpose of the forward's
  gather), then summed over the other token axes: reduce-scattered into the master's slices where the
  logits are formed in one chunk, all-reduced at the weight's placement where the output layer's chunk loop
  (models/output.py) sums the gradient first (XLA then leaves the slicing to the update)."""
  m, t = lay.config.model, lay.config.train
  stored = lay.in_mesh_order({a for dim in lay.stored("embed", "vocab") for a in dim} & token_axes)
  table = m.vocab_size * m.embed_dim * 4 / lay.size(stored)
  totals["reduce-scatter", stored] += t.grad_accum_steps * moved_bytes("reduce-scatter", lay.size(stored), table)
  _sum_per_micro_batch(lay, totals, ("embed", "vocab"), table, token_axes - set(stored),
                       into_master=math.prod(output_chunks(lay.config, lay.plan)) == 1)


def _sum_per_micro_batch(lay: _Layout, totals: dict, names, nbytes: float, axes: set[str], into_master: bool) -> None:
  """A table gradient's `nbytes` per device summed over `axes` per micro-batch: reduce-scattered first over
  those of them that split the optimizer's slice of `names` where `into_master`, then all-reduced over the
  rest."""
  t = lay.config.train
  rest = set(axes)
  if into_master:
    scattered = lay.in_mesh_order({a for dim in lay.updated(*names) for a in dim} & rest)
    totals["reduce-scatter", scattered] += t.grad_accum_steps * moved_bytes(
        "reduce-scatter", lay.size(scattered), nbytes / lay.size(scattered))
    nbytes /= lay.size(scattered)
    rest -= set(scattered)
  summed = lay.in_mesh_order(rest)
  totals["all-reduce", summed] += t.grad_accum_steps * moved_bytes("all-reduce", lay.size(summed), nbytes)


def output_chunks(config: Config, plan: ParallelPlan) -> tuple[int, int]:
  """(batch, sequence) chunks the loss's output layer cuts one device's tokens into (models/output.py)."""
  m, t = config.model, config.train
  micro = t.global_batch_size // t.grad_accum_steps
  batch, seq, vocab = plan.activation_sharding(output.LOGITS).shard_shape((micro, t.seq_len, m.vocab_size))
  return output.chunk_counts(batch, seq, vocab, m.logits_chunk_bytes)


def _embedding_summed_whole(lay: _Layout, token_axes: set[str]) -> bool:
  """Whether the untied output table's gradient is summed whole per micro-batch (`_weight_gradients`): where
  it is stored with D split over axes that split the tokens, and the lookup is not the local one of
  `_embedding_lookup` (D over exactly the batch's axes)."""
  d_axes = set(lay.stored("embed", "vocab")[0])
  return bool(d_axes & token_axes) and not _local_lookup(lay)


def _tied_table_summed_whole(lay: _Layout, token_axes: set[str]) -> bool:
  """Whether a tied table's gradient (the lookup's and the output layer's, jnp.take's own partition) is
  summed whole per micro-batch: where the table is stored, or under a distributed optimizer updated, with D
  split over axes that split the tokens, and the lookup is not the local one of `_embedding_lookup`."""
  placed = lay.updated if lay.plan.distributed_optimizer else lay.stored
  return bool(set(placed("vocab", "embed")[1]) & token_axes) and not _local_lookup(lay)


def _lookup_gradient(lay: _Layout, totals: dict, token_axes: set[str]) -> None:
  """The embedding lookup's gradient as sharding/embedding_lookup.py forms it, per micro-batch: the tokens'
  gradients [T, D] (compute dtype) sliced along D over the table's D axes that do not split the tokens,
  all-gathered over the token axes that split the vocabulary, all-to-all'd over those that split D; then the
  float32 partial sums of each device's table slice summed over the other token axes (`rest`): a
  reduce-scatter into the master's slices under a distributed optimizer on GPUs, an all-reduce elsewhere.
  Untied tables only (models/layers.Embed)."""
  m, t = lay.config.model, lay.config.train
  layout = embedding_lookup.gradient_layout(lay.plan)
  vocab_axes, d_axes = ({a for a in dim if lay.size((a,)) > 1} for dim in lay.stored("vocab", "embed"))
  tokens = t.global_batch_size // t.grad_accum_steps * t.seq_len
  c = jnp.dtype(m.dtype).itemsize
  gathered = lay.in_mesh_order(vocab_axes & token_axes)
  exchanged = lay.in_mesh_order(d_axes & token_axes)
  # Compiled (DeepSeek-V3 on 256 H100s): the gather first, then the exchange of the gathered rows.
  rows = tokens / lay.size(tuple(token_axes - vocab_axes)) * m.embed_dim / lay.size(tuple(d_axes - token_axes)) * c
  totals["all-gather", gathered] += t.grad_accum_steps * moved_bytes("all-gather", lay.size(gathered), rows)
  totals["all-to-all", exchanged] += t.grad_accum_steps * moved_bytes("all-to-all", lay.size(exchanged), rows)
  partial = m.vocab_size * m.embed_dim * 4 / lay.size(tuple(vocab_axes | d_axes))
  _sum_per_micro_batch(lay, totals, ("vocab", "embed"), partial, set(layout.rest),
                       into_master=lay.plan.distributed_optimizer and lay.plan.hardware.platform != "cpu")


def weights_regathered(config: Config, plan: ParallelPlan, experts: bool) -> bool:
  """Whether the backward pass all-gathers a layer's FSDP-split weights again rather than keeping the
  forward's gathered copy: always under remat (the recomputed forward gathers them). Without remat the
  copy is kept, with one exception: routed experts that GSPMD gathers at the MoE op's boundary (split for
  storage over axes that do not split the tokens; the op gathers the others itself) in float32 on one
  expert shard, which the blocked GEMM's custom VJP keeps as stored."""
  if config.model.remat != "none":
    return True
  if not experts or plan.expert_layout().weight_gather:
    return False
  choice = plan.ops.get("moe")
  return (choice is not None and choice.implementation == "local" and choice.grouped_gemm == "blocked"
          and jnp.dtype(config.model.dtype) == jnp.float32)


def _weight_gathers(lay: _Layout, costs: list[CollectiveCost]) -> None:
  """Weights stored split but used whole, all-gathered by GSPMD: FSDP's `embed` split before each use (in
  the forward, and again in the backward where `weights_regathered`), a vocabulary split of the embedding
  tables (`tp_sp`), and ZeRO-1's parameters after the sharded update, or the distributed optimizer's weights
  from its master (once per step)."""
  m, moe, t = lay.config.model, lay.config.model.moe, lay.config.train
  c = jnp.dtype(m.dtype).itemsize
  num_moe = m.num_layers - m.num_dense_layers
  d = m.embed_dim
  layer = 1 + weights_regathered(lay.config, lay.plan, experts=False)  # gathers per micro-batch
  experts = 1 + weights_regathered(lay.config, lay.plan, experts=True)
  # (logical names, elements, bytes per element when used, gathers per micro-batch)
  weights = [
      *((names, m.num_layers * elements, c, layer) for names, elements in attention_weights(m)),
      (("embed", "mlp"), m.num_dense_layers * d * m.mlp_dim * 3, c, layer),
      (("embed", "mlp"), num_moe * d * moe.num_shared_experts * moe.expert_mlp_dim * 3, c, layer),
      (("exp", "embed", "exp_mlp"), num_moe * moe.num_experts * d * moe.expert_mlp_dim * 3, c, experts),
      (("embed", None), num_moe * d * moe.num_experts, 4, 1),
      (("vocab", "embed"), m.vocab_size * d * (1 if m.tie_embeddings else 2), 4, 1),
  ]
  totals: dict[tuple[str, tuple[str, ...]], float] = collections.defaultdict(float)
  for names, elements, itemsize, gathers in weights:
    if not elements:
      continue
    stored = lay.in_mesh_order({a for dim in lay.stored(*names) for a in dim})
    # Inside the parallel ops a weight keeps its model-parallel split (experts, heads) and loses `embed`;
    # outside them (embedding, router) GSPMD gathers it whole.
    used = lay.in_mesh_order({a for dim in lay.weight(*names) for a in dim} if names[0] != "vocab" else ())
    gathered = tuple(a for a in stored if a not in used)
    if gathered:
      totals["weights", gathered] += gathers * t.grad_accum_steps * moved_bytes(
          "all-gather", lay.size(gathered), elements * itemsize / lay.size(used))
    updated = lay.in_mesh_order({a for dim in lay.updated(*names) for a in dim})
    after_update = tuple(a for a in updated if a not in stored)
    if after_update:
      # Once per step: ZeRO-1's float32 parameters after the sharded update, or the distributed optimizer's
      # weights in their compute dtype, gathered from the master (training/master_weights.py).
      gathered_bytes = itemsize if lay.plan.distributed_optimizer else 4
      totals["zero1_update", after_update] += moved_bytes("all-gather", lay.size(after_update),
                                                          elements * gathered_bytes / lay.size(stored))
  for (op, axes), nbytes in totals.items():
    costs.append(CollectiveCost(op, "all-gather", lay.size(axes), nbytes, axes))


def _embedding_lookup(lay: _Layout, costs: list[CollectiveCost], micro: int, batch_axes, seq_axes) -> None:
  """A table split along D over exactly the batch's axes (fsdp; mesh.weight_storage where it comes to that)
  with the sequence whole is looked up locally, [tokens, D/g], and GSPMD all-to-alls the result to the
  token split, [tokens/g, D] (float32), and back in the backward pass. Split otherwise, GSPMD gathers the
  table for the lookup instead (`_weight_gathers` counts that gather in every case)."""
  m, t = lay.config.model, lay.config.train
  if not _local_lookup(lay):
    return
  table_axes = lay.stored("vocab", "embed")[1]
  token_axes = set(batch_axes) | set(seq_axes)
  axes = tuple(a for a in table_axes if a in token_axes)
  g = lay.size(axes)
  tokens = micro * t.seq_len / lay.size(tuple(token_axes))
  if g > 1:
    nbytes = 2 * t.grad_accum_steps * moved_bytes("all-to-all", g, tokens * m.embed_dim * 4)
    costs.append(CollectiveCost("embedding", "all-to-all", g, nbytes, axes))


def bytes_by_kind(costs: list[CollectiveCost]) -> dict[str, float]:
  totals: dict[str, float] = collections.defaultdict(float)
  for cost in costs:
    totals[cost.kind] += cost.bytes
  return dict(totals)


def _local_lookup(lay: _Layout) -> bool:
  """Whether the embedding table is split along D over exactly the batch's axes, with the sequence whole: then
  each device looks its D slice up for every token (`_embedding_lookup`)."""
  batch_axes, seq_axes = lay.act("act_batch", "act_seq")
  split = lambda axes: {a for a in axes if lay.size((a,)) > 1}
  return split(lay.stored("vocab", "embed")[1]) == split(batch_axes) and not split(seq_axes)
