"""Expert parallelism: tokens travel to the devices that hold their experts and back (dropless).

Experts are split over the "expert axes" (the rules' axes for `exp`, size ep); each device holds E/ep of
them. Each device routes its own tokens, then per MoE layer:

1. sorts its A = T*K assignments by expert (so by destination device) and counts them per expert;
2. exchanges the counts: an all_to_all of [ep, E/ep] int32, so each device knows how many rows each peer
   sends it for each of its experts before any token moves;
3. exchanges the tokens. GPU: `ragged_all_to_all` sends each peer exactly its rows. CPU (which lacks that
   op): a padded `all_to_all` of an [ep, A, D] buffer, A rows per peer because all of a device's
   assignments may go to one peer. Both put peer p's rows at rows [p*A, p*A + n_p) of the receive buffer,
   so everything after is shared and the two give identical results;
4. runs its experts' SwiGLU over the received rows (dispatch.grouped_swiglu; padding rows give zeros);
5. sends the outputs back the same way and combines them, weighted, into its tokens (fp32 accumulation).

Dropless needs receive buffers for the worst case (ep*A rows); the blocked CPU GEMM computes all of them,
so its executed expert FLOPs are up to ep x the useful ones (the GPU ragged_dot computes only real rows).
Capacity mode marks dropped assignments with expert id E before calling here: they are never sent.

Expert-tensor parallelism: when the rules also split the experts' width (`exp_mlp`) over some axes, each
device computes partial sums over its slice of the width; they are psum-ed, or reduce-scattered back to the
residual layout where the tokens were split over those axes (they are all-gathered first; `tp_sp`).

Tiers (`ParallelConfig.impl`, DESIGN.md): `reference` runs steps 1-5 once over all of a device's tokens;
`xla` runs them over `moe_chunks` chunks of those tokens (after the expert-tensor gather), pipelined so that
one chunk's exchanges overlap another chunk's GEMM (sharding/moe_pipeline.py: the schedule, buffer sizes
and bytes moved). Both are built from the same three stages: `_send` (steps 1-3), `_compute` (4) and
`_receive` (5). With ep == 1 nothing is exchanged and both are the one-device computation.
`pallas` (on Hopper GPUs, for widths the kernels tile) runs steps 2-5 as two fused kernels over a tile
plan (meshmoe.pallas_kernels.moe_routing): dispatch + the gate/up grouped GEMM, each tile's GEMM starting
when its rows arrive, then the down projection + the return of each finished tile to its owner, where
step 5's combine sums each token's rows. Elsewhere it runs the `xla` tier.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshmoe.config import ParallelConfig
from meshmoe.pallas_kernels import moe_routing, mosaic_tiles
from meshmoe.pallas_kernels.moe_dispatch_gemm import api as dispatch_kernel
from meshmoe.pallas_kernels.moe_gemm_combine import api as combine_kernel
from meshmoe.sharding import dispatch, moe_pipeline, parallel
from meshmoe.sharding.dispatch import ExpertWeights
from meshmoe.sharding.shardings import current

_TOKENS = ("act_batch", "act_seq", None)


def moe_ffn(x_BSD: jax.Array, experts_BSK: jax.Array, weights_BSK: jax.Array, w: ExpertWeights, *,
            gemm_impl: str, block_rows: int = 0) -> jax.Array:
  """sum_k weights_BSK[..., k] * SwiGLU_{experts_BSK[..., k]}(x_BSD); assignments with expert id E
  (the number of experts) contribute nothing. `gemm_impl` "auto" picks by the devices' platform."""
  ctx = current()
  platform = jax.default_backend() if ctx is None else ctx.mesh.devices.flat[0].platform
  if gemm_impl == "auto":  # ragged_dot is dense over all groups on CPU (dispatch.py)
    gemm_impl = "blocked" if platform == "cpu" else "ragged_dot"
  if ctx is None:
    return dispatch.moe_local(x_BSD, experts_BSK, weights_BSK, w, gemm_impl, block_rows)
  x_spec = parallel.activation_spec(ctx, _TOKENS)
  gate_spec = parallel.weight_spec(ctx, ("exp", "embed", "exp_mlp"))
  down_spec = parallel.weight_spec(ctx, ("exp", "exp_mlp", "embed"))
  expert_axes = parallel.dim_axes(gate_spec, 0)
  width_axes = parallel.dim_axes(gate_spec, 2)
  token_dim, gather = _gathered_token_dim(x_spec, width_axes)
  reduce = parallel.without(width_axes, gather)
  ep = parallel.axis_size(ctx, expert_axes)
  ragged = platform != "cpu"  # XLA:CPU has no ragged_all_to_all
  chunks = _num_chunks(ctx.parallel)

  def body(x_BSD, experts_BSK, weights_BSK, w):
    if gather:
      x_BSD, experts_BSK, weights_BSK = (jax.lax.all_gather(a, gather, axis=token_dim, tiled=True)
                                         for a in (x_BSD, experts_BSK, weights_BSK))
    if reduce:
      # Tokens are the same on every width slice; marking them as differing here puts the backward's sum
      # over those slices on the [B, S, D] input instead of on the padded dispatch buffers inside.
      x_BSD, weights_BSK = (jax.lax.pcast(a, reduce, to="varying") for a in (x_BSD, weights_BSK))
    d, f = x_BSD.shape[-1], w.gate_EDF.shape[-1]
    kernel = ep > 1 and parallel.fused_kernel_backend(
        ctx, "MoE dispatch/combine", dispatch_kernel.unsupported(d, [f, f], x_BSD.dtype)
        or combine_kernel.unsupported([f], d, x_BSD.dtype))
    if kernel:
      y_BSD = _fused_expert_parallel(x_BSD, experts_BSK, weights_BSK, w, axes=expert_axes, backend=kernel,
                                     num_sms=parallel.num_sms(ctx))
    else:
      y_BSD = _expert_parallel(x_BSD, experts_BSK, weights_BSK, w, axes=expert_axes, ep=ep, ragged=ragged,
                               impl=gemm_impl, block_rows=block_rows, chunks=chunks)
    if gather:
      y_BSD = jax.lax.psum_scatter(y_BSD, gather, scatter_dimension=token_dim, tiled=True)
    if reduce:
      y_BSD = jax.lax.psum(y_BSD, reduce)
    return y_BSD

  w_specs = ExpertWeights(gate_spec, gate_spec, down_spec)
  return parallel.shard_map(ctx, body, (x_spec, x_spec, x_spec, w_specs), x_spec)(
      x_BSD, experts_BSK, weights_BSK, w)


def _num_chunks(config: ParallelConfig) -> int:
  """Chunks of each device's tokens that the tier pipelines: 1 for `reference`, `moe_chunks` for `xla`."""
  if config.impl == "reference":
    return 1
  if config.impl in ("xla", "pallas"):  # "pallas" where the fused kernels do not apply
    return config.moe_chunks
  raise ValueError(f"expert parallelism has no {config.impl!r} tier; known: 'reference', 'xla', 'pallas'")


def _expert_parallel(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights, *, axes: parallel.Axes, ep: int,
                     ragged: bool, impl: str, block_rows: int, chunks: int) -> jax.Array:
  """Steps 1-5 for one device's tokens: in one pass, or in `chunks` pipelined chunks."""
  if ep == 1:  # every expert is here: nothing to exchange, nothing to overlap
    return dispatch.moe_local(x_BSD, experts_BSK, weights_BSK, w, impl, block_rows)
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  # Cast and mark the weights once for all chunks. Left to each chunk's GEMM, autodiff sums each chunk's
  # bfloat16 expert gradient over the token axes on its own, and XLA joins those sums into one float32
  # all-reduce: twice the reference's bytes (+1.2 GB per step on moe_1b, seen in the H100 AOT report).
  w = jax.tree.map(lambda a: parallel.vary_over(a.astype(x_BSD.dtype), parallel.varying_axes(x_BSD)), w)
  exchange = functools.partial(_ragged_exchange if ragged else _padded_exchange, axes=axes, ep=ep)
  y_TD = moe_pipeline.pipelined(
      functools.partial(_send, exchange=exchange, axes=axes, ep=ep, local_experts=w.num_experts),
      functools.partial(_compute, w=w, impl=impl, block_rows=block_rows),
      functools.partial(_receive, exchange=exchange, ep=ep),
      x_BSD.reshape(b * s, d), experts_BSK.reshape(b * s, k), weights_BSK.reshape(b * s, k), chunks)
  return y_TD.reshape(b, s, d)


def _fused_expert_parallel(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights, *, axes: parallel.Axes,
                           backend: str, num_sms: int) -> jax.Array:
  """Steps 2-5 as the two fused MoE kernels (module docstring) on `backend`."""
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  token_A = jnp.arange(b * s * k) // k
  # The kernels' custom gradients need the rows and the weights to vary over the same mesh axes (the
  # weights' gradients are then summed over the token axes, as autodiff would).
  union = tuple(dict.fromkeys(parallel.varying_axes(x_BSD) + parallel.varying_axes(w.gate_EDF)))
  x_TD = parallel.vary_over(x_BSD.reshape(b * s, d), union)
  gate, up, down = (parallel.vary_over(a.astype(x_BSD.dtype), union) for a in (w.gate_EDF, w.up_EDF, w.down_EFD))
  tile_rows = mosaic_tiles.DEFAULT_TILES.block_m
  plan = moe_routing.make_plan(experts_BSK.reshape(-1), axes, w.num_experts, tile_rows)
  gate_RF, up_RF = dispatch_kernel.dispatch_gemm(x_TD[token_A], (gate, up), plan, axes, tile_rows=tile_rows,
                                                 backend=backend, num_sms=num_sms)
  y_AD = combine_kernel.gemm_return((dispatch.swiglu_hidden(gate_RF, up_RF),), (down,), plan, axes,
                                    backend=backend, num_sms=num_sms)
  return dispatch.combine(y_AD, weights_BSK.reshape(-1), token_A, b * s).reshape(b, s, d)


def _gathered_token_dim(x_spec, width_axes) -> tuple[int, parallel.Axes]:
  """The token dimension (0 batch, 1 sequence) split over expert-width axes, and those axes: the tokens
  are gathered over them so that every width slice sees the same tokens."""
  for dim in (1, 0):
    shared = parallel.split_suffix(parallel.dim_axes(x_spec, dim), width_axes,
                                   "expert-tensor-parallel all-gather of the tokens")
    if shared:
      return dim, shared
  return 1, ()


class _Route(NamedTuple):
  """What `_send` leaves for a chunk's `_compute` and `_receive`."""
  expert_R: jax.Array  # my local expert of each received row; E/ep for padding rows (zeros)
  order_A: jax.Array  # the assignments sorted by expert
  peer_A: jax.Array  # destination of each sorted assignment; ep for dropped ones
  rank_A: jax.Array  # its row among those sent to that peer
  send_P: jax.Array  # rows I send to each peer
  recv_P: jax.Array  # rows each peer sends me
  weights_TK: jax.Array  # combine weights


def _send(x_TD, experts_TK, weights_TK, *, exchange, axes: parallel.Axes, ep: int,
          local_experts: int) -> tuple[jax.Array, _Route]:
  """Steps 1-3 for tokens x_TD: my assignments' rows, received by their experts' devices. Returns my
  receive buffer (peer p's rows at [p*A, p*A + n_p), sorted by my local expert) and its route."""
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
  # 3. Tokens: rows [p*A, p*A + recv_P[p]) of the buffer come from peer p, sorted by my local expert.
  sent_AD = x_TD[token_A[order_A]]
  received_RD = exchange(sent_AD, peer_A, rank_A, send_P, recv_P)
  cumulative_PE = jnp.cumsum(recv_PE, axis=1)
  slot_A = jnp.arange(num_assignments)
  local_expert_PA = jax.vmap(lambda c: jnp.searchsorted(c, slot_A, side="right"))(cumulative_PE)
  return received_RD, _Route(local_expert_PA.reshape(-1), order_A, peer_A, rank_A, send_P, recv_P, weights_TK)


def _compute(received_RD, route: _Route, *, w: ExpertWeights, impl: str, block_rows: int) -> jax.Array:
  """Step 4: my experts (w holds only this device's slice); padding rows (id E/ep) give zeros."""
  return dispatch.grouped_swiglu(received_RD, route.expert_R, w, impl, block_rows)


def _receive(y_RD, route: _Route, *, exchange, ep: int) -> jax.Array:
  """Step 5: the outputs back to their senders, then into each token: y_TD."""
  num_tokens, k = route.weights_TK.shape
  token_A = jnp.arange(num_tokens * k) // k
  peer_A, rank_A = route.peer_A, route.rank_A
  returned_PAD = exchange(y_RD, None, None, route.recv_P, route.send_P, back=True)
  y_sorted_AD = jnp.where((peer_A < ep)[:, None], returned_PAD[jnp.minimum(peer_A, ep - 1), rank_A], 0)
  y_AD = jnp.zeros_like(y_sorted_AD).at[route.order_A].set(y_sorted_AD, unique_indices=True)
  return dispatch.combine(y_AD, route.weights_TK.reshape(-1), token_A, num_tokens)


def _padded_exchange(rows_XD, peer_X, rank_X, send_P, recv_P, axes, ep, back=False):
  """all_to_all of a [ep, A, D] buffer. Forward: my sorted rows go to slot [peer, rank]. Back: the buffer
  is already in slot layout. Returns [ep*A, D] (forward) or [ep, A, D] (back), slot p from peer p."""
  del send_P, recv_P  # the padded buffer carries whole slots; the counts only matter to ragged sends
  if back:
    buffer_PAD = rows_XD.reshape(ep, -1, rows_XD.shape[-1])
    return jax.lax.all_to_all(buffer_PAD, axes, 0, 0)
  num_assignments, d = rows_XD.shape
  buffer_PAD = jnp.zeros((ep, num_assignments, d), rows_XD.dtype).at[peer_X, rank_X].set(rows_XD, mode="drop")
  return jax.lax.all_to_all(buffer_PAD, axes, 0, 0).reshape(ep * num_assignments, d)


def _ragged_exchange(rows_XD, peer_X, rank_X, send_P, recv_P, axes, ep, back=False):
  """ragged_all_to_all with the same slot layout as the padded exchange: I write into slot [my index] of
  every receiver's buffer, so a receiver finds peer p's rows at p*A."""
  del peer_X, rank_X  # forward rows are already contiguous per destination
  slot = rows_XD.shape[0] // ep if back else rows_XD.shape[0]
  input_offsets = (jnp.arange(ep, dtype=jnp.int32) * slot if back
                   else (jnp.cumsum(send_P) - send_P).astype(jnp.int32))
  me = jax.lax.axis_index(axes)
  output_offsets = jnp.full((ep,), me * slot, jnp.int32)
  # ragged_all_to_all types its result like `output`. A plain jnp.zeros is typed the same on every device
  # (invariant), so the result would be too, and the backward would psum its cotangent over the devices:
  # every device's gradient summed into each. zeros_like varies over the rows' mesh axes, as the result does.
  output = jnp.zeros_like(rows_XD, shape=(ep * slot, rows_XD.shape[-1]))
  out = jax.lax.ragged_all_to_all(rows_XD, output, input_offsets, send_P.astype(jnp.int32), output_offsets,
                                  recv_P.astype(jnp.int32), axis_name=axes)
  return out.reshape(ep, slot, -1) if back else out
