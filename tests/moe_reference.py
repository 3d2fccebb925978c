"""A naive per-token MoE reference, written independently of meshmoe.sharding.grouped_ffn.

Expert choice is made in NumPy (float64, argsort) from the concrete parameters, then the output is a
Python loop over tokens and their chosen experts, differentiable with respect to the parameters and input
(the choice itself has no gradient, as in any top-k router). Capacity drops follow the documented priority:
all first choices in token order, then all second choices, ...; each expert keeps its first C assignments.
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
  """One sequence [S, D] through the MoE block, token by token. `params` holds the block's arrays."""
  logits = x_SD @ params["router"]
  if cfg.score_fn == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
  else:
    scores = jax.nn.sigmoid(logits)
  rows = []
  for t in range(x_SD.shape[0]):
    chosen = [int(e) for e in choices_SK[t]]
    weights = [scores[t, e] for e in chosen]
    if cfg.normalize_top_k:
      total = sum(weights)
      weights = [w / (total + 1e-20) for w in weights]
    out = jnp.zeros_like(x_SD[t])
    for j, e in enumerate(chosen):
      if not kept_SK[t, j]:
        continue
      h = jax.nn.silu(x_SD[t] @ params["gate"][e]) * (x_SD[t] @ params["up"][e])
      out = out + cfg.routed_scaling * weights[j] * (h @ params["down"][e])
    if "shared_gate" in params:
      h = jax.nn.silu(x_SD[t] @ params["shared_gate"]) * (x_SD[t] @ params["shared_up"])
      out = out + h @ params["shared_down"]
    rows.append(out)
  return jnp.stack(rows)
