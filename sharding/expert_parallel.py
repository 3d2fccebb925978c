"""Expert parallelism: tokens travel to the devices that hold their experts and back (dropless).

Experts are split over the "expert axes" (the rules' axes for `exp`, size ep); each device holds E/ep of
them. Each device routes its own tokens, then per MoE layer:

1. sorts its A = T*K assignments by expert (so by destination device) and counts them per expert;
2. exchanges the counts: an all_to_all of [ep, E/ep] int32, so each device knows how many rows each peer
   sends it for each of its experts before any token moves;
3. exchanges the tokens. GPU: `ragged_all_to_all` sends each peer exactly its rows. CPU (which lacks that
   op): a padded `all_to_all` of an [ep, S, D] buffer. Each peer gets a slot of S = T*min(K, E/ep) rows
   (`peer_slot`): a token's K experts are distinct, so at most min(K, E/ep) of its rows go to the E/ep
   experts of one peer, and all of a device's tokens may. Both put peer p's rows at rows
   [p*S, p*S + n_p) of the receive buffer, so everything after is shared and the two give identical
   results;
4. runs its experts' FFN over the received rows (grouped_ffn.grouped_ffn; padding rows give zeros);
5. sends the outputs back the same way and combines them, weighted, into its tokens (fp32 accumulation).

Steps 3 and 5 (and their backward) can travel in a lower precision than the activations (float8 with
per-128-channel scales, or bfloat16; the plan's `dispatch_formats`/`combine_formats`): sharding/
exchange_formats.py converts on both sides of the same exchanges.

Receive buffers. Dropless needs them for the worst case (ep*S rows); the grouped GEMMs compute only the
rows routing sent (the CPU's blocked GEMM in blocks sized for balanced routing, A rows, plus overflow
tiles; the GPU kernels only the tiles holding rows). The worst case is ep*min(K, E/ep)/K times the A rows a
device receives under balanced routing: 32 x for DeepSeek-V3's 256-way exchange, where those buffers,
their tiled copies and the kernels' hidden units dominate a layer's memory. With `parallel.moe_buffer_factor`
f >= 1 the plan caps each buffer at f x A rows (`receive_rows`), and the peers' rows lie one after another
in it, peer order, each peer's sorted by my local expert (`_capped_moves`: each sender learns where its
rows start in each receiver and how many fit, an all_to_all of ep x 2 int32). Rows past the end are
neither sent nor computed, and come back as zeros: then the result is wrong, so every call reports its
fullest buffer's use (rows sent over rows held, the max over devices and chunks), and a train step where it
exceeds 1 anywhere is not taken but run again with worst-case buffers (training/train_step.py,
`dropless_fallback`): no assignment is ever dropped for good. XLA:CPU still moves the padded worst-case
slots and copies out the rows the buffer keeps (the same rows, the same results; no memory saved there).
Capacity mode marks dropped assignments with expert id E before calling here: they are never sent.

Expert-tensor parallelism: when the rules also split the experts' width (`exp_mlp`) over some axes, each
device computes partial sums over its slice of the width; they are psum-ed, or reduce-scattered back to the
residual stream's layout where the tokens were split over those axes (they are all-gathered first; `tp_sp`).

Weights stored split along D (the fsdp preset, `mesh.weight_storage`) enter the op as stored and are
all-gathered here, cast to the compute dtype first (`_gather_stored`): the gathers move the compute dtype
in the forward and in the remat'd backward alike, and the gradient is reduce-scattered to the storage split.

Implementations (the plan's `expert_ffn` picks one; sharding/plan.py):
- `local` (ep == 1): nothing to exchange, the one-device computation (grouped_ffn.moe_local);
- `all_to_all`: steps 1-5 over `chunks` chunks of a device's tokens (after the expert-tensor gather),
  pipelined so that one chunk's exchanges overlap another chunk's GEMM (sharding/moe_pipeline.py: the
  schedule, buffer sizes and bytes moved); one chunk in the reference tier, `parallel.moe_chunks` in the
  others. It is built from three stages: `_send` (steps 1-3), `_compute` (4) and `_receive` (5), with the
  plan's exchange (`_EXCHANGES`: ragged or padded) and grouped GEMM;
- `fused` (pallas tier, on Hopper GPUs, for widths the kernels tile): steps 2-5 as two fused kernels over
  a tile plan (meshmoe.pallas_kernels.moe_routing): dispatch + the gate/up grouped GEMM, each tile's GEMM
  starting when its rows arrive and SwiGLU applied to the tile in the kernel (no [R, F] gate or up buffer;
  another activation would run between the kernels in XLA), then the down projection + the return of each
  finished tile to its owner, where step 5's combine sums each token's rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshmoe.pallas_kernels import moe_routing
from meshmoe.pallas_kernels.moe_dispatch_gemm import api as moe_dispatch_gemm
from meshmoe.pallas_kernels.moe_gemm_return import api as moe_gemm_return
from meshmoe.sharding import exchange_formats, gradient_sync, grouped_ffn, moe_pipeline, parallel
from meshmoe.sharding.grouped_ffn import Activation, ExpertWeights
from meshmoe.sharding.parallel import Axes
from meshmoe.sharding.plan import ExpertChoice, ExpertLayout, Hardware, grouped_gemm, grouped_gemm_for
from meshmoe.sharding.shardings import current


def moe_ffn(x_BSD: jax.Array, experts_BSK: jax.Array, weights_BSK: jax.Array, w: ExpertWeights,
            activation: Activation, replicas: ExpertWeights | None = None) -> jax.Array:
  """sum_k weights_BSK[..., k] * FFN_{experts_BSK[..., k]}(x_BSD), each expert's FFN being
  down(activation(x @ gate, x @ up)); assignments with expert id E (the number of experts) contribute
  nothing. Runs as the active plan says; with none, on one device with the platform's grouped GEMM.
  Where the plan compresses the weights' gradient sum over their replicas (sharding/gradient_sync.py), the
  op runs on per-replica copies of `w`: `replicas` ([R, ...] each; `expert_replicas`), or its own."""
  return moe_ffn_and_buffer_use(x_BSD, experts_BSK, weights_BSK, w, activation, replicas)[0]


def moe_ffn_and_buffer_use(x_BSD: jax.Array, experts_BSK: jax.Array, weights_BSK: jax.Array, w: ExpertWeights,
                           activation: Activation, replicas: ExpertWeights | None = None
                           ) -> tuple[jax.Array, jax.Array]:
  """(`moe_ffn`'s result, the fullest receive buffer's use): where the plan caps the receive buffers
  (`parallel.moe_buffer_factor`), the most rows any device's buffer was sent over the rows it holds, a
  float32 scalar the same on every device; above 1, rows were left out and the result is wrong (the train
  step then redoes the step with worst-case buffers). 0 where the buffers hold the worst case."""
  plan = current()
  no_use = jnp.zeros((), jnp.float32)
  if plan is None:
    hardware = Hardware.of(jax.devices()[0])
    gemm, kernels, _ = grouped_gemm_for(grouped_gemm("auto", hardware), hardware, x_BSD.dtype, x_BSD.shape[-1],
                                        w.gate_EDF.shape[-1])
    return grouped_ffn.moe_local(x_BSD, experts_BSK, weights_BSK, w, activation, gemm, kernels=kernels), no_use
  lay = plan.expert_layout()

  w_specs = ExpertWeights(lay.gate_spec, lay.gate_spec, lay.down_spec)
  compressed = plan.gradient_compression != "none"
  if lay.weight_gather:
    w_specs = ExpertWeights(lay.gate_shard_spec, lay.gate_shard_spec, lay.down_shard_spec)
  if compressed:  # one copy per replica, whose gradients gradient_sync sums
    axes = plan.gradient_replica_axes
    if replicas is None:
      w = jax.tree.map(lambda a: a.astype(x_BSD.dtype), w)
      replicas = gradient_sync.per_replica(w, None, plan.mesh, w_specs, plan.gradient_compression, axes)
    w = replicas
    w_specs = jax.tree.map(lambda spec: gradient_sync.replica_spec(spec, axes), w_specs,
                           is_leaf=lambda x: isinstance(x, PartitionSpec))

  def body(x_BSD, experts_BSK, weights_BSK, w):
    if compressed:
      w = jax.tree.map(lambda a: a[0], w)
    if lay.gather:
      x_BSD, experts_BSK, weights_BSK = (jax.lax.all_gather(a, lay.gather, axis=lay.token_dim, tiled=True)
                                         for a in (x_BSD, experts_BSK, weights_BSK))
    if lay.reduce:
      # Tokens are the same on every width slice; marking them as differing here puts the backward's sum
      # over those slices on the [B, S, D] input instead of on the padded dispatch buffers inside.
      x_BSD, weights_BSK = (jax.lax.pcast(a, lay.reduce, to="varying") for a in (x_BSD, weights_BSK))
    if lay.weight_gather:
      w = _gather_stored(w, x_BSD, lay.weight_gather)
    choice = plan.expert_ffn(lay.ep, x_BSD.shape[-1], w.gate_EDF.shape[-1], x_BSD.dtype)
    uses = []  # the capped receive buffers' use, one per chunk (`_send`)
    y_BSD = IMPLEMENTATIONS[choice.implementation](x_BSD, experts_BSK, weights_BSK, w, activation, lay, choice,
                                                    plan.hardware.num_sms, uses.append)
    if lay.gather:
      y_BSD = jax.lax.psum_scatter(y_BSD, lay.gather, scatter_dimension=lay.token_dim, tiled=True)
    if lay.reduce:
      y_BSD = jax.lax.psum(y_BSD, lay.reduce)
    # The most of any chunk on any device, so that every device takes the same decision.
    use = no_use
    if uses:
      use = jax.lax.stop_gradient(jnp.max(jnp.stack(uses)))
      use = jax.lax.pmax(use, parallel.varying_axes(use))
    return y_BSD, use

  x_spec = lay.token_spec
  return parallel.shard_map(plan, body, (x_spec, x_spec, x_spec, w_specs), (x_spec, PartitionSpec()))(
      x_BSD, experts_BSK, weights_BSK, w)


def _gather_stored(w: ExpertWeights, x_BSD: jax.Array, axes: Axes) -> ExpertWeights:
  """The expert weights stored split along D over `axes` (FSDP, `mesh.weight_storage`), whole along D, in
  the compute dtype. The op gathers them itself rather than leave it to GSPMD at its boundary: each gather
  moves the shard already cast to the compute dtype (GSPMD's gathers float32 in the remat'd backward, twice
  the bytes), and its transpose is a reduce-scatter of the gradient (GSPMD's all-reduces it over `axes`,
  then slices it to storage: twice the bytes). The shard is marked varying over the tokens' other axes
  first, so that the gradient's sum over those runs after the reduce-scatter, on the shard."""
  others = parallel.without(parallel.varying_axes(x_BSD), axes)

  def gather(a: jax.Array, dim: int) -> jax.Array:
    # Gathered along a new leading dimension, then moved in place: gathering along D itself makes XLA
    # transpose D to the front of the stored float32 stack of every layer first (copies of all layers'
    # weights, outside the layer loop: 5.7 GB more on Mixtral-8x7B, fsdp on 64 H100s, deviceless).
    parts = jax.lax.all_gather(parallel.vary_over(a.astype(x_BSD.dtype), others), axes)
    shape = list(a.shape)
    shape[dim] *= parts.shape[0]
    return jnp.moveaxis(parts, 0, dim).reshape(shape)

  return ExpertWeights(gather(w.gate_EDF, 1), gather(w.up_EDF, 1), gather(w.down_EFD, 2))


def expert_replicas(w_L: ExpertWeights, grad_residual: ExpertWeights | None) -> ExpertWeights | None:
  """An MoE layer stack's expert weights ([layers, ...] each) as one copy per gradient replica, [layers, R,
  ...], whose gradients are summed compressed after the layer loop, with `grad_residual` ([layers, R, ...] each,
  or None) as its error feedback (sharding/gradient_sync.py); None where the active plan does not compress.
  The copies are of the weights as stored (float32), so each device's copy is a view of its parameters;
  copies of the weights cast to the compute dtype would be new arrays (2.1 GB more on moe_1b, deviceless)."""
  plan = current()
  if plan is None or plan.gradient_compression == "none":
    return None
  specs = ExpertWeights(*(plan.param_spec(("layers", *names)) for names in (
      ("exp", "embed", "exp_mlp"), ("exp", "embed", "exp_mlp"), ("exp", "exp_mlp", "embed"))))
  return gradient_sync.per_replica(w_L, grad_residual, plan.mesh, specs, plan.gradient_compression,
                                   plan.gradient_replica_axes, axis=1)


# --- The implementations: (x_BSD, experts_BSK, weights_BSK, w, activation, layout, choice, SMs, report) -> y_BSD,
# `report` taking each capped receive buffer's use (`_send`). ------------------------------------------------


def _local(x_BSD, experts_BSK, weights_BSK, w, activation, lay: ExpertLayout, choice: ExpertChoice,
           num_sms: int, report: Callable) -> jax.Array:
  """Every expert is here: nothing to exchange, nothing to overlap."""
  return grouped_ffn.moe_local(x_BSD, experts_BSK, weights_BSK, w, activation, choice.grouped_gemm,
                               choice.block_rows, choice.gemm_kernels)


def _all_to_all(x_BSD, experts_BSK, weights_BSK, w, activation, lay: ExpertLayout, choice: ExpertChoice,
                num_sms: int, report: Callable) -> jax.Array:
  """Steps 1-5 for one device's tokens: in one pass, or in `choice.chunks` pipelined chunks."""
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  # Cast and mark the weights once for all chunks, so that autodiff sums the expert gradient over the token
  # axes once, in bfloat16. Cast in each chunk's GEMM, each chunk's gradient would be summed on its own and
  # XLA would join those sums into one float32 all-reduce: twice the bytes of the one sum.
  w = jax.tree.map(lambda a: parallel.vary_over(a.astype(x_BSD.dtype), parallel.varying_axes(x_BSD)), w)
  exchange = _EXCHANGES[choice.exchange]
  ep = lay.ep
  y_TD = moe_pipeline.pipelined(
      functools.partial(_send, exchange=exchange, axes=lay.expert_axes, ep=ep, local_experts=w.num_experts,
                        formats=choice.dispatch_formats, buffer_factor=choice.buffer_factor, report=report),
      functools.partial(_compute, w=w, activation=activation, choice=choice),
      functools.partial(_receive, exchange=exchange, axes=lay.expert_axes, ep=ep, local_experts=w.num_experts,
                        formats=choice.combine_formats),
      x_BSD.reshape(b * s, d), experts_BSK.reshape(b * s, k), weights_BSK.reshape(b * s, k), choice.chunks)
  return y_TD.reshape(b, s, d)


def _fused(x_BSD, experts_BSK, weights_BSK, w, activation, lay: ExpertLayout, choice: ExpertChoice,
           num_sms: int, report: Callable) -> jax.Array:
  """Steps 2-5 as the two fused MoE kernels (module docstring) on `choice.kernel_backend`."""
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  axes, backend = lay.expert_axes, choice.kernel_backend
  token_A = jnp.arange(b * s * k) // k
  # The kernels' custom gradients need the rows and the weights to vary over the same mesh axes (the
  # weights' gradients are then summed over the token axes, as autodiff would).
  union = tuple(dict.fromkeys(parallel.varying_axes(x_BSD) + parallel.varying_axes(w.gate_EDF)))
  x_TD = parallel.vary_over(x_BSD.reshape(b * s, d), union)
  gate, up, down = (parallel.vary_over(a.astype(x_BSD.dtype), union) for a in (w.gate_EDF, w.up_EDF, w.down_EFD))
  tile_rows = choice.tiles.block_m  # the kernels' tile height is the plan's
  tile_plan = moe_routing.make_tile_plan(experts_BSK.reshape(-1), axes, w.num_experts, tile_rows)
  options = dict(tile_rows=tile_rows, backend=backend, num_sms=num_sms, tiles=choice.tiles)
  if activation is grouped_ffn.swiglu_hidden:  # fused into the dispatch kernel: no [R, F] gate or up buffer
    hidden_RF = moe_dispatch_gemm.dispatch_swiglu(x_TD[token_A], gate, up, tile_plan, axes,
                                                  gradient=choice.swiglu_gradient, **options)
  else:
    hidden_RF = activation(*moe_dispatch_gemm.dispatch_gemm(x_TD[token_A], (gate, up), tile_plan, axes, **options))
  y_AD = moe_gemm_return.gemm_return((hidden_RF,), (down,), tile_plan, axes, backend=backend, num_sms=num_sms,
                                     tiles=choice.tiles)
  return grouped_ffn.combine(y_AD, weights_BSK.reshape(-1), token_A, b * s).reshape(b, s, d)


IMPLEMENTATIONS = {"local": _local, "all_to_all": _all_to_all, "fused": _fused}


class _Moves(NamedTuple):
  """Where a chunk's rows travel (integer arrays; the exchanges' `moves`). Peer p's rows land at rows
  [offset_P[p], offset_P[p] + kept_P[p]) of my receive buffer; mine at [write_at_P[p], + sent_P[p]) of
  peer p's. Worst-case buffers: slot p of S rows each (offset p*S) and every row kept; capped buffers
  (`receive_rows`): the peers' rows one after another, rows past the buffer's end neither sent nor kept."""

  peer_A: jax.Array  # destination of each sorted assignment; ep for dropped ones
  rank_A: jax.Array  # its row among those sent to that peer
  send_P: jax.Array  # rows I route to each peer
  recv_P: jax.Array  # rows each peer routes to me
  offset_P: jax.Array  # where each peer's rows start in my buffer
  kept_P: jax.Array  # how many of each peer's rows my buffer holds (recv_P unless it overflows)
  write_at_P: jax.Array  # where my rows start in each peer's buffer
  sent_P: jax.Array  # how many of my rows each peer's buffer holds (send_P unless it overflows)
  slot_R: jax.Array | None  # capped buffers: each row's place in the worst-case slot layout (ep*S: none)


class _Route(NamedTuple):
  """What `_send` leaves for a chunk's `_compute` and `_receive`."""
  expert_R: jax.Array  # my local expert of each received row; E/ep for padding rows (zeros)
  order_A: jax.Array  # the assignments sorted by expert
  moves: _Moves
  weights_TK: jax.Array  # combine weights


def peer_slot(num_tokens: int, top_k: int, local_experts: int) -> int:
  """S, the most rows one device can send one peer: each token's top_k experts are distinct, so at most
  min(top_k, E/ep) of its rows go to one peer's experts (step 3 of the module docstring)."""
  return num_tokens * min(top_k, local_experts)


def receive_rows(num_tokens: int, top_k: int, local_experts: int, ep: int, buffer_factor: float) -> int:
  """Rows of a device's receive buffer for a chunk of `num_tokens` tokens per device: the dropless worst
  case, ep x S (`peer_slot`), or with `buffer_factor` f > 0 (`parallel.moe_buffer_factor`) f x the A = T x K
  rows every device receives under balanced routing, rounded up to a multiple of 8, at most the worst case."""
  worst = ep * peer_slot(num_tokens, top_k, local_experts)
  if not buffer_factor:
    return worst
  return min(worst, -(-math.ceil(buffer_factor * num_tokens * top_k) // 8) * 8)


def _send(x_TD, experts_TK, weights_TK, *, exchange: _Exchange, axes: parallel.Axes, ep: int,
          local_experts: int, formats: tuple[str, str], buffer_factor: float = 0.0,
          report: Callable = lambda use: None) -> tuple[jax.Array, _Route]:
  """Steps 1-3 for tokens x_TD: my assignments' rows, received by their experts' devices, travelling in
  `formats` (forward, backward; exchange_formats.py). Returns my receive buffer (`_Moves` says where each
  peer's rows are; each peer's sorted by my local expert) and its route. With capped buffers
  (`buffer_factor`), `report` gets the rows sent me over the rows my buffer holds."""
  num_tokens, k = experts_TK.shape
  num_assignments = num_tokens * k
  token_A = jnp.arange(num_assignments) // k
  expert_A = experts_TK.reshape(-1)
  num_experts = local_experts * ep
  order_A = jnp.argsort(expert_A, stable=True)  # by expert, so by destination; dropped (id E) last
  peer_A = expert_A[order_A] // local_experts  # == ep for dropped assignments
  counts_E = jnp.bincount(expert_A, length=num_experts).astype(jnp.int32)
  send_P = jnp.sum(counts_E.reshape(ep, local_experts), axis=1)
  first_P = jnp.cumsum(send_P) - send_P
  rank_A = jnp.arange(num_assignments) - first_P[jnp.minimum(peer_A, ep - 1)]
  # 2. Counts first: recv_PE[p, e] = rows peer p sends for my local expert e.
  recv_PE = jax.lax.all_to_all(counts_E.reshape(ep, local_experts), axes, 0, 0)
  recv_P = jnp.sum(recv_PE, axis=1)
  # 3. Tokens, into the buffer `_Moves` describes.
  slot = peer_slot(num_tokens, k, local_experts)
  rows = receive_rows(num_tokens, k, local_experts, ep, buffer_factor)
  if rows < ep * slot:
    moves, local_expert_R = _capped_moves(peer_A, rank_A, send_P, recv_P, recv_PE, rows, slot, axes, ep)
    report(jnp.sum(recv_P).astype(jnp.float32) / rows)
  else:
    me = jax.lax.axis_index(axes)
    moves = _Moves(peer_A, rank_A, send_P, recv_P, jnp.arange(ep, dtype=jnp.int32) * slot, recv_P,
                   jnp.full((ep,), me * slot, jnp.int32), send_P, None)
    # Each slot row's local expert: its place in the slot against that peer's cumulative counts.
    cumulative_PE = jnp.cumsum(recv_PE, axis=1)
    row_S = jnp.arange(slot)
    local_expert_R = jax.vmap(lambda c: jnp.searchsorted(c, row_S, side="right"))(cumulative_PE).reshape(-1)
  sent_AD = x_TD[token_A[order_A]]
  to_experts = functools.partial(exchange.to_experts, slot=slot, rows=rows, axes=axes, ep=ep)
  if exchange_formats.is_plain(*formats):
    received_RD = to_experts(sent_AD, moves)
  else:
    received_RD = exchange_formats.move_rows(
        exchange_formats.Movers(to_experts, functools.partial(exchange.to_senders, slot=slot, axes=axes, ep=ep)),
        exchange_formats.Trip(*formats, sent_AD.dtype, sent_AD.dtype), sent_AD, moves)
  return received_RD, _Route(local_expert_R, order_A, moves, weights_TK)


def _capped_moves(peer_A, rank_A, send_P, recv_P, recv_PE, rows: int, slot: int, axes, ep: int):
  """(_Moves of a capped buffer of `rows` rows, each row's local expert (E/ep: padding)): the peers' rows one
  after another in peer order, each peer's by my local expert, those past the end left out. Each sender
  learns where its rows start in each receiver and how many fit (an all_to_all of ep x 2 int32)."""
  local_experts = recv_PE.shape[1]
  offset_P = (jnp.cumsum(recv_P) - recv_P).astype(jnp.int32)
  kept_P = jnp.clip(rows - offset_P, 0, recv_P).astype(jnp.int32)
  told = jax.lax.all_to_all(jnp.stack([offset_P, kept_P], axis=1), axes, 0, 0)
  row = jnp.arange(rows)
  # Row r's (peer, local expert) pair, in the buffer's order: where r falls among the pairs' cumulative
  # counts (ep x E/ep of them, past the last one for padding rows).
  pair_R = jnp.searchsorted(jnp.cumsum(recv_PE.reshape(-1)), row, side="right")
  real = pair_R < ep * local_experts
  peer_R = jnp.minimum(pair_R // local_experts, ep - 1)
  slot_R = jnp.where(real, peer_R * slot + row - offset_P[peer_R], ep * slot)
  local_expert_R = jnp.where(real, pair_R % local_experts, local_experts)
  return _Moves(peer_A, rank_A, send_P, recv_P, offset_P, kept_P, told[:, 0], told[:, 1], slot_R), local_expert_R


def _compute(received_RD, route: _Route, *, w: ExpertWeights, activation: Activation,
             choice: ExpertChoice) -> jax.Array:
  """Step 4: my experts (w holds only this device's slice); padding rows (id E/ep) give zeros. Of the
  ep x A rows of the worst-case buffer, routing that balances the experts sends me A."""
  return grouped_ffn.grouped_ffn(received_RD, route.expert_R, w, activation, choice.grouped_gemm,
                                 choice.block_rows, choice.gemm_kernels, routed_rows=route.order_A.shape[0])


def _receive(y_RD, route: _Route, *, exchange: _Exchange, axes: parallel.Axes, ep: int, local_experts: int,
             formats: tuple[str, str]) -> jax.Array:
  """Step 5: the outputs back to their senders in `formats` (forward, backward), then into each token (a
  float32 sum whatever the format): y_TD."""
  num_tokens, k = route.weights_TK.shape
  slot = peer_slot(num_tokens, k, local_experts)
  token_A = jnp.arange(num_tokens * k) // k
  moves = route.moves
  to_senders = functools.partial(exchange.to_senders, slot=slot, axes=axes, ep=ep)
  if exchange_formats.is_plain(*formats):
    y_sorted_AD = to_senders(y_RD, moves)
  else:
    to_experts = functools.partial(exchange.to_experts, slot=slot, rows=y_RD.shape[0], axes=axes, ep=ep)
    y_sorted_AD = exchange_formats.move_rows(exchange_formats.Movers(to_senders, to_experts),
                                             exchange_formats.Trip(*formats, y_RD.dtype, y_RD.dtype), y_RD, moves)
  y_AD = jnp.zeros_like(y_sorted_AD).at[route.order_A].set(y_sorted_AD, unique_indices=True)
  return grouped_ffn.combine(y_AD, route.weights_TK.reshape(-1), token_A, num_tokens)


# --- Token exchanges, by a route's `_Moves`; rows of any dtype (they are only moved). `to_experts` puts peer
# p's rows at rows [offset_P[p], + kept_P[p]) of every receiver's buffer of `rows` rows (ep*S for the worst
# case); `to_senders`, its transpose, returns each of those rows to the assignment it came from, as [A, W]
# rows sorted by destination (zeros for dropped assignments and for rows a capped buffer left out). --------


class _Exchange(NamedTuple):
  to_experts: Callable  # (rows_AD sorted by destination, moves, *, slot S, rows, axes, ep) -> [rows, W]
  to_senders: Callable  # (rows_RD [rows, W] in receive layout, moves, *, slot S, axes, ep) -> [A, W]


def _padded_to_experts(rows_AD, moves: _Moves, *, slot, rows, axes, ep):
  """all_to_all of an [ep, S, W] buffer: my sorted rows go to slot [peer, rank]. A capped buffer then takes
  its rows out of the slots (XLA:CPU, which has no ragged exchange, moves the worst case regardless)."""
  w = rows_AD.shape[-1]
  buffer_PSW = jnp.zeros((ep, slot, w), rows_AD.dtype).at[moves.peer_A, moves.rank_A].set(rows_AD, mode="drop")
  slotted_RD = jax.lax.all_to_all(buffer_PSW, axes, 0, 0).reshape(ep * slot, w)
  if moves.slot_R is None:
    return slotted_RD
  return jnp.where((moves.slot_R < ep * slot)[:, None], slotted_RD[jnp.minimum(moves.slot_R, ep * slot - 1)], 0)


def _padded_to_senders(rows_RD, moves: _Moves, *, slot, axes, ep):
  """The receive buffer in slot layout (a capped one's rows put back in their slots) all_to_all'd back
  whole, then each assignment's slot [peer, rank] read; rows a capped buffer left out come back zero."""
  w = rows_RD.shape[-1]
  if moves.slot_R is not None:
    rows_RD = jnp.zeros((ep * slot, w), rows_RD.dtype).at[moves.slot_R].set(rows_RD, mode="drop")
  returned_PSW = jax.lax.all_to_all(rows_RD.reshape(ep, slot, w), axes, 0, 0)
  peer_A, rank_A = moves.peer_A, moves.rank_A
  kept = peer_A < ep
  if moves.slot_R is not None:
    kept &= rank_A < moves.sent_P[jnp.minimum(peer_A, ep - 1)]
  return jnp.where(kept[:, None], returned_PSW[jnp.minimum(peer_A, ep - 1), rank_A], 0)


def _ragged_to_experts(rows_AD, moves: _Moves, *, slot, rows, axes, ep):
  """ragged_all_to_all of my rows for each peer (contiguous per destination already, the ones its buffer
  holds) to where that peer keeps them."""
  return _exchange_rows(rows, axes, rows_AD, _first_rows(moves.send_P), moves.sent_P.astype(jnp.int32),
                        moves.write_at_P.astype(jnp.int32), moves.kept_P.astype(jnp.int32))


def _ragged_to_senders(rows_RD, moves: _Moves, *, slot, axes, ep):
  """Peer p's rows (at offset_P[p] of my buffer) straight back to where p read them: its sorted rows for me
  start at its first_P[me], learnt by an all_to_all of the first rows. Only the real rows travel and land,
  in an [A, W] result (not a buffer of the receive side's size: ep*min(K, E/ep)/K times smaller for the
  worst case)."""
  where_peers_read = jax.lax.all_to_all(_first_rows(moves.send_P), axes, 0, 0, tiled=True)
  return _exchange_rows(moves.peer_A.shape[0], axes, rows_RD, moves.offset_P.astype(jnp.int32),
                        moves.kept_P.astype(jnp.int32), where_peers_read, moves.sent_P.astype(jnp.int32))


def _first_rows(send_P) -> jax.Array:
  """Where each destination's rows start among rows sorted by destination."""
  return (jnp.cumsum(send_P) - send_P).astype(jnp.int32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _exchange_rows(rows_out: int, axes, rows_XD, input_offsets, send_sizes, output_offsets, recv_sizes):
  """`ragged_all_to_all` into fresh zeros [rows_out, D]; its backward is the reverse exchange, also into
  fresh zeros (jax's own transpose rule would use a constant zeros buffer)."""
  rows_XD, output = _fresh_zeros(rows_XD, rows_out)
  return jax.lax.ragged_all_to_all(rows_XD, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                   axis_name=axes)


def _fresh_zeros(rows_XD, num_rows: int) -> tuple[jax.Array, jax.Array]:
  """(rows_XD, zeros [num_rows, D]) with the zeros built where the rows are ready. A constant zeros buffer
  is loop-invariant: XLA hoists it out of the layer scan, merges it with the other layers' and the
  backward's, and keeps them all alive through the step in the memory it reserves for collectives (moe_1b
  tp_sp on 8 H100s: five receive buffers, 2.7 GB). Passing the zero through an optimization barrier with
  the rows to send makes the buffer a value of this exchange, made no earlier than its rows, so only the
  chunks in flight hold one (a zero tied to the routing counts instead would make every chunk's buffer
  of the xla tier at the start of the layer, all live at once). zeros_like: the result varies over the rows'
  mesh axes, as ragged_all_to_all's result must (a device-invariant `output` would type it invariant, and
  the backward would sum every device's cotangent into each)."""
  rows_XD, zero = jax.lax.optimization_barrier((rows_XD, jnp.zeros_like(rows_XD, shape=())))
  return rows_XD, jnp.broadcast_to(zero, (num_rows, rows_XD.shape[-1]))


def _exchange_rows_fwd(rows_out, axes, rows_XD, input_offsets, send_sizes, output_offsets, recv_sizes):
  out = _exchange_rows(rows_out, axes, rows_XD, input_offsets, send_sizes, output_offsets, recv_sizes)
  return out, (rows_XD.shape[0], input_offsets, send_sizes, output_offsets, recv_sizes)


def _exchange_rows_bwd(rows_out, axes, residuals, grad_out):
  """Every row came from a peer's operand: send each back to where it was read. Peer p wrote my rows
  [output_offsets'[p], + recv_sizes[p]), output_offsets' being what p used for me (an all_to_all), and read
  them at its input offset for me."""
  del rows_out
  rows_in, input_offsets, send_sizes, output_offsets, recv_sizes = residuals
  where_peers_wrote = jax.lax.all_to_all(output_offsets, axes, 0, 0, tiled=True)
  where_peers_read = jax.lax.all_to_all(input_offsets, axes, 0, 0, tiled=True)
  grad_rows = _exchange_rows(rows_in, axes, grad_out, where_peers_wrote, recv_sizes, where_peers_read,
                             send_sizes)
  return grad_rows, None, None, None, None


_exchange_rows.defvjp(_exchange_rows_fwd, _exchange_rows_bwd)


_EXCHANGES = {"padded_all_to_all": _Exchange(_padded_to_experts, _padded_to_senders),
              "ragged_all_to_all": _Exchange(_ragged_to_experts, _ragged_to_senders)}
