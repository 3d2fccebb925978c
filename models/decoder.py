"""Decoder-only MoE transformer and its language-modelling loss (shape legend in layers.py).

Layer i is dense (SwiGLU of width `mlp_dim`) when i < `num_dense_layers`, else an MoE block; with pre-norm
residual blocks: x += attn(norm(x)); x += ffn(norm(x)).

Layers of one kind are a `LayerStack`: their parameters stacked along a leading `layers` dimension and run
by a scan. The compiled program holds one layer whatever the depth (a 61-layer model compiles as fast as a
2-layer one), and the loop is what XLA pipelines: with the GPU flag presets (meshmoe.runtime.xla_flags) the FSDP
all-gather of layer i+1's weights runs during layer i.

Two-halves schedule (`parallel.layer_schedule="two_halves"`, the plan's `layer` entry): an MoE layer's rows
are cut into two halves (each device's even and odd rows, so neither half moves between devices), carried
through the layer loop apart and joined after it. Per layer: A's attention and routing, then B's attention
while A's tokens travel to their experts, A's experts while B's travel, B's experts while A's outputs
return: one half's exchanges have the other half's compute to hide behind (inter-operator overlap, as in
MegaScale-MoE), where one pass leaves the first dispatch and the last return exposed. XLA's latency-hiding
scheduler places the collectives; optimization barriers only keep XLA from merging the halves' GEMMs on
shared weights back into one. It is the same function: attention, routing and expert capacity are per
sequence, and the router statistics of the halves merge exactly (moe.merge_halves). It costs a second
gradient all-reduce of each in-op weight per MoE layer, since each op is called once per half.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.config import ModelConfig, MoEConfig
from meshmoe.models import output
from meshmoe.models.attention import Attention
from meshmoe.models.layers import Documents, Embed, RMSNorm, SwiGLU, param
from meshmoe.models.mla import LatentAttention
from meshmoe.models.moe import MoEBlock, MoEStats, merge_halves
from meshmoe.models.router import load_balancing_loss, update_expert_bias
from meshmoe.sharding import expert_parallel, shardings
from meshmoe.sharding.grouped_ffn import ExpertWeights
from meshmoe.sharding.shardings import constrain

_RESIDUAL_STREAM = ("act_batch", "act_seq", "act_embed")  # the logical axes of x_BSD between the layers


class DecoderLayer(nnx.Module):

  def __init__(self, cfg: ModelConfig, dense: bool, *, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
    self.attn = LatentAttention(cfg, rngs=rngs) if cfg.attention == "mla" else Attention(cfg, rngs=rngs)
    self.ffn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
    self.ffn = (SwiGLU(cfg.embed_dim, cfg.mlp_dim, std=cfg.init_std, rngs=rngs) if dense
                else MoEBlock(cfg, rngs=rngs))

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, replicas: ExpertWeights | None = None,
               mask_BS: jax.Array | None = None, documents: Documents | None = None
               ) -> tuple[jax.Array, MoEStats | None]:
    """`replicas`: the MoE's expert weights as per-replica copies (LayerStack), or None. `mask_BS`: the tokens
    the MoE routes (MoEBlock.route; None: all). `documents`: attention within packed rows' documents."""
    x_BSD = self._attention_block(x_BSD, positions_BS, documents)
    if isinstance(self.ffn, MoEBlock):
      y_BSD, stats = self.ffn(self.ffn_norm(x_BSD), positions_BS, replicas, mask_BS)
    else:
      y_BSD, stats = self.ffn(self.ffn_norm(x_BSD)), None
    return constrain(x_BSD + y_BSD, _RESIDUAL_STREAM), stats

  def two_halves(self, halves: Halves, replicas: ExpertWeights | None = None,
                 masks: tuple[jax.Array, jax.Array] | None = None,
                 documents: tuple[Documents, Documents] | None = None) -> tuple[Halves, MoEStats]:
    """The MoE layer on two halves of the rows (module docstring), the same function as `__call__` on the
    whole. Order: A's attention and routing; B's attention while A's tokens travel to their experts; A's
    experts while B's tokens travel; B's experts while A's outputs return. XLA's scheduler places each
    exchange beside the other half's compute; the barriers below keep the halves from being merged.
    `replicas`: as in `__call__` (both halves' gradients add up before the one compressed sum); `masks`,
    `documents`: the halves' `mask_BS` and `documents` (as in `__call__`), or None."""
    (xa_BSD, xb_BSD), (positions_a_BS, positions_b_BS) = halves
    mask_a_BS, mask_b_BS = masks if masks is not None else (None, None)
    documents_a, documents_b = documents if documents is not None else (None, None)
    xa_BSD = self._attention_block(xa_BSD, positions_a_BS, documents_a)
    na_BSD = self.ffn_norm(xa_BSD)
    assignment_a, stats_a = self.ffn.route(na_BSD, positions_a_BS, mask_a_BS)
    # B's attention after A's routing: otherwise XLA merges GEMMs of the two halves that share weights (the
    # router's, the projections') into one, which waits for both halves: A's dispatch would then wait for
    # B's attention instead of running beside it.
    xb_BSD, na_BSD, assignment_a = jax.lax.optimization_barrier((xb_BSD, na_BSD, assignment_a))
    ya_BSD, use_a = self.ffn.routed_experts(na_BSD, assignment_a, replicas)
    xb_BSD = self._attention_block(xb_BSD, positions_b_BS, documents_b)
    nb_BSD = self.ffn_norm(xb_BSD)
    assignment_b, stats_b = self.ffn.route(nb_BSD, positions_b_BS, mask_b_BS)
    yb_BSD, use_b = self.ffn.routed_experts(nb_BSD, assignment_b, replicas)
    if self.ffn.shared is not None:
      ya_BSD = ya_BSD + self.ffn.shared(na_BSD)
      nb_BSD, ya_BSD = jax.lax.optimization_barrier((nb_BSD, ya_BSD))  # the same for the shared experts
      yb_BSD = yb_BSD + self.ffn.shared(nb_BSD)
    stats = merge_halves(dataclasses.replace(stats_a, buffer_use=use_a), dataclasses.replace(stats_b, buffer_use=use_b),
                         per_sequence=self.ffn.cfg.balance_loss == "sequence")
    return ((constrain(xa_BSD + ya_BSD, _RESIDUAL_STREAM), constrain(xb_BSD + yb_BSD, _RESIDUAL_STREAM)),
            (positions_a_BS, positions_b_BS)), stats

  def _attention_block(self, x_BSD: jax.Array, positions_BS: jax.Array,
                       documents: Documents | None = None) -> jax.Array:
    return constrain(x_BSD + self.attn(self.attn_norm(x_BSD), positions_BS, documents), _RESIDUAL_STREAM)


# Two halves of a batch's rows, and their positions: ((a_BSD, b_BSD), (positions_a_BS, positions_b_BS)).
Halves = tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def split_halves(x: jax.Array, logical_axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
  """Rows 0, 2, 4, ... and rows 1, 3, 5, ...: with the rows split over devices into blocks of an even size,
  each device's halves are its own rows, so neither half moves between devices."""
  if x.shape[0] % 2:  # runs check this in the plan (ParallelPlan.build); direct calls meet it here
    raise ValueError(f"parallel.layer_schedule='two_halves' needs an even number of rows, got {x.shape[0]}")
  pairs = x.reshape(x.shape[0] // 2, 2, *x.shape[1:])
  return constrain(pairs[:, 0], logical_axes), constrain(pairs[:, 1], logical_axes)


def join_halves(a: jax.Array, b: jax.Array, logical_axes: tuple[str, ...]) -> jax.Array:
  """split_halves' inverse."""
  return constrain(jnp.stack([a, b], axis=1).reshape(2 * a.shape[0], *a.shape[1:]), logical_axes)


class LayerStack(nnx.Module):
  """`count` decoder layers of one kind with parameters stacked on a leading `layers` dimension."""

  def __init__(self, cfg: ModelConfig, dense: bool, count: int, *, rngs: nnx.Rngs):

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, axis_size=count)
    def create(rngs: nnx.Rngs) -> DecoderLayer:
      return DecoderLayer(cfg, dense, rngs=rngs)

    self.layer = create(rngs)
    for _, variable in nnx.iter_graph(self.layer):
      if isinstance(variable, nnx.Variable):
        variable.set_metadata(logical_axes=("layers", *variable.get_metadata()["logical_axes"]))
    self.remat = cfg.remat
    self.moe = not dense

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, grad_residual: ExpertWeights | None = None,
               mask_BS: jax.Array | None = None, documents: Documents | None = None
               ) -> tuple[jax.Array, MoEStats | None]:
    """Runs the layers in order; MoE statistics come back stacked, one row per layer. `grad_residual`: the error
    feedback of the experts' compressed gradient sum ([layers, replicas, ...] per expert weight), or None.
    `mask_BS`: the tokens the MoE layers route (MoEBlock.route; None: all). `documents`: attention within
    packed rows' documents (DecoderLayer), or None.

    Where the plan compresses that sum (sharding/gradient_sync.py), the experts' weights of every layer
    become per-replica copies here, before the layer loop, so that the backward pass sums all layers'
    expert gradients in one compressed sum after the loop: inside it, those collectives would take XLA's
    overlap from the layers' token exchanges."""

    # A plain lax.scan over the split state: the forward pass reads the variables and mutates none, and
    # nnx.scan would refuse variables that come from an outer trace (the selection bias in a train step).
    graphdef, stacked = nnx.split(self.layer)
    replicas = None
    if self.moe:
      ffn = self.layer.ffn
      replicas = expert_parallel.expert_replicas(ExpertWeights(ffn.gate_EDF[...], ffn.up_EDF[...],
                                                               ffn.down_EFD[...]), grad_residual)
    if not (self.moe and _two_halves()):

      def one_layer(x_BSD, layer):
        state, replicas = layer
        state = shardings.with_optimizer_placed_gradients(state, stacked=True)
        return _remat(self.remat, DecoderLayer.__call__, nnx.merge(graphdef, state), x_BSD, positions_BS,
                      replicas, mask_BS, documents)

      return jax.lax.scan(one_layer, x_BSD, (stacked, replicas))

    def one_layer_in_halves(halves, layer):
      state, replicas = layer
      state = shardings.with_optimizer_placed_gradients(state, stacked=True)
      return _remat(self.remat, DecoderLayer.two_halves, nnx.merge(graphdef, state), halves, replicas, masks,
                    documents_halves)

    halves = (split_halves(x_BSD, _RESIDUAL_STREAM), split_halves(positions_BS, _RESIDUAL_STREAM[:2]))
    masks = None if mask_BS is None else split_halves(mask_BS, _RESIDUAL_STREAM[:2])
    documents_halves = None if documents is None else tuple(
        Documents(*parts) for parts in zip(*(split_halves(a, _RESIDUAL_STREAM[:2]) for a in documents)))
    ((xa_BSD, xb_BSD), _), stats = jax.lax.scan(one_layer_in_halves, halves, (stacked, replicas))
    return join_halves(xa_BSD, xb_BSD, _RESIDUAL_STREAM), stats


@dataclasses.dataclass
class ModelAux:
  aux_loss: jax.Array  # load-balancing loss, mean over MoE layers
  z_loss: jax.Array  # router z-loss, mean over MoE layers
  expert_load_LE: jax.Array  # assignments per expert, per MoE layer
  dropped_fraction_L: jax.Array  # dropped assignments per MoE layer
  score_mean_LE: jax.Array  # mean normalised router score per expert, per MoE layer (the aux loss's p_e)
  buffer_use_L: jax.Array  # the fullest capped receive buffer per MoE layer (MoEStats.buffer_use; 0: worst case)


jax.tree_util.register_dataclass(ModelAux)


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed = Embed(cfg.vocab_size, cfg.embed_dim, std=cfg.init_std, rngs=rngs, tied=cfg.tie_embeddings)
    num_moe = cfg.num_layers - cfg.num_dense_layers
    self.dense_layers = (LayerStack(cfg, True, cfg.num_dense_layers, rngs=rngs)
                         if cfg.num_dense_layers else None)
    self.moe_layers = LayerStack(cfg, False, num_moe, rngs=rngs) if num_moe else None
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps)
    self.unembed_DV = (None if cfg.tie_embeddings
                       else param(rngs, (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), cfg.init_std))

  def __call__(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
               documents: Documents | None = None) -> tuple[jax.Array, ModelAux]:
    """Float32 logits [B, S, V] and the MoE statistics, for generation and inspection (the training loss,
    `lm_loss_terms`, never forms the logits whole). `positions_BS` (default 0..S-1 in order) give each
    token's place in its sequence when the sequence is permuted (see `lm_loss_terms`); `documents`: attention
    within packed rows' documents (layers.Documents), or None."""
    x_BSD, aux = self.hidden_states(tokens_BS, positions_BS, documents=documents)
    if self.unembed_DV is None:
      logits_BSV = self.embed.attend(x_BSD)
    else:
      logits_BSV = jnp.einsum("bsd,dv->bsv", x_BSD, self.unembed_DV[...])
    return constrain(logits_BSV, output.LOGITS), aux

  def hidden_states(self, tokens_BS: jax.Array, positions_BS: jax.Array | None = None,
                    grad_residual: ExpertWeights | None = None, mask_BS: jax.Array | None = None,
                    documents: Documents | None = None) -> tuple[jax.Array, ModelAux]:
    """The final-normed float32 hidden states [B, S, D], which the output layer turns into logits, and the
    MoE statistics. `grad_residual`: the MoE layers' error-feedback inputs (LayerStack), given by train steps.
    `mask_BS`: the tokens the MoE layers route and count (MoEBlock.route; None: all). `documents`: as in
    `__call__`."""
    dtype = jnp.dtype(self.cfg.dtype)
    if positions_BS is None:
      positions_BS = jnp.broadcast_to(jnp.arange(tokens_BS.shape[1]), tokens_BS.shape)
    x_BSD = constrain(self.embed(tokens_BS, dtype), _RESIDUAL_STREAM)
    if self.dense_layers is not None:
      x_BSD, _ = self.dense_layers(x_BSD, positions_BS, documents=documents)
    stats = None
    if self.moe_layers is not None:
      x_BSD, stats = self.moe_layers(x_BSD, positions_BS, grad_residual, mask_BS, documents)
    return self.final_norm(x_BSD).astype(jnp.float32), _collect(stats, self.cfg.moe.num_experts)

  def output_weight(self) -> tuple[jax.Array, bool]:
    """The output layer's weight and whether it is the tied embedding table ([V, D]; else [D, V])."""
    if self.unembed_DV is None:
      return self.embed.table_VD[...], True
    return self.unembed_DV[...], False

  def update_expert_bias(self, expert_load_LE: jax.Array) -> None:
    """Aux-loss-free balancing: moves each MoE layer's selection bias from that layer's expert load."""
    bias_LE = None if self.moe_layers is None else self.moe_layers.layer.ffn.router.bias_E
    if bias_LE is not None:
      bias_LE[...] = update_expert_bias(bias_LE[...], expert_load_LE, self.cfg.moe.expert_bias_update_rate)


def _two_halves() -> bool:
  """Whether the active plan runs MoE layers in two halves (ParallelPlan.two_halves)."""
  plan = shardings.current()
  return plan is not None and plan.two_halves


def _remat(policy: str, method, layer: DecoderLayer, *args):
  """Runs `method(layer, *args)`, storing for the backward pass what `policy` (ModelConfig.remat) allows."""
  if policy == "none":
    return method(layer, *args)
  saveable = None if policy == "full" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  return nnx.remat(method, policy=saveable)(layer, *args)


def _collect(stats: MoEStats | None, num_experts: int) -> ModelAux:
  """Means of the per-layer router losses; loads and drops stay per layer ([L, E], [L])."""
  if stats is None:
    zero = jnp.zeros((), jnp.float32)
    return ModelAux(zero, zero, jnp.zeros((0, num_experts)), jnp.zeros((0,)), jnp.zeros((0, num_experts)),
                    jnp.zeros((0,)))
  return ModelAux(aux_loss=jnp.mean(stats.aux_loss), z_loss=jnp.mean(stats.z_loss),
                  expert_load_LE=stats.load_E, dropped_fraction_L=stats.dropped_fraction,
                  score_mean_LE=stats.score_mean_E, buffer_use_L=stats.buffer_use)


def lm_loss_terms(model: Transformer, tokens_BS: jax.Array, targets_BS: jax.Array,
                  mask_BS: jax.Array | None = None, positions_BS: jax.Array | None = None,
                  grad_residual: ExpertWeights | None = None,
                  documents: Documents | None = None) -> dict[str, jax.Array]:
  """The parts of the loss of one (micro-)batch, kept apart so micro-batches can be summed exactly.

  The loss is a sum over tokens, so their order does not matter: a caller may permute tokens, targets and
  mask alike (context-parallel attention wants its own order) and pass each token's place in its sequence
  as `positions_BS` (default 0..S-1), and with packed documents masked apart, their `documents` in the same
  order (layers.Documents).

  The cross-entropy is computed from the final hidden states in chunks of tokens (models/output.py), so
  the float32 logits [B, S, V] never exist whole at a large vocabulary (`ModelConfig.logits_chunk_bytes`).
  A token the mask leaves out (padding) counts in no loss or statistic: the MoE layers do not route it."""
  mask_BS = jnp.ones(tokens_BS.shape, jnp.float32) if mask_BS is None else mask_BS.astype(jnp.float32)
  x_BSD, aux = model.hidden_states(tokens_BS, positions_BS, grad_residual, mask_BS, documents)
  weight, tied = model.output_weight()
  ce_sum = output.cross_entropy_sum(x_BSD, weight, targets_BS, mask_BS, tied=tied,
                                    chunk_bytes=model.cfg.logits_chunk_bytes)
  return {"ce_sum": ce_sum, "tokens": jnp.sum(mask_BS), "aux_loss": aux.aux_loss,
          "z_loss": aux.z_loss, "expert_load": aux.expert_load_LE, "dropped_fraction": aux.dropped_fraction_L,
          "score_mean": aux.score_mean_LE, "buffer_use": aux.buffer_use_L}


def combine_loss_terms(terms: dict[str, jax.Array], moe: MoEConfig, total_tokens: jax.Array,
                       num_microbatches: int) -> jax.Array:
  """This micro-batch's share of the step loss: summed over micro-batches it is the mean cross-entropy
  over all the step's tokens plus the router losses averaged over micro-batches."""
  router = moe.aux_loss_weight * terms["aux_loss"] + moe.z_loss_weight * terms["z_loss"]
  return terms["ce_sum"] / jnp.maximum(total_tokens, 1.0) + router / num_microbatches


def global_batch_balance_loss(terms: dict[str, jax.Array], earlier_load_LE: jax.Array) -> jax.Array:
  """balance_loss="global_batch"'s loss of a micro-batch (MoEConfig): the load-balancing loss of its
  scores (p_e) against the loads of the step's micro-batches up to and including it (`earlier_load_LE`:
  the micro-batches before it, every data replica's), a mean over the MoE layers. The loads are counts,
  not differentiable, as in the other losses."""
  load_LE = jax.lax.stop_gradient(earlier_load_LE + terms["expert_load"])
  if load_LE.shape[0] == 0:
    return jnp.zeros((), jnp.float32)
  return jnp.mean(load_balancing_loss(load_LE, terms["score_mean"]))
