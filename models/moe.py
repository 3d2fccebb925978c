"""The MoE feed-forward block: router, routed SwiGLU experts, optional shared experts (legend in layers.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.config import ModelConfig
from meshmoe.models.capacity import capacity_keep
from meshmoe.models.layers import SwiGLU, param, swiglu_hidden
from meshmoe.models.router import Router
from meshmoe.sharding import expert_parallel
from meshmoe.sharding.grouped_ffn import ExpertWeights
from meshmoe.sharding.shardings import constrain


@dataclasses.dataclass
class MoEStats:
  aux_loss: jax.Array  # scalar load-balancing loss
  z_loss: jax.Array  # scalar router z-loss
  load_E: jax.Array  # assignments per expert in this batch
  dropped_fraction: jax.Array  # share of the B*S*K assignments dropped by capacity (0 when dropless)


jax.tree_util.register_dataclass(MoEStats)


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

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array | None = None) -> tuple[jax.Array, MoEStats]:
    """`positions_BS` (default 0..S-1) orders capacity priority when the sequence is permuted."""
    b, s, _ = x_BSD.shape
    num_experts = self.cfg.num_experts
    routing = self.router(x_BSD)
    experts_BSK, weights_BSK = routing.experts_TK, routing.weights_TK
    dropped_fraction = jnp.zeros((), jnp.float32)
    if self.cfg.capacity_factor is not None:
      if positions_BS is None:
        positions_BS = jnp.broadcast_to(jnp.arange(s), (b, s))
      kept_BSK = capacity_keep(experts_BSK, positions_BS, num_experts, self.cfg.capacity_factor)
      experts_BSK = jnp.where(kept_BSK, experts_BSK, num_experts)  # id E: never sent, never computed
      dropped_fraction = 1.0 - jnp.mean(kept_BSK.astype(jnp.float32))
    w = ExpertWeights(self.gate_EDF[...], self.up_EDF[...], self.down_EFD[...])
    y_BSD = expert_parallel.moe_ffn(x_BSD, experts_BSK, weights_BSK, w, swiglu_hidden)
    y_BSD = constrain(y_BSD, ("act_batch", "act_seq", "act_embed"))
    if self.shared is not None:
      y_BSD = y_BSD + self.shared(x_BSD)
    stats = MoEStats(routing.aux_loss, routing.z_loss, routing.load_E, dropped_fraction)
    return y_BSD, stats
