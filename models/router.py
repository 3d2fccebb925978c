"""Top-k router: scores, expert choice, combine weights and the router losses (shape legend in layers.py).

- Scores are softmax (Mixtral, Qwen3-MoE) or sigmoid (DeepSeek-V3) of float32 logits.
- With `num_groups` > 1 (DeepSeek-V3), a token picks its experts only among its `top_k_groups` best groups
  of experts, a group's rank being the sum of its two highest selection scores (biased, when there is a
  bias), as `transformers`' DeepseekV3TopkRouter computes it.
- With `expert_bias`, a per-expert bias is added to the scores only to choose experts; the combine weights
  use the unbiased scores (DeepSeek-V3's aux-loss-free balancing). The bias is an `ExpertBias` variable,
  not an nnx.Param: optimizers skip it and `update_expert_bias` moves it from the observed load.
- Load-balancing loss (Switch Transformer): E * sum_e f_e * p_e, with f_e the fraction of the T*K
  assignments that went to expert e and p_e the mean normalised score of expert e. It is 1 when balanced.
  `balance_loss="batch"`: over all the tokens routed together (a micro-batch, every device's); "sequence":
  over each sequence's tokens, then averaged over the sequences (DeepSeek-V3's sequence-wise loss).
- Router z-loss (ST-MoE): mean over tokens of logsumexp(logits)^2.
- A token mask (0 for padding and any token the loss ignores) keeps masked tokens out of every statistic:
  the load, the mean scores, both losses. (MoEBlock.route also keeps them from being dispatched.)
- The choice is k rounds of argmax (`top_k_experts`), not `lax.top_k`: XLA's GPU SPMD partitioner does not
  split a top-k over tokens; it all-gathers every token's scores to every device and sorts them all there.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.config import MoEConfig
from meshmoe.models.layers import param


class ExpertBias(nnx.Variable):
  """Selection-only expert bias; updated from expert load, never by the optimizer."""


@dataclasses.dataclass
class Routing:
  """T stands for the input's token dimensions, one ([T]) or more ([B, S])."""

  experts_TK: jax.Array  # int32 expert ids, distinct per token
  weights_TK: jax.Array  # float32 combine weights
  aux_loss: jax.Array  # scalar load-balancing loss
  z_loss: jax.Array  # scalar router z-loss
  load_E: jax.Array  # float32 number of assignments per expert (of the unmasked tokens)
  score_mean_E: jax.Array  # mean normalised score per expert (p_e of the load-balancing loss)
  tokens: jax.Array  # float32 number of unmasked tokens the statistics are over
  sequences: jax.Array  # float32 number of sequences with an unmasked token (the sequence-wise loss's)


jax.tree_util.register_dataclass(Routing)


class Router(nnx.Module):

  def __init__(self, dim: int, cfg: MoEConfig, *, std: float, rngs: nnx.Rngs):
    self.cfg = cfg
    self.kernel_DE = param(rngs, (dim, cfg.num_experts), ("embed", None), std)
    self.bias_E = ExpertBias(jnp.zeros((cfg.num_experts,), jnp.float32), logical_axes=(None,)) \
        if cfg.expert_bias else None

  def __call__(self, x_TD: jax.Array, mask_T: jax.Array | None = None) -> Routing:
    """Routes tokens x[..., D]. Keeping the batch and sequence dimensions apart (no reshape to [B*S, D])
    lets a sequence split over devices stay split: flattening it would force a gather. `mask_T` (x's token
    dimensions; nonzero = counted) leaves the masked tokens out of the statistics (module docstring)."""
    cfg = self.cfg
    token_dims = tuple(range(x_TD.ndim - 1))
    counted_T = (jnp.ones(x_TD.shape[:-1], jnp.float32) if mask_T is None
                 else (mask_T != 0).astype(jnp.float32))
    tokens = jnp.sum(counted_T)

    def mean_over_tokens(v_T):  # over the counted tokens; v_T has x's token dimensions, maybe one more
      weights = counted_T.reshape(counted_T.shape + (1,) * (v_T.ndim - counted_T.ndim))
      return jnp.sum(v_T * weights, axis=token_dims) / jnp.maximum(tokens, 1.0)
    logits_TE = jnp.einsum("...d,de->...e", x_TD.astype(jnp.float32), self.kernel_DE[...])
    if cfg.score_fn == "softmax":
      scores_TE = jax.nn.softmax(logits_TE, axis=-1)
    else:
      scores_TE = jax.nn.sigmoid(logits_TE)
    choice_TE = scores_TE if self.bias_E is None else scores_TE + self.bias_E[...]
    if cfg.num_groups > 1:
      choice_TE = limit_to_groups(choice_TE, cfg.num_groups, cfg.top_k_groups)
    experts_TK = top_k_experts(jax.lax.stop_gradient(choice_TE), cfg.top_k)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if cfg.normalize_top_k:
      weights_TK = weights_TK / (jnp.sum(weights_TK, axis=-1, keepdims=True) + 1e-20)
    weights_TK = weights_TK * cfg.routed_scaling

    assigned_TKE = jax.nn.one_hot(experts_TK, cfg.num_experts, dtype=jnp.float32) * counted_T[..., None, None]
    load_E = jnp.sum(assigned_TKE, axis=token_dims + (-2,))
    # Sigmoid scores do not sum to one; normalise per token so p_e is a distribution like softmax's.
    probs_TE = scores_TE / jnp.sum(scores_TE, axis=-1, keepdims=True)
    score_mean_E = mean_over_tokens(probs_TE)
    z_loss = mean_over_tokens(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))
    # Sequences: the leading dimension of [B, S] tokens (one sequence for [T]).
    per_sequence = lambda v: v.reshape((x_TD.shape[0] if x_TD.ndim > 2 else 1, -1) + v.shape[x_TD.ndim - 1:])
    sequence_loss, sequences = sequence_balance_loss(per_sequence(assigned_TKE), per_sequence(probs_TE),
                                                     per_sequence(counted_T))
    aux_loss = sequence_loss if cfg.balance_loss == "sequence" else load_balancing_loss(load_E, score_mean_E)
    return Routing(experts_TK.astype(jnp.int32), weights_TK, aux_loss, z_loss, load_E, score_mean_E, tokens,
                   sequences)


def load_balancing_loss(load_E: jax.Array, score_mean_E: jax.Array) -> jax.Array:
  """E * sum_e f_e * p_e (module docstring): f_e is expert e's share of the assignments (load_E counts
  every token's K choices, so it sums to T*K exactly), p_e its mean normalised score. Leading dimensions
  are independent losses."""
  fraction_E = load_E / jnp.maximum(jnp.sum(load_E, axis=-1, keepdims=True), 1.0)  # no assignments: 0
  return load_E.shape[-1] * jnp.sum(fraction_E * score_mean_E, axis=-1)


def sequence_balance_loss(assigned_BSKE: jax.Array, probs_BSE: jax.Array,
                          counted_BS: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(The load-balancing loss of each sequence's counted tokens averaged over the sequences that have any,
  their number): DeepSeek-V3's sequence-wise balance loss. `assigned_BSKE`: the one-hot choices of the
  counted tokens; `probs_BSE`: the normalised scores; `counted_BS`: 1 for a counted token."""
  load_BE = jnp.sum(assigned_BSKE, axis=(1, 2))
  tokens_B = jnp.sum(counted_BS, axis=1)
  score_mean_BE = jnp.sum(probs_BSE * counted_BS[..., None], axis=1) / jnp.maximum(tokens_B, 1.0)[:, None]
  has_tokens_B = (tokens_B > 0).astype(jnp.float32)
  sequences = jnp.sum(has_tokens_B)
  loss = jnp.sum(load_balancing_loss(load_BE, score_mean_BE) * has_tokens_B) / jnp.maximum(sequences, 1.0)
  return loss, sequences


def top_k_experts(scores_TE: jax.Array, k: int) -> jax.Array:
  """The k highest-scoring experts of each token, highest first, ties to the lower index: what
  `lax.top_k(scores_TE, k)[1]` returns. Compiled for GPUs, `lax.top_k` on tokens split over devices
  gathers every token's scores to every device and sorts all of them there (seen in the H100 AOT report of
  moe_1b: 467 MB of all-gathers per step, outside the cost model); argmax and select split over the token
  dimensions like any elementwise op, so routing stays local. k (the router's top_k) is small."""
  # A chosen expert is masked with -inf, so every score still in the running is raised to at least the
  # lowest finite value: the k experts stay distinct even if a token's scores are all -inf.
  lowest = jnp.finfo(scores_TE.dtype).min
  remaining_TE = jnp.maximum(scores_TE, lowest)
  expert_ids_E = jnp.arange(scores_TE.shape[-1])
  chosen = []
  for _ in range(k):
    best_T = jnp.argmax(remaining_TE, axis=-1)
    chosen.append(best_T)
    remaining_TE = jnp.where(expert_ids_E == best_T[..., None], -jnp.inf, remaining_TE)
  return jnp.stack(chosen, axis=-1)


def limit_to_groups(choice_TE: jax.Array, num_groups: int, top_k_groups: int) -> jax.Array:
  """The selection scores with every expert outside each token's `top_k_groups` best groups set to -inf
  (module docstring). The ranks come from top_k_experts, like the experts' (no lax.top_k over tokens)."""
  *token_dims, num_experts = choice_TE.shape
  grouped_TGX = choice_TE.reshape(*token_dims, num_groups, num_experts // num_groups)
  group_score_TG = jnp.sum(jnp.take_along_axis(grouped_TGX, top_k_experts(grouped_TGX, 2), axis=-1), axis=-1)
  kept_group_TG = jnp.any(jax.nn.one_hot(top_k_experts(group_score_TG, top_k_groups), num_groups, dtype=bool),
                          axis=-2)
  return jnp.where(kept_group_TG[..., None], grouped_TGX, -jnp.inf).reshape(choice_TE.shape)


def update_expert_bias(bias_E: jax.Array, load_E: jax.Array, rate: float) -> jax.Array:
  """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower over-loaded ones. Leading
  dimensions (layers) are independent."""
  return bias_E + rate * jnp.sign(jnp.mean(load_E, axis=-1, keepdims=True) - load_E)
