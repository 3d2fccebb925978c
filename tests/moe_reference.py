"""A naive per-token MoE reference, written independently of meshmoe.sharding.grouped_ffn.

Expert choice is made in NumPy (float64, argsort) from the concrete parameters, then each token is run
through the weights of its own chosen experts, gathered per token, differentiable with respect to the
parameters and input (the choice itself has no gradient, as in any top-k router). Capacity drops follow
the documented priority: all first choices in token order, then all second choices, ...; each expert keeps
its first C assignments.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from meshmoe.config import MoEConfig


def choose_experts(x_SD, kernel_DE, bias_E, cfg: MoEConfig) -> np.ndarray:
  """[S, K] expert ids per token, best first, from float64 NumPy scores (+ selection bias)."""
  logits = np.asarray(x_SD, np.float64) @ np.asarray(kernel_DE, np.float64)
  if cfg.score_fn == "softmax":
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
  else:
    scores = 1 / (1 + np.exp(-logits))
  if bias_E is not None:
    scores = scores + np.asarray(bias_E, np.float64)
  return np.argsort(-scores, axis=-1, kind="stable")[:, :cfg.top_k]


def kept_mask(choices_SK: np.ndarray, cfg: MoEConfig) -> np.ndarray:
  """[S, K] booleans: which assignments survive the capacity limit (all of them when dropless)."""
  s, k = choices_SK.shape
  if cfg.capacity_factor is None:
    return np.ones((s, k), bool)
  capacity = max(1, math.ceil(cfg.capacity_factor * s * k / cfg.num_experts))
  used = [0] * cfg.num_experts
  kept = np.zeros((s, k), bool)
  for choice in range(k):
    for token in range(s):
      e = int(choices_SK[token, choice])
      if used[e] < capacity:
        kept[token, choice] = True
        used[e] += 1
  return kept


def moe_forward(params: dict, x_SD, choices_SK: np.ndarray, kept_SK: np.ndarray, cfg: MoEConfig):
  """One sequence [S, D] through the MoE block, each token through its own chosen experts: every token's
  [K] experts' weights are gathered for it (by the concrete choices, no grouping or sorting of tokens) and
  applied to that token alone. `params` holds the block's arrays."""
  logits = x_SD @ params["router"]
  scores = jax.nn.softmax(logits, axis=-1) if cfg.score_fn == "softmax" else jax.nn.sigmoid(logits)
  weights_SK = jnp.take_along_axis(scores, jnp.asarray(choices_SK), axis=-1)
  if cfg.normalize_top_k:
    weights_SK = weights_SK / (jnp.sum(weights_SK, axis=-1, keepdims=True) + 1e-20)
  weights_SK = jnp.where(jnp.asarray(kept_SK), cfg.routed_scaling * weights_SK, 0.0)
  gate_SKDF, up_SKDF, down_SKFD = (params[name][choices_SK] for name in ("gate", "up", "down"))
  hidden_SKF = (jax.nn.silu(jnp.einsum("sd,skdf->skf", x_SD, gate_SKDF))
                * jnp.einsum("sd,skdf->skf", x_SD, up_SKDF))
  out_SD = jnp.einsum("sk,skf,skfd->sd", weights_SK, hidden_SKF, down_SKFD)
  if "shared_gate" in params:
    hidden_SF = jax.nn.silu(x_SD @ params["shared_gate"]) * (x_SD @ params["shared_up"])
    out_SD = out_SD + hidden_SF @ params["shared_down"]
  return out_SD
