"""Causal grouped-query self-attention with rotary embeddings (shape legend in layers.py).

With `ModelConfig.qk_norm` (Qwen3), each head's query and key are RMS-normalised over head_dim, with one
learned scale per head_dim entry shared by all heads, before the rotation.
"""

from __future__ import annotations

import jax
from flax import nnx

from meshmoe.config import ModelConfig
from meshmoe.models.layers import Documents, RMSNorm, Rope, param, rotate
from meshmoe.sharding import context_parallel, tensor_parallel


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, n, g, h, std = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.init_std
    self.query_DNH = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std)
    self.key_DGH = param(rngs, (d, g, h), ("embed", "kv_heads", "head_dim"), std)
    self.value_DGH = param(rngs, (d, g, h), ("embed", "kv_heads", "head_dim"), std)
    self.out_NHD = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), std)
    self.rope = Rope.of(cfg)
    self.query_norm = RMSNorm(h, cfg.norm_eps) if cfg.qk_norm else None
    self.key_norm = RMSNorm(h, cfg.norm_eps) if cfg.qk_norm else None

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, documents: Documents | None = None) -> jax.Array:
    """`positions_BS` are the tokens' places in their sequence (they need not be sorted: context-parallel
    attention permutes the sequence); causality follows them. `documents`: attention within each
    document of packed rows (None: the row is one sequence)."""
    # Column-parallel projections, sequence- (context-) parallel attention, row-parallel output: each a
    # parallel op of meshmoe.sharding, so the model never names a mesh axis.
    q_BSNH, k_BSGH, v_BSGH = tensor_parallel.project_in(
        x_BSD, [self.query_DNH[...], self.key_DGH[...], self.value_DGH[...]],
        [("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim"), ("embed", "kv_heads", "head_dim")])
    if self.query_norm is not None:
      q_BSNH, k_BSGH = self.query_norm(q_BSNH), self.key_norm(k_BSGH)
    rope_BS = positions_BS if documents is None else documents.rope_positions_BS
    starts_BS = None if documents is None else documents.starts_BS
    q_BSNH = rotate(q_BSNH, rope_BS, self.rope)
    k_BSGH = rotate(k_BSGH, rope_BS, self.rope)
    o_BSNH = context_parallel.attention(q_BSNH, k_BSGH, v_BSGH, positions_BS, starts_BS)
    return tensor_parallel.project_out(o_BSNH, self.out_NHD[...], ("heads", "head_dim", "embed"))
