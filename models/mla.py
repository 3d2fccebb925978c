"""DeepSeek's multi-head latent attention (MLA; DeepSeek-V2/V3), as `transformers`' DeepseekV3Attention
computes it (shape legend in layers.py; R the query latent, C the key/value latent, P the rotary part).

Queries: x @ query_down [D, R], RMS-normed, @ query_up [R, N, Hn + P] (or x @ query [D, N, Hn + P] when
q_lora_rank is 0). Keys and values: x @ kv_down [D, C + P]; the first C entries are RMS-normed and
up-projected per head, [C, N, Hn + Hv], into keys' non-rotary part (Hn) and values (Hv); the last P
entries are the rotary part of the keys, one per token, shared by every head. The rotary parts of queries
and keys are rotated (ModelConfig.rope_interleave, YaRN); a head's query and key are [non-rotary,
rotary], so scores are over Hn + P dimensions, scaled by 1/sqrt(Hn + P) and by YaRN's score factor.

Every projection is a parallel op (sharding/tensor_parallel.py): the down-projections' outputs are not
split over heads (`q_lora`, `kv_lora` name dimensions no preset splits), the up-projections are
column-parallel like any query projection. Attention itself is the same context-parallel op as GQA's
(N key/value heads): values narrower than queries are padded with zeros to the query width, which
changes no output entry (the padding is sliced off), so every attention kind and kernel applies as it is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.config import ModelConfig
from meshmoe.models.layers import Documents, RMSNorm, Rope, param, rotate
from meshmoe.sharding import context_parallel, tensor_parallel


class LatentAttention(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    d, n, std = cfg.embed_dim, cfg.num_heads, cfg.init_std
    self.nope, self.rope_dim, self.value_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    self.latent, self.query_rank = cfg.kv_lora_rank, cfg.q_lora_rank
    qk = self.nope + self.rope_dim
    if cfg.q_lora_rank:
      self.query_down_DR = param(rngs, (d, cfg.q_lora_rank), ("embed", "q_lora"), std)
      self.query_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
      self.query_up_RNH = param(rngs, (cfg.q_lora_rank, n, qk), ("q_lora", "heads", "head_dim"), std)
    else:
      self.query_DNH = param(rngs, (d, n, qk), ("embed", "heads", "head_dim"), std)
    self.kv_down_DC = param(rngs, (d, self.latent + self.rope_dim), ("embed", "kv_lora"), std)
    self.kv_norm = RMSNorm(self.latent, cfg.norm_eps)
    self.kv_up_CNH = param(rngs, (self.latent, n, self.nope + self.value_dim), ("kv_lora", "heads", "head_dim"), std)
    self.out_NHD = param(rngs, (n, self.value_dim, d), ("heads", "head_dim", "embed"), std)
    self.rope = Rope.of(cfg)

  def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array, documents: Documents | None = None) -> jax.Array:
    """As Attention.__call__."""
    if not self.query_rank:
      [q_BSNH] = tensor_parallel.project_in(x_BSD, [self.query_DNH[...]], [("embed", "heads", "head_dim")])
    else:
      [latent_BSR] = tensor_parallel.project_in(x_BSD, [self.query_down_DR[...]], [("embed", "q_lora")])
      [q_BSNH] = tensor_parallel.project_in(self.query_norm(latent_BSR), [self.query_up_RNH[...]],
                                            [("q_lora", "heads", "head_dim")])
    [compressed_BSC] = tensor_parallel.project_in(x_BSD, [self.kv_down_DC[...]], [("embed", "kv_lora")])
    latent_BSC, k_rope_BSP = compressed_BSC[..., :self.latent], compressed_BSC[..., self.latent:]
    [kv_BSNH] = tensor_parallel.project_in(self.kv_norm(latent_BSC), [self.kv_up_CNH[...]],
                                           [("kv_lora", "heads", "head_dim")])
    k_nope_BSNH, v_BSNH = kv_BSNH[..., :self.nope], kv_BSNH[..., self.nope:]
    rope_BS = positions_BS if documents is None else documents.rope_positions_BS
    starts_BS = None if documents is None else documents.starts_BS
    q_rope_BSNP = rotate(q_BSNH[..., self.nope:], rope_BS, self.rope)
    k_rope_BS1P = rotate(k_rope_BSP[:, :, None, :], rope_BS, self.rope)
    heads = q_BSNH.shape[2]
    k_BSNH = jnp.concatenate([k_nope_BSNH, jnp.broadcast_to(k_rope_BS1P, (*k_rope_BS1P.shape[:2], heads,
                                                                          self.rope_dim))], axis=-1)
    q_BSNH = jnp.concatenate([q_BSNH[..., :self.nope], q_rope_BSNP], axis=-1)
    # Attention scales scores by 1/sqrt(its head width); pad the narrower of queries/keys and values to a
    # common width W with zeros and rescale the queries so the scores are those of width Hn + P.
    qk, width = self.nope + self.rope_dim, max(self.nope + self.rope_dim, self.value_dim)
    q_BSNH = q_BSNH * jnp.asarray(self.rope.score_scale() * math.sqrt(width / qk), q_BSNH.dtype)
    pad = lambda a: jnp.pad(a, ((0, 0),) * 3 + ((0, width - a.shape[-1]),))
    o_BSNH = context_parallel.attention(pad(q_BSNH), pad(k_BSNH), pad(v_BSNH), positions_BS, starts_BS)
    return tensor_parallel.project_out(o_BSNH[..., :self.value_dim], self.out_NHD[...], ("heads", "head_dim", "embed"))
