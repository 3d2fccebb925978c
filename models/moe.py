"""The MoE feed-forward block: router, routed SwiGLU experts, optional shared experts (legend in layers.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.config import ModelConfig
from meshmoe.models.capacity import capacity_keep
from meshmoe.models.layers import SwiGLU, param, swiglu_hidden
from meshmoe.models.router import Router, load_balancing_loss
from meshmoe.sharding import expert_parallel
from meshmoe.sharding.grouped_ffn import ExpertWeights
from meshmoe.sharding.shardings import constrain


@dataclasses.dataclass
class MoEStats:
  aux_loss: jax.Array  # scalar load-balancing loss
  z_loss: jax.Array  # scalar router z-loss
  load_E: jax.Array  # assignments per expert in this batch
  dropped_fraction: jax.Array  # share of the unmasked tokens' assignments dropped by capacity (0: dropless)
  score_mean_E: jax.Array  # mean normalised router score per expert (what the aux loss weighs the load by)
  tokens: jax.Array  # the unmasked tokens the statistics are over
  sequences: jax.Array  # the sequences with an unmasked token
  # The fullest capped receive buffer of the expert exchange (sharding/expert_parallel.py; rows sent over
  # rows held, above 1: rows were left out and the step must run again); 0 with worst-case buffers.
  buffer_use: jax.Array | float = 0.0


jax.tree_util.register_dataclass(MoEStats)


def merge_halves(a: MoEStats, b: MoEStats, per_sequence: bool) -> MoEStats:
  """The statistics of a batch from those of its two halves (the two-halves layer schedule, decoder.py):
  loads and counts add; means are weighted by the halves' unmasked tokens; the aux loss is recomputed
  from the merged terms, as the whole batch's would be (it is not linear in them), or, `per_sequence`
  (balance_loss="sequence": a mean over sequences), weighted by the halves' sequences."""
  tokens, sequences = a.tokens + b.tokens, a.sequences + b.sequences
  mean = lambda x, y: (x * a.tokens + y * b.tokens) / jnp.maximum(tokens, 1.0)
  load_E = a.load_E + b.load_E
  score_mean_E = mean(a.score_mean_E, b.score_mean_E)
  if per_sequence:
    aux_loss = (a.aux_loss * a.sequences + b.aux_loss * b.sequences) / jnp.maximum(sequences, 1.0)
  else:
    aux_loss = load_balancing_loss(load_E, score_mean_E)
  return MoEStats(aux_loss, mean(a.z_loss, b.z_loss), load_E, mean(a.dropped_fraction, b.dropped_fraction),
                  score_mean_E, tokens, sequences, jnp.maximum(a.buffer_use, b.buffer_use))


# Each token's experts and combine weights, as `route` decides them: (experts_BSK int32, weights_BSK float32).
# (Not the plan's ExpertChoice, which is how the expert op runs: sharding/plan.py.)
ExpertAssignment = tuple[jax.Array, jax.Array]


class MoEBlock(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    moe, d, std = cfg.moe, cfg.embed_dim, cfg.init_std
    self.cfg = moe
    self.router = Router(d, moe, std=std, rngs=rngs)
    self.gate_EDF = param(rngs, (moe.num_experts, d, moe.expert_mlp_dim), ("exp", "embed", "exp_mlp"), std)
    self.up_EDF = param(rngs, (moe.num_experts, d, moe.expert_mlp_dim), ("exp", "embed", "exp_mlp"), std)
    self.down_EFD = param(rngs, (moe.num_experts, moe.expert_mlp_dim, d), ("exp", "exp_mlp", "embed"), std)
    self.shared = (SwiGLU(d, moe.num_shared_experts * moe.expert_mlp_dim, std=std, rngs=rngs)
                   if moe.num_shared_experts else None)

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array | None = None,
               replicas: ExpertWeights | None = None, mask_BS: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
    """`positions_BS` (default 0..S-1) orders capacity priority when the sequence is permuted; `replicas`:
    see `routed_experts`; `mask_BS`: see `route`."""
    assignment, stats = self.route(x_BSD, positions_BS, mask_BS)
    y_BSD, buffer_use = self.routed_experts(x_BSD, assignment, replicas)
    if self.shared is not None:
      y_BSD = y_BSD + self.shared(x_BSD)
    return y_BSD, dataclasses.replace(stats, buffer_use=buffer_use)

  def route(self, x_BSD: jax.Array, positions_BS: jax.Array | None = None,
            mask_BS: jax.Array | None = None) -> tuple[ExpertAssignment, MoEStats]:
    """Each token's experts (id E where capacity drops the assignment) and combine weights. A token whose
    `mask_BS` is 0 (padding, or any token the loss ignores) is routed nowhere: its experts are id E, so no
    path sends or computes it (its output is the shared experts' alone), it takes no capacity slot, and it
    counts in no statistic (Router)."""
    b, s, _ = x_BSD.shape
    num_experts = self.cfg.num_experts
    routing = self.router(x_BSD, mask_BS)
    experts_BSK = routing.experts_TK
    if mask_BS is not None:
      experts_BSK = jnp.where((mask_BS != 0)[..., None], experts_BSK, num_experts)
    dropped_fraction = jnp.zeros((), jnp.float32)
    if self.cfg.capacity_factor is not None:
      if positions_BS is None:
        positions_BS = jnp.broadcast_to(jnp.arange(s), (b, s))
      kept_BSK = capacity_keep(experts_BSK, positions_BS, num_experts, self.cfg.capacity_factor)
      routed_BSK = experts_BSK < num_experts
      dropped = jnp.sum((routed_BSK & ~kept_BSK).astype(jnp.float32))
      dropped_fraction = dropped / jnp.maximum(routing.tokens * self.cfg.top_k, 1.0)
      experts_BSK = jnp.where(kept_BSK, experts_BSK, num_experts)  # id E: never sent, never computed
    stats = MoEStats(routing.aux_loss, routing.z_loss, routing.load_E, dropped_fraction, routing.score_mean_E,
                     routing.tokens, routing.sequences)
    return (experts_BSK, routing.weights_TK), stats

  def routed_experts(self, x_BSD: jax.Array, assignment: ExpertAssignment,
                     replicas: ExpertWeights | None = None) -> tuple[jax.Array, jax.Array]:
    """The routed experts' outputs, combined per token (the parallel op of the active plan), and the fullest
    receive buffer's use (MoEStats.buffer_use). `replicas`: these weights as per-replica copies for a
    compressed gradient sum (expert_parallel.expert_replicas), or None."""
    experts_BSK, weights_BSK = assignment
    w = ExpertWeights(self.gate_EDF[...], self.up_EDF[...], self.down_EFD[...])
    y_BSD, buffer_use = expert_parallel.moe_ffn_and_buffer_use(x_BSD, experts_BSK, weights_BSK, w, swiglu_hidden,
                                                               replicas)
    return constrain(y_BSD, ("act_batch", "act_seq", "act_embed")), buffer_use
