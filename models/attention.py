"""Causal grouped-query self-attention with rotary embeddings (shape legend in layers.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.config import ModelConfig
from meshmoe.models.layers import param, rotate
from meshmoe.sharding.shardings import constrain


class Attention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, n, g, h, std = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.init_std
    self.query_DNH = param(rngs, (d, n, h), ("embed", "heads", "head_dim"), std)
    self.key_DGH = param(rngs, (d, g, h), ("embed", "kv_heads", "head_dim"), std)
    self.value_DGH = param(rngs, (d, g, h), ("embed", "kv_heads", "head_dim"), std)
    self.out_NHD = param(rngs, (n, h, d), ("heads", "head_dim", "embed"), std)
    self.rope_theta = cfg.rope_theta

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array) -> jax.Array:
    dtype = x_BSD.dtype
    q_BSNH = jnp.einsum("bsd,dnh->bsnh", x_BSD, self.query_DNH[...].astype(dtype))
    k_BSGH = jnp.einsum("bsd,dgh->bsgh", x_BSD, self.key_DGH[...].astype(dtype))
    v_BSGH = jnp.einsum("bsd,dgh->bsgh", x_BSD, self.value_DGH[...].astype(dtype))
    q_BSNH = constrain(rotate(q_BSNH, positions_BS, self.rope_theta),
                       ("act_batch", "act_attn_seq", "act_heads", "act_head_dim"))
    k_BSGH = constrain(rotate(k_BSGH, positions_BS, self.rope_theta),
                       ("act_batch", None, "act_kv_heads", "act_head_dim"))
    v_BSGH = constrain(v_BSGH, ("act_batch", None, "act_kv_heads", "act_head_dim"))
    # Softmax in float32 whatever the compute dtype; the library handles N = G * (queries per group).
    o_BSNH = jax.nn.dot_product_attention(q_BSNH, k_BSGH, v_BSGH, is_causal=True)
    o_BSNH = constrain(o_BSNH, ("act_batch", "act_attn_seq", "act_heads", "act_head_dim"))
    return jnp.einsum("bsnh,nhd->bsd", o_BSNH, self.out_NHD[...].astype(dtype))
