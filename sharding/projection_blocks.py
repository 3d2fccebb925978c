"""The model's tensor-parallel blocks and attention's shapes, as the plan and the cost model see them: which
projections each block gathers into and scatters out of, and how wide attention's heads and weights are.
Plain arithmetic on the model config (no mesh, no devices).
"""

from __future__ import annotations

from typing import NamedTuple

from meshmoe.config import Config


class Block(NamedTuple):
  """One tensor-parallel block of every layer it is in: `project_in` of a [tokens, `gathered`] input by the
  in-projections (logical names, global output width, input width), the per-device work, and `project_out`
  by the out-projection (logical names, global contraction width; None when the block has none)."""

  name: str
  weights_in: list[tuple[tuple[str | None, ...], int, int]]
  weight_out: tuple[tuple[str | None, ...], int] | None
  gathered: int  # the width of what project_in gathers (the model width, or MLA's latents)
  layers: int

  @property
  def flops_per_token(self) -> int:
    """Multiply-adds x 2 of the block's projections for one token in one layer."""
    out = self.weight_out[1] * self.weight_out_width if self.weight_out else 0
    return 2 * (sum(width * in_width for _, width, in_width in self.weights_in) + out)

  weight_out_width: int = 0  # the out-projection's output width (the model width)

  @property
  def ends_layer(self) -> bool:
    """Whether the block's out-projection is its layer's last op (the MLP's or the shared experts'): its result
    is the layer's output, which no gradient reads, so remat does not run it again (jax recomputes only what
    the backward uses)."""
    return self.name in ("dense_mlp", "shared_experts") and self.weight_out is not None


def attention_width(m) -> int:
  """The head width attention's ops see: head_dim, or MLA's query/key width and value width, the narrower
  padded to the wider (models/mla.py)."""
  if m.attention == "mla":
    return max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
  return m.head_dim


def attention_weights(m) -> list[tuple[tuple[str | None, ...], int]]:
  """(logical names, elements) of one layer's attention weights, by kind of split (q and o split alike)."""
  d, n = m.embed_dim, m.num_heads
  if m.attention != "mla":
    return [(("embed", "heads", "head_dim"), d * n * m.head_dim * 2),
            (("embed", "kv_heads", "head_dim"), d * m.num_kv_heads * m.head_dim * 2)]
  qk, rank, latent = m.qk_nope_head_dim + m.qk_rope_head_dim, m.q_lora_rank, m.kv_lora_rank
  weights = [(("embed", "kv_lora"), d * (latent + m.qk_rope_head_dim)),
             (("kv_lora", "heads", "head_dim"), latent * n * (m.qk_nope_head_dim + m.v_head_dim)),
             (("heads", "head_dim", "embed"), n * m.v_head_dim * d)]
  if rank:
    return [(("embed", "q_lora"), d * rank), (("q_lora", "heads", "head_dim"), rank * n * qk), *weights]
  return [(("embed", "heads", "head_dim"), d * n * qk), *weights]


def projection_blocks(config: Config) -> list[Block]:
  """The model's tensor-parallel blocks (Block)."""
  m, moe = config.model, config.model.moe
  d, n = m.embed_dim, m.num_heads
  num_moe = m.num_layers - m.num_dense_layers
  if m.attention == "mla":
    qk, latent, rank = m.qk_nope_head_dim + m.qk_rope_head_dim, m.kv_lora_rank, m.q_lora_rank
    down = [(("embed", "kv_lora"), latent + m.qk_rope_head_dim, d)]
    query = [(("q_lora", "heads", "head_dim"), n * qk, rank)] if rank else [(("embed", "heads", "head_dim"), n * qk, d)]
    if rank:
      down.insert(0, (("embed", "q_lora"), rank, d))
    blocks = [Block("attention_latent", down, None, d, m.num_layers),
              Block("attention", query + [(("kv_lora", "heads", "head_dim"), n * (m.qk_nope_head_dim + m.v_head_dim),
                                           latent)],
                    (("heads", "head_dim", "embed"), n * m.v_head_dim), (rank or d) + latent, m.num_layers, d)]
  else:
    heads, kv_heads = ("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")
    blocks = [Block("attention", [(heads, n * m.head_dim, d), (kv_heads, m.num_kv_heads * m.head_dim, d),
                                  (kv_heads, m.num_kv_heads * m.head_dim, d)],
                    (("heads", "head_dim", "embed"), n * m.head_dim), d, m.num_layers, d)]
  if m.num_dense_layers:
    blocks.append(Block("dense_mlp", [(("embed", "mlp"), m.mlp_dim, d)] * 2, (("mlp", "embed"), m.mlp_dim), d,
                        m.num_dense_layers, d))
  if moe.num_shared_experts and num_moe:
    width = moe.num_shared_experts * moe.expert_mlp_dim
    blocks.append(Block("shared_experts", [(("embed", "mlp"), width, d)] * 2, (("mlp", "embed"), width), d,
                        num_moe, d))
  return blocks
