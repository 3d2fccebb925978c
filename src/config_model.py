"""The model sections of meshmoe.config: `ModelConfig` and its `MoEConfig`, and their validation.

Plain data, like the rest of meshmoe.config: it imports nothing of meshmoe but the config's own modules.
Import these names from meshmoe.config.
"""

import dataclasses
import math

from meshmoe.config_checks import (ConfigError, check_bool, check_choice, check_int, check_non_negative,
                                   check_positive_float, check_positive_int, is_number)

DTYPES = ("float32", "bfloat16")
SCORE_FNS = ("softmax", "sigmoid")
BALANCE_LOSSES = ("batch", "sequence", "global_batch")  # model.moe.balance_loss (models/router.py)
ATTENTION_TYPES = ("gqa", "mla")
REMAT_POLICIES = ("none", "full", "dots")


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
  num_experts: int = 8
  top_k: int = 2
  expert_mlp_dim: int = 256
  num_shared_experts: int = 0  # each shared expert is a SwiGLU of width expert_mlp_dim
  score_fn: str = "softmax"  # softmax (Mixtral, Qwen3) or sigmoid (DeepSeek-V3)
  normalize_top_k: bool = True  # rescale the chosen k weights to sum to 1
  routed_scaling: float = 1.0  # multiplies the routed output (DeepSeek-V3: 2.5)
  # Group-limited routing (DeepSeek-V3's node-limited routing): the experts form `num_groups` equal groups
  # (in id order); each token ranks the groups by the sum of their two highest selection scores, keeps the
  # best `top_k_groups` and picks its top_k experts among theirs. 1 group: no limit.
  num_groups: int = 1
  top_k_groups: int = 1
  # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores only to choose experts.
  # It is a non-trainable variable, nudged by `update_rate * sign(mean load - load)` after each step.
  expert_bias: bool = False
  expert_bias_update_rate: float = 1e-3
  aux_loss_weight: float = 0.01  # Switch-style load-balancing loss
  # What the load-balancing loss balances: "batch", each micro-batch's tokens over all devices (the loads
  # summed over the data replicas before the loss); "sequence", each sequence's, averaged over the
  # sequences (DeepSeek-V3's complementary sequence-wise loss); "global_batch", the step's: each
  # micro-batch's scores weighed by the loads of the step's micro-batches up to and including it (the last
  # one's are the whole step's; Megatron-Core's global_aux_loss, Qwen3's global-batch balance;
  # models/decoder.combine_loss_terms). With one micro-batch it is "batch".
  balance_loss: str = "batch"
  z_loss_weight: float = 1e-3  # router z-loss (ST-MoE)
  # None: dropless (every token reaches its k experts). A number: each expert takes at most
  # ceil(capacity_factor * tokens * top_k / num_experts) tokens per sequence; the rest are dropped and counted.
  capacity_factor: float | None = None


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
  vocab_size: int = 256
  embed_dim: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 512  # width of the dense SwiGLU in dense layers
  num_dense_layers: int = 0  # the first k layers use a dense MLP instead of the MoE block
  max_seq_len: int = 256
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  qk_norm: bool = False  # RMSNorm over head_dim on every query and key head before the rotation (Qwen3)
  # "gqa": grouped-query attention (num_kv_heads key/value heads of head_dim). "mla": DeepSeek's multi-head
  # latent attention (models/mla.py): queries through a rank-q_lora_rank bottleneck (0: a full
  # projection), keys and values up-projected per head from one kv_lora_rank latent per token, heads of
  # qk_nope_head_dim + qk_rope_head_dim (the rotary part, one per token shared by every head) for scores
  # and v_head_dim for values; head_dim is unused and num_kv_heads must equal num_heads.
  attention: str = "gqa"
  q_lora_rank: int = 0
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  rope_interleave: bool = False  # rotate pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of the two halves
  # YaRN rope scaling (DeepSeek-V3's long context; transformers' "yarn" rope_type), on when yarn_factor > 1:
  # frequencies interpolated between beta_fast and beta_slow rotations over yarn_original_max_len
  # positions, cos/sin scaled by mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim) and the
  # scores by mscale(factor, yarn_mscale_all_dim)^2, mscale(f, m) = 0.1 m ln f + 1.
  yarn_factor: float = 1.0
  yarn_original_max_len: int = 4096
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_mscale: float = 1.0
  yarn_mscale_all_dim: float = 0.0
  tie_embeddings: bool = True
  init_std: float = 0.02
  dtype: str = "float32"  # compute dtype; parameters are always float32
  # Activation rematerialisation per decoder layer: "none" keeps everything, "full" recomputes the whole
  # layer in the backward pass, "dots" keeps matmul outputs and recomputes the elementwise work.
  remat: str = "none"
  # The training loss computes the output layer's float32 logits in chunks of each device's tokens, at
  # most this many bytes of them at a time (models/output.py); 0 forms them whole. 256 MiB: up to 441
  # tokens of Qwen3's 151,936-entry vocabulary, 2,048 of a 32K one (a divisor of the device's positions).
  logits_chunk_bytes: int = 256 * 2**20
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)


def validate_model(m: ModelConfig) -> None:
  for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
               "max_seq_len"):
    check_positive_int(f"model.{name}", getattr(m, name))
  check_positive_float("model.rope_theta", m.rope_theta)
  check_positive_float("model.norm_eps", m.norm_eps)
  check_positive_float("model.init_std", m.init_std)
  check_choice("model.dtype", m.dtype, DTYPES)
  check_choice("model.remat", m.remat, REMAT_POLICIES)
  check_bool("model.tie_embeddings", m.tie_embeddings)
  check_bool("model.qk_norm", m.qk_norm)
  check_choice("model.attention", m.attention, ATTENTION_TYPES)
  check_bool("model.rope_interleave", m.rope_interleave)
  check_int("model.q_lora_rank", m.q_lora_rank, 0, "an integer >= 0 (0: no query bottleneck)")
  for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim"):
    check_positive_int(f"model.{name}", getattr(m, name))
  if m.qk_rope_head_dim % 2:
    raise ConfigError("model.qk_rope_head_dim", m.qk_rope_head_dim, "an even number (rotary embeddings "
                      "rotate pairs)")
  if m.attention == "mla":
    if m.num_kv_heads != m.num_heads:
      raise ConfigError("model.num_kv_heads", m.num_kv_heads, f"model.num_heads={m.num_heads} with "
                        "model.attention='mla' (every head has its own keys and values)")
    if m.qk_norm:
      raise ConfigError("model.qk_norm", m.qk_norm, "False with model.attention='mla'")
  if not is_number(m.yarn_factor) or not 1 <= m.yarn_factor < math.inf:
    raise ConfigError("model.yarn_factor", m.yarn_factor, "a finite number >= 1 (1: no YaRN scaling)")
  check_positive_int("model.yarn_original_max_len", m.yarn_original_max_len)
  check_positive_float("model.yarn_beta_fast", m.yarn_beta_fast)
  check_positive_float("model.yarn_beta_slow", m.yarn_beta_slow)
  check_non_negative("model.yarn_mscale", m.yarn_mscale)
  check_non_negative("model.yarn_mscale_all_dim", m.yarn_mscale_all_dim)
  check_int("model.logits_chunk_bytes", m.logits_chunk_bytes, 0,
            "0 (the logits whole) or a positive number of bytes of logits per chunk")
  if m.head_dim % 2:
    raise ConfigError("model.head_dim", m.head_dim, "an even number (rotary embeddings rotate pairs)")
  if m.num_heads % m.num_kv_heads:
    raise ConfigError("model.num_kv_heads", m.num_kv_heads,
                      f"a divisor of model.num_heads={m.num_heads} (grouped-query attention)")
  if (not isinstance(m.num_dense_layers, int) or isinstance(m.num_dense_layers, bool)
      or not 0 <= m.num_dense_layers <= m.num_layers):
    raise ConfigError("model.num_dense_layers", m.num_dense_layers,
                      f"an integer from 0 to model.num_layers={m.num_layers}")
  validate_moe(m.moe)


def validate_moe(moe: MoEConfig) -> None:
  check_positive_int("model.moe.num_experts", moe.num_experts)
  check_positive_int("model.moe.top_k", moe.top_k)
  check_positive_int("model.moe.expert_mlp_dim", moe.expert_mlp_dim)
  if moe.top_k > moe.num_experts:
    raise ConfigError("model.moe.top_k", moe.top_k,
                      f"at most model.moe.num_experts={moe.num_experts} (each token picks distinct experts)")
  check_int("model.moe.num_shared_experts", moe.num_shared_experts, 0, "an integer >= 0")
  check_choice("model.moe.score_fn", moe.score_fn, SCORE_FNS)
  check_choice("model.moe.balance_loss", moe.balance_loss, BALANCE_LOSSES)
  check_bool("model.moe.normalize_top_k", moe.normalize_top_k)
  check_bool("model.moe.expert_bias", moe.expert_bias)
  check_positive_float("model.moe.routed_scaling", moe.routed_scaling)
  check_positive_int("model.moe.num_groups", moe.num_groups)
  if moe.num_experts % moe.num_groups or (moe.num_groups > 1 and moe.num_experts // moe.num_groups < 2):
    raise ConfigError("model.moe.num_groups", moe.num_groups,
                      f"a divisor of model.moe.num_experts={moe.num_experts} leaving at least 2 experts per group "
                      "(groups are ranked by their two best scores), or 1")
  group_size = moe.num_experts // moe.num_groups
  if (not isinstance(moe.top_k_groups, int) or isinstance(moe.top_k_groups, bool)
      or not 1 <= moe.top_k_groups <= moe.num_groups or moe.top_k_groups * group_size < moe.top_k):
    raise ConfigError("model.moe.top_k_groups", moe.top_k_groups,
                      f"an integer from 1 to model.moe.num_groups={moe.num_groups} whose groups hold at least "
                      f"model.moe.top_k={moe.top_k} experts ({group_size} per group)")
  for name in ("aux_loss_weight", "z_loss_weight", "expert_bias_update_rate"):
    check_non_negative(f"model.moe.{name}", getattr(moe, name))
  if moe.capacity_factor is not None:
    check_positive_float("model.moe.capacity_factor", moe.capacity_factor,
                         "None for dropless routing, or a finite number > 0")
