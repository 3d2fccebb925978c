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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from meshmoe.sharding import dispatch, parallel
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
  num_experts = w.num_experts

  def body(x_BSD, experts_BSK, weights_BSK, w):
    if gather:
      x_BSD, experts_BSK, weights_BSK = (jax.lax.all_gather(a, gather, axis=token_dim, tiled=True)
                                         for a in (x_BSD, experts_BSK, weights_BSK))
    if reduce:
      # Tokens are the same on every width slice; marking them as differing here puts the backward's sum
      # over those slices on the [B, S, D] input instead of on the padded dispatch buffers inside.
      x_BSD, weights_BSK = (jax.lax.pcast(a, reduce, to="varying") for a in (x_BSD, weights_BSK))
    y_BSD = _moe_expert_parallel(x_BSD, experts_BSK, weights_BSK, w, num_experts, expert_axes, ep,
                                 ragged, gemm_impl, block_rows)
    if gather:
      y_BSD = jax.lax.psum_scatter(y_BSD, gather, scatter_dimension=token_dim, tiled=True)
    if reduce:
      y_BSD = jax.lax.psum(y_BSD, reduce)
    return y_BSD

  w_specs = ExpertWeights(gate_spec, gate_spec, down_spec)
  return parallel.shard_map(ctx, body, (x_spec, x_spec, x_spec, w_specs), x_spec)(
      x_BSD, experts_BSK, weights_BSK, w)


def _gathered_token_dim(x_spec, width_axes) -> tuple[int, parallel.Axes]:
  """The token dimension (0 batch, 1 sequence) split over expert-width axes, and those axes: the tokens
  are gathered over them so that every width slice sees the same tokens."""
  for dim in (1, 0):
    shared = parallel.split_suffix(parallel.dim_axes(x_spec, dim), width_axes,
                                   "expert-tensor-parallel all-gather of the tokens")
    if shared:
      return dim, shared
  return 1, ()


def _moe_expert_parallel(x_BSD, experts_BSK, weights_BSK, w: ExpertWeights, num_experts: int,
                         expert_axes: parallel.Axes, ep: int, ragged: bool, impl: str, block_rows: int):
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  num_assignments = b * s * k
  token_A = jnp.arange(num_assignments) // k
  x_TD = x_BSD.reshape(b * s, d)
  expert_A = experts_BSK.reshape(-1)
  if ep == 1:
    y_AD = dispatch.grouped_swiglu(x_TD[token_A], expert_A, w, impl, block_rows)
    return dispatch.combine(y_AD, weights_BSK.reshape(-1), token_A, b * s).reshape(b, s, d)

  local_experts = num_experts // ep
  order_A = jnp.argsort(expert_A, stable=True)  # by expert, so by destination; dropped (id E) last
  peer_A = expert_A[order_A] // local_experts  # == ep for dropped assignments
  counts_E = jnp.bincount(expert_A, length=num_experts).astype(jnp.int32)
  send_P = jnp.sum(counts_E.reshape(ep, local_experts), axis=1)
  first_P = jnp.cumsum(send_P) - send_P
  rank_A = jnp.arange(num_assignments) - first_P[jnp.minimum(peer_A, ep - 1)]
  # 2. Counts first: recv_PE[p, e] = rows peer p sends for my local expert e.
  recv_PE = jax.lax.all_to_all(counts_E.reshape(ep, local_experts), expert_axes, 0, 0)
  recv_P = jnp.sum(recv_PE, axis=1)
  exchange = _ragged_exchange if ragged else _padded_exchange
  # 3. Tokens: rows [p*A, p*A + recv_P[p]) of the buffer come from peer p, sorted by my local expert.
  sent_AD = x_TD[token_A[order_A]]
  received_RD = exchange(sent_AD, peer_A, rank_A, send_P, recv_P, expert_axes, ep)
  cumulative_PE = jnp.cumsum(recv_PE, axis=1)
  slot_A = jnp.arange(num_assignments)
  local_expert_PA = jax.vmap(lambda c: jnp.searchsorted(c, slot_A, side="right"))(cumulative_PE)
  # 4. My experts (w holds only this device's slice); rows past a peer's count get id local_experts, i.e. zeros.
  y_RD = dispatch.grouped_swiglu(received_RD, local_expert_PA.reshape(-1), w, impl, block_rows)
  # 5. Back to the senders, then into each token.
  returned_PAD = exchange(y_RD, None, None, recv_P, send_P, expert_axes, ep, back=True)
  y_sorted_AD = jnp.where((peer_A < ep)[:, None], returned_PAD[jnp.minimum(peer_A, ep - 1), rank_A], 0)
  y_AD = jnp.zeros_like(y_sorted_AD).at[order_A].set(y_sorted_AD, unique_indices=True)
  return dispatch.combine(y_AD, weights_BSK.reshape(-1), token_A, b * s).reshape(b, s, d)


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
  output = jnp.zeros((ep * slot, rows_XD.shape[-1]), rows_XD.dtype)
  out = jax.lax.ragged_all_to_all(rows_XD, output, input_offsets, send_P.astype(jnp.int32), output_offsets,
                                  recv_P.astype(jnp.int32), axis_name=axes)
  return out.reshape(ep, slot, -1) if back else out
