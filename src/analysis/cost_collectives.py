"""Cost model, communication part: the bytes each collective of a training step moves, per device.

Derived from the same rules table and the same per-op algorithms as the parallel ops (sharding/), so a
change in either shows up as a mismatch against the compiled HLO (tests/test_cost_model.py). Bytes are
counted as in hlo_collectives.py (e.g. an all-gather moves (g-1)/g of its result). Per layer and
micro-batch, forward then backward (the transpose of each op: all-gather <-> reduce-scatter, all-to-all
<-> all-to-all, psum <-> nothing); recomputation under remat repeats the forward's collectives.

Weight gradients: a weight that enters an op whole on devices that compute different tokens gets its
gradient summed over those devices inside the op's backward (an all-reduce per micro-batch); that is data
parallelism's gradient all-reduce. Weights outside the explicit ops (embedding, output projection, router,
norms) are handled by GSPMD the same way.

Not modelled (small, and listed so nobody hunts for them): int32 routing and position arrays moved by
GSPMD for the zigzag permutation and capacity priority, scalar loss reductions, and the gathers GSPMD
adds around the vocabulary-parallel logits of `tp_sp`.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax.numpy as jnp

from meshmoe.analysis import cost_kernels
from meshmoe.config import Config, resolve_mesh_sizes
from meshmoe.analysis.hlo_collectives import moved_bytes
from meshmoe.sharding.rules import get_preset, logical_to_spec


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
  op: str  # which parallel op (or "gradients") issues it
  kind: str  # HLO name (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute), or one of
  # cost_kernels.FUSED_KINDS for communication inside a fused kernel
  group_size: int
  bytes: float  # per device, per training step, all occurrences together


class _Layout:
  """Mesh-axis arithmetic for one config: which axes split what, and local sizes."""

  def __init__(self, config: Config, num_devices: int, platform: str):
    self.config, self.sizes = config, resolve_mesh_sizes(config.mesh, num_devices)
    self.platform = platform
    self.num_devices = num_devices
    self.preset = get_preset(config.mesh.preset)

  def axes(self, logical, rules) -> list[tuple[str, ...]]:
    spec = logical_to_spec(logical, rules)
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]

  def act(self, *logical):
    return self.axes(logical, self.preset.activations)

  def weight(self, *logical):
    return self.axes([None if n == "embed" else n for n in logical], self.preset.params)

  def size(self, axes) -> int:
    return math.prod(self.sizes[a] for a in axes)


def collective_costs(config: Config, num_devices: int, platform: str = "cpu") -> list[CollectiveCost]:
  """Every collective of one training step (all micro-batches), per device; `platform` "cpu" or "gpu"
  (expert parallelism exchanges tokens with a padded all-to-all on CPU, ragged_all_to_all elsewhere)."""
  lay = _Layout(config, num_devices, platform)
  m, moe, t = config.model, config.model.moe, config.train
  c = jnp.dtype(m.dtype).itemsize
  micro = t.global_batch_size // t.grad_accum_steps
  batch_axes, seq_axes, _ = lay.act("act_batch", "act_seq", None)
  b_local, s_local = micro // lay.size(batch_axes), t.seq_len // lay.size(seq_axes)
  residual = b_local * s_local * m.embed_dim * c  # bytes of this device's residual block
  costs: list[CollectiveCost] = []
  forward_repeats = 1 if m.remat == "none" else 2  # remat recomputes the forward, collectives included

  def add(op, kind, group, nbytes, forward: bool):
    count = t.grad_accum_steps * (forward_repeats if forward else 1) * per_layer[op]
    if group > 1 and nbytes:
      # A fused kernel's bytes are its own accounting of what it moves; a collective's, its result size.
      moved = nbytes if kind in cost_kernels.FUSED_KINDS else moved_bytes(kind, group, nbytes)
      costs.append(CollectiveCost(op, kind, group, count * moved))

  num_moe = m.num_layers - m.num_dense_layers
  per_layer = {"attention": m.num_layers, "dense_mlp": m.num_dense_layers,
               "shared_experts": num_moe if moe.num_shared_experts else 0, "moe": num_moe,
               "gradients": 1}

  def projections(op, weights_in):
    """weights_in: (logical names, global width) of the block's in-projections; the first one's width is
    the out-projection's contraction."""
    tp_axes = tuple(dict.fromkeys(a for names, _ in weights_in for dim in lay.weight(*names) for a in dim))
    gather = tuple(a for a in seq_axes if a in tp_axes)
    g = lay.size(gather)
    if _projection_kernels(lay, weights_in):
      nbytes = cost_kernels.projection_bytes(g, b_local * s_local, m.embed_dim, c)  # every direction the same
      for forward in (True, False):  # project_in and project_out, each with its dual kernel backward
        add(op, "fused all-gather", g, nbytes, forward)
        add(op, "fused reduce-scatter", g, nbytes, forward)
    elif lay.config.parallel.impl in ("xla", "pallas"):  # rings: g-1 residual blocks per device and direction
      for forward in (True, False):  # (collective_matmul.py: project_in, project_out, their transposes)
        for _ in range(2 * (g - 1)):
          add(op, "collective-permute", g, residual, forward)
    else:
      add(op, "all-gather", g, residual * g, True)  # project_in
      add(op, "reduce-scatter", g, residual, False)  # its transpose
      add(op, "reduce-scatter", g, residual, True)  # project_out
      add(op, "all-gather", g, residual * g, False)
    r = lay.size(tuple(a for a in tp_axes if a not in gather))
    add(op, "all-reduce", r, residual, True)  # project_out's psum over axes that do not split tokens
    add(op, "all-reduce", r, residual, False)  # project_in's input gradient over the same axes

  blocks = _projection_blocks(config)
  projections("attention", blocks["attention"])
  _attention(lay, add, c, micro)
  if m.num_dense_layers:
    projections("dense_mlp", blocks["dense_mlp"])
  if num_moe:
    if moe.num_shared_experts:
      projections("shared_experts", blocks["shared_experts"])
    _moe(lay, add, c, micro, residual, batch_axes, seq_axes)
  _weight_gradients(lay, costs)
  _weight_gathers(lay, costs)
  _embedding_lookup(lay, costs, micro, batch_axes, seq_axes)
  return costs


def _attention(lay: _Layout, add, c: int, micro: int) -> None:
  m, t = lay.config.model, lay.config.train
  batch, seq, heads, _ = lay.act("act_batch", "act_attn_seq", "act_heads", None)
  kv_heads = lay.act("act_kv_heads")[0]
  n = lay.size(seq)
  rows = micro // lay.size(batch) * t.seq_len // n
  kv = rows * m.num_kv_heads // lay.size(kv_heads) * m.head_dim * c  # one of K or V, this device
  q = rows * m.num_heads // lay.size(heads) * m.head_dim * c
  positions = rows * 4
  kind = lay.config.parallel.attention
  if kind == "allgather":
    add("attention", "all-gather", n, 2 * kv * n, True)
    add("attention", "all-gather", n, positions * n, True)
    add("attention", "reduce-scatter", n, 2 * kv, False)
  elif kind == "ring":
    for _ in range(n - 1):
      add("attention", "collective-permute", n, 2 * kv + positions, True)
      add("attention", "collective-permute", n, 2 * kv, False)
  else:  # ulysses: q, k, v to head-split and the output back; the backward mirrors them
    for nbytes in (q, kv, kv, q):
      add("attention", "all-to-all", n, nbytes, True)
      add("attention", "all-to-all", n, nbytes, False)
    add("attention", "all-gather", n, positions * n, True)


def _moe(lay: _Layout, add, c: int, micro: int, residual: int, batch_axes, seq_axes) -> None:
  moe = lay.config.model.moe
  expert_axes, _, width_axes = lay.weight("exp", "embed", "exp_mlp")
  gather = tuple(a for a in seq_axes if a in width_axes) or tuple(a for a in batch_axes if a in width_axes)
  g = lay.size(gather)
  tokens = residual * g // (lay.config.model.embed_dim * c)  # tokens this device routes, after gathering
  k = moe.top_k
  routing = tokens * k * (4 + 4)  # expert ids and combine weights
  add("moe", "all-gather", g, residual * g + routing, True)
  add("moe", "reduce-scatter", g, residual + tokens * k * 4, False)
  ep = lay.size(expert_axes)
  if _moe_kernels(lay):
    _fused_moe(lay, add, c, int(tokens * k), ep, moe.num_experts // ep)
  else:
    _exchanges(lay, add, c, tokens, k, ep)
  add("moe", "reduce-scatter", g, residual, True)
  add("moe", "all-gather", g, residual * g, False)
  r = lay.size(tuple(a for a in width_axes if a not in gather))
  add("moe", "all-reduce", r, residual, True)
  add("moe", "all-reduce", r, residual, False)


def fused_ops(config: Config, num_devices: int, platform: str) -> set[str]:
  """The ops ("attention", "dense_mlp", "shared_experts" projections, "moe") whose communication and GEMMs
  run inside the `pallas` tier's fused kernels for this config (cost_kernels.py)."""
  lay = _Layout(config, num_devices, platform)
  ops = {op for op, weights_in in _projection_blocks(config).items() if _projection_kernels(lay, weights_in)}
  return ops | ({"moe"} if _moe_kernels(lay) else set())


def _projection_blocks(config: Config) -> dict[str, list]:
  """Each tensor-parallel block's in-projections: (logical names, global width); the first one's width
  is its out-projection's contraction."""
  m, moe = config.model, config.model.moe
  heads, kv_heads = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
  blocks = {"attention": [(heads, m.num_heads * m.head_dim), (kv_heads, m.num_kv_heads * m.head_dim),
                          (kv_heads, m.num_kv_heads * m.head_dim)]}
  if m.num_dense_layers:
    blocks["dense_mlp"] = [(("embed", "mlp"), m.mlp_dim)] * 2
  if moe.num_shared_experts and m.num_layers > m.num_dense_layers:
    blocks["shared_experts"] = [(("embed", "mlp"), moe.num_shared_experts * moe.expert_mlp_dim)] * 2
  return blocks


def _projection_kernels(lay: _Layout, weights_in) -> bool:
  """Whether a block's projections run the Flux kernels: a gather over tensor-parallel axes, and per-device
  GEMM shapes the kernels tile."""
  m, t = lay.config.model, lay.config.train
  batch_axes, seq_axes = lay.act("act_batch", "act_seq")
  tp_axes = {a for names, _ in weights_in for dim in lay.weight(*names) for a in dim}
  if lay.size(tuple(a for a in seq_axes if a in tp_axes)) == 1:
    return False
  rows = (t.global_batch_size // t.grad_accum_steps // lay.size(batch_axes)) * (t.seq_len // lay.size(seq_axes))
  local = [width / lay.size(tuple(a for dim in lay.weight(*names) for a in dim)) for names, width in weights_in]
  return cost_kernels.projection_kernels_apply(lay.config, lay.platform, rows, m.embed_dim, local, local[0])


def _moe_kernels(lay: _Layout) -> bool:
  moe = lay.config.model.moe
  expert_axes, _, width_axes = lay.weight("exp", "embed", "exp_mlp")
  return cost_kernels.moe_kernels_apply(lay.config, lay.platform, lay.size(expert_axes),
                                        moe.expert_mlp_dim / lay.size(width_axes))


def _fused_moe(lay: _Layout, add, c: int, assignments: int, ep: int, local_experts: int) -> None:
  """The Comet kernels: the group sizes all-gathered (each forward; the backward reuses the plan), then
  the dispatch and the return, each also run by the backward's dual kernel, all in the kernels."""
  add("moe", "all-gather", ep, ep * ep * local_experts * 4, True)
  _, remote_rows = cost_kernels.moe_rows(assignments, ep, local_experts)
  nbytes = remote_rows * lay.config.model.embed_dim * c
  for forward in (True, False):
    add("moe", "fused all-to-all", ep, nbytes, forward)  # dispatch (backward: the return kernel)
    add("moe", "fused all-to-all", ep, nbytes, forward)  # return (backward: the dispatch kernel)


def _exchanges(lay: _Layout, add, c: int, tokens: float, k: int, ep: int) -> None:
  """The reference and xla tiers' token exchanges (expert_parallel.py)."""
  moe = lay.config.model.moe
  sent = tokens * k * lay.config.model.embed_dim * c  # [A, D]: this device's assignments
  buffer = ep * sent  # [ep, A, D]: the receive buffer, dropless worst case
  # Group sizes first, once per chunk of the xla tier's pipeline (moe_pipeline.py); the chunks' token
  # buffers add up to the unchunked ones.
  chunks = (min(lay.config.parallel.moe_chunks, int(tokens)) if lay.config.parallel.impl in ("xla", "pallas")
            else 1)
  for _ in range(chunks):
    add("moe", "all-to-all", ep, moe.num_experts * 4, True)
  if lay.platform == "cpu":  # padded all_to_all of whole [ep, A, D] buffers, each transposed in the backward
    for _ in range(2):  # dispatch and return
      add("moe", "all-to-all", ep, buffer, True)
      add("moe", "all-to-all", ep, buffer, False)
  else:  # ragged_all_to_all, counted by its output buffer (hlo_collectives: an upper bound)
    add("moe", "ragged-all-to-all", ep, buffer, True)  # dispatch: [A] rows in, [ep*A] out
    add("moe", "ragged-all-to-all", ep, buffer, True)  # return: into an [ep, A] buffer
    add("moe", "ragged-all-to-all", ep, buffer, False)  # the return's transpose: [ep*A] out
    add("moe", "ragged-all-to-all", ep, sent, False)  # the dispatch's transpose: back to [A] rows


def _weight_gradients(lay: _Layout, costs: list[CollectiveCost]) -> None:
  """Each weight's gradient is all-reduced over the devices that hold the same slice of it but compute
  different tokens; once per micro-batch for weights inside parallel ops, once per step for the rest."""
  m, moe, t = lay.config.model, lay.config.model.moe, lay.config.train
  c = jnp.dtype(m.dtype).itemsize
  num_moe = m.num_layers - m.num_dense_layers
  d, h = m.embed_dim, m.head_dim
  # (logical names, number of elements, layers holding it, bytes per element, inside a parallel op)
  weights = [
      (("embed", "heads", "head_dim"), d * m.num_heads * h * 2, m.num_layers, c, True),
      (("embed", "kv_heads", "head_dim"), d * m.num_kv_heads * h * 2, m.num_layers, c, True),
      (("embed", "mlp"), d * m.mlp_dim * 3, m.num_dense_layers, c, True),
      (("embed", "mlp"), d * moe.num_shared_experts * moe.expert_mlp_dim * 3, num_moe, c, True),
      (("exp", "embed", "exp_mlp"), moe.num_experts * d * moe.expert_mlp_dim * 3, num_moe, c, True),
      (("embed", None), d * moe.num_experts, num_moe, 4, False),  # router, float32
      (("vocab", "embed"), m.vocab_size * d * (1 if m.tie_embeddings else 2), 1, 4, False),
      (("norm",), d * (2 * m.num_layers + 1), 1, 4, False),
  ]
  # Devices that differ only along axes the tokens are not split over (megascale's `tensor`) compute the
  # same gradient: the sum runs over the token axes that do not also split the weight.
  token_axes = {a for dim in lay.act("act_batch", "act_seq") for a in dim}
  totals: dict[int, float] = collections.defaultdict(float)
  for names, elements, layers, itemsize, in_op in weights:
    if not elements or not layers:
      continue
    weight_axes = {a for dim in lay.weight(*names) for a in dim}
    shards = lay.size(tuple(weight_axes))
    group = lay.size(tuple(token_axes - weight_axes))
    repeats = t.grad_accum_steps if in_op else 1
    totals[group] += repeats * layers * moved_bytes("all-reduce", group, elements * itemsize / shards)
  for group, nbytes in totals.items():
    if group > 1:
      costs.append(CollectiveCost("gradients", "all-reduce", group, nbytes))


def _weight_gathers(lay: _Layout, costs: list[CollectiveCost]) -> None:
  """Weights stored split but used whole, all-gathered by GSPMD: FSDP's `embed` split before each use
  (once per micro-batch: the forward's copy serves the backward), a vocabulary split of the embedding
  tables (`tp_sp`), and ZeRO-1's parameters after the sharded update (once per step)."""
  m, moe, t = lay.config.model, lay.config.model.moe, lay.config.train
  c = jnp.dtype(m.dtype).itemsize
  num_moe = m.num_layers - m.num_dense_layers
  d, h = m.embed_dim, m.head_dim
  # (logical names, elements, bytes per element when used, once per micro-batch)
  weights = [
      (("embed", "heads", "head_dim"), m.num_layers * d * m.num_heads * h * 2, c, True),
      (("embed", "kv_heads", "head_dim"), m.num_layers * d * m.num_kv_heads * h * 2, c, True),
      (("embed", "mlp"), m.num_dense_layers * d * m.mlp_dim * 3, c, True),
      (("embed", "mlp"), num_moe * d * moe.num_shared_experts * moe.expert_mlp_dim * 3, c, True),
      (("exp", "embed", "exp_mlp"), num_moe * moe.num_experts * d * moe.expert_mlp_dim * 3, c, True),
      (("embed", None), num_moe * d * moe.num_experts, 4, True),
      (("vocab", "embed"), m.vocab_size * d * (1 if m.tie_embeddings else 2), 4, True),
  ]
  params, optimizer = lay.preset.params, lay.preset.optimizer_rules()
  stored_total = used_total = update_total = 0.0
  for names, elements, itemsize, _ in weights:
    if not elements:
      continue
    stored = lay.size(tuple(a for dim in lay.axes(names, params) for a in dim))
    # Inside the parallel ops a weight keeps its model-parallel split (experts, heads) and loses `embed`;
    # outside them (embedding, router) GSPMD gathers it whole.
    used = lay.size(tuple(a for dim in lay.weight(*names) for a in dim)) if names[0] != "vocab" else 1
    if stored > used:
      used_total += t.grad_accum_steps * moved_bytes("all-gather", stored // used, elements * itemsize / used)
    updated = lay.size(tuple(a for dim in lay.axes(names, optimizer) for a in dim))
    if updated > stored:
      update_total += moved_bytes("all-gather", updated // stored, elements * 4 / stored)
  del stored_total
  for op, nbytes in (("weights", used_total), ("zero1_update", update_total)):
    if nbytes:
      costs.append(CollectiveCost(op, "all-gather", 0, nbytes))


def _embedding_lookup(lay: _Layout, costs: list[CollectiveCost], micro: int, batch_axes, seq_axes) -> None:
  """A table split along D (fsdp) is looked up locally, [tokens, D/g], and GSPMD all-to-alls the result
  to the token split, [tokens/g, D] (float32), and back in the backward pass."""
  m, t = lay.config.model, lay.config.train
  table_axes = lay.axes(("vocab", "embed"), lay.preset.params)[1]
  token_axes = set(batch_axes) | set(seq_axes)
  g = lay.size(tuple(a for a in table_axes if a in token_axes))
  tokens = micro * t.seq_len / lay.size(tuple(token_axes))
  if g > 1:
    nbytes = 2 * t.grad_accum_steps * moved_bytes("all-to-all", g, tokens * m.embed_dim * 4)
    costs.append(CollectiveCost("embedding", "all-to-all", g, nbytes))


def bytes_by_kind(costs: list[CollectiveCost]) -> dict[str, float]:
  totals: dict[str, float] = collections.defaultdict(float)
  for cost in costs:
    totals[cost.kind] += cost.bytes
  return dict(totals)
