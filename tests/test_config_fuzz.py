"""Property test: any single invalid field, in any section, on any shipped config, gives one ConfigError whose
`.field` names that field.

Each field has a strategy of values that are invalid for it on its own: wrong types, out-of-range numbers
(zero, negatives, NaN, infinities), unknown choices, and the cross-field cases where the field itself is the
one to blame (top_k above the expert count, an odd head_dim, a seq_len beyond max_seq_len, ...).
`test_every_field_has_a_strategy` keeps the table complete when fields are added.
"""

import copy
import dataclasses
import math

import pytest
from hypothesis import given, settings, strategies as st

from experiments.configs import deepseek_v3, mixtral_8x7b, qwen3_30b_a3b, tiny_moe
from meshmoe import config as config_lib
from meshmoe.config import Config, ConfigError

BASES = {"default": Config(), "tiny_moe": tiny_moe.get_config(), "mixtral_8x7b": mixtral_8x7b.get_config(),
         "qwen3_30b_a3b": qwen3_30b_a3b.get_config(), "deepseek_v3": deepseek_v3.get_config()}

_containers = st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=2), st.integers(), max_size=1)
not_an_int = st.floats(allow_nan=True) | st.text(max_size=5) | st.none() | st.booleans() | _containers
not_a_number = st.text(max_size=5) | st.none() | st.booleans() | _containers
not_a_string = st.integers() | st.floats() | st.none() | st.booleans() | _containers
non_finite = st.sampled_from([math.nan, math.inf, -math.inf])


def positive_int_bad():
  return st.integers(max_value=0) | not_an_int


def non_negative_int_bad():
  return st.integers(max_value=-1) | not_an_int


def positive_float_bad(none_allowed: bool = False):
  wrong = not_a_number.filter(lambda v: v is not None) if none_allowed else not_a_number
  return st.floats(max_value=0.0) | non_finite | wrong


# Bounds, not filters: hypothesis rewrites `floats(max_value=0).filter(lambda x: x < 0)` into a strategy that
# still draws 0.0 (seen with hypothesis 6.170).
def non_negative_float_bad():
  return st.floats(max_value=0.0, exclude_max=True) | non_finite | not_a_number


def between_bad(low: float, high: float, low_ok: bool, high_ok: bool):
  below = st.floats(max_value=low, exclude_max=low_ok)
  above = st.floats(min_value=high, exclude_min=high_ok)
  return below | above | st.just(math.nan) | not_a_number


def choice_bad(choices):
  return st.text(max_size=12).filter(lambda s: s not in choices) | st.integers() | st.none() | _containers


def bool_bad():
  return st.integers() | st.floats() | st.text(max_size=5) | st.none()


POSITIVE_INTS = ["model.kv_lora_rank", "model.qk_nope_head_dim", "model.v_head_dim", "model.yarn_original_max_len",
                 "model.vocab_size", "model.embed_dim", "model.num_layers", "model.num_heads", "model.num_kv_heads",
                 "model.mlp_dim", "model.max_seq_len", "model.moe.num_experts", "model.moe.expert_mlp_dim",
                 "train.steps", "train.global_batch_size", "train.log_every", "train.eval_batches",
                 "checkpoint.keep", "parallel.moe_chunks", "resilience.max_consecutive_skips"]
NON_NEGATIVE_INTS = ["data.loader_threads", "model.q_lora_rank", "model.logits_chunk_bytes", "model.moe.num_shared_experts", "parallel.gemm_block_rows",
                     "optimizer.warmup_steps",
                     "train.eval_every", "sample.max_new_tokens",
                     "resilience.straggler_every_steps", "resilience.timeline_every_steps"]
POSITIVE_FLOATS = ["model.yarn_beta_fast", "model.yarn_beta_slow", "model.rope_theta", "model.norm_eps", "model.init_std", "model.moe.routed_scaling",
                   "optimizer.learning_rate", "optimizer.eps", "optimizer.muon_update_rms",
                   "resilience.watchdog_timeout_s"]
NON_NEGATIVE_FLOATS = ["model.yarn_mscale", "model.yarn_mscale_all_dim", "model.moe.aux_loss_weight", "model.moe.z_loss_weight", "model.moe.expert_bias_update_rate",
                       "optimizer.weight_decay", "optimizer.grad_clip_norm", "train.peak_flops_per_device",
                       "sample.temperature", "resilience.debug_slow_device_s"]
CHOICES = {"model.attention": config_lib.ATTENTION_TYPES, "model.dtype": config_lib.DTYPES, "model.remat": config_lib.REMAT_POLICIES,
           "model.moe.score_fn": config_lib.SCORE_FNS, "parallel.grouped_gemm": config_lib.GROUPED_GEMMS,
           "mesh.preset": config_lib.PRESETS, "mesh.weight_storage": config_lib.WEIGHT_STORAGES,
           "mesh.optimizer_storage": config_lib.OPTIMIZER_STORAGES,
           "parallel.impl": config_lib.IMPLS,
           "parallel.kernel_backend": config_lib.KERNEL_BACKENDS,
           "parallel.kernel_tiles": config_lib.KERNEL_TILES,
           "parallel.attention": config_lib.ATTENTION_KINDS, "parallel.attention_kernel": config_lib.ATTENTION_KERNELS,
           "parallel.xla_flags": config_lib.XLA_FLAG_PRESETS, "parallel.layer_schedule": config_lib.LAYER_SCHEDULES,
           "parallel.moe_swiglu_gradient": config_lib.SWIGLU_GRADIENTS,
           "parallel.gradient_compression": config_lib.GRADIENT_COMPRESSIONS,
           **{f"parallel.{name}": config_lib.EXCHANGE_FORMATS for name in config_lib.EXCHANGE_FORMAT_FIELDS},
           "data.source": config_lib.DATA_SOURCES, "resilience.nan_policy": config_lib.NAN_POLICIES,
           "optimizer.schedule": config_lib.LR_SCHEDULES, "optimizer.decay_shape": config_lib.LR_DECAY_SHAPES,
           "optimizer.name": config_lib.OPTIMIZERS, "optimizer.moments_dtype": config_lib.MOMENTS_DTYPES,
           "model.moe.balance_loss": config_lib.BALANCE_LOSSES}
BOOLS = ["model.tie_embeddings", "model.qk_norm", "model.rope_interleave", "model.moe.normalize_top_k", "model.moe.expert_bias", "optimizer.decay_norms",
         "optimizer.decay_biases", "optimizer.decay_embeddings", "data.packing", "data.document_mask", "checkpoint.async_save",
         "parallel.gradient_error_feedback"]

BAD: dict[str, st.SearchStrategy] = {
    **{f: positive_int_bad() for f in POSITIVE_INTS},
    **{f: non_negative_int_bad() for f in NON_NEGATIVE_INTS},
    **{f: positive_float_bad() for f in POSITIVE_FLOATS},
    **{f: non_negative_float_bad() for f in NON_NEGATIVE_FLOATS},
    **{f: choice_bad(c) for f, c in CHOICES.items()},
    **{f: bool_bad() for f in BOOLS},
    **{f"mesh.{axis}": st.integers(max_value=-2) | st.just(0) | not_an_int for axis in config_lib.MESH_AXES},
    "checkpoint.every_steps": st.integers(max_value=-2) | not_an_int,  # -1: never save
    "parallel.gemm_kernels": not_a_string | st.sampled_from(
        ["backward=jax_mgpu", "forward=cublas", "forward", "forward=xla,forward=jax_mgpu", "=xla"]),
    "parallel.kernel_table": not_a_string,
    **{f"mesh.{field}": not_a_string | st.sampled_from(["", "pipeline", "expert,bogus", "tensor,tensor", "Expert",
                                                        "expert,,tensor", "all"])
       for field in ("expert_axes", "expert_width_axes")},
    "model.qk_rope_head_dim": positive_int_bad() | st.integers(min_value=0, max_value=10**6).map(lambda n: 2 * n + 1),
    "model.yarn_factor": between_bad(1, math.inf, low_ok=True, high_ok=False),
    "model.head_dim": positive_int_bad() | st.integers(min_value=0, max_value=10**6).map(lambda n: 2 * n + 1),
    "model.num_dense_layers": st.integers(max_value=-1) | st.integers(min_value=10**4) | not_an_int,
    "model.moe.top_k": positive_int_bad() | st.integers(min_value=10**4),  # more than the experts
    "model.moe.capacity_factor": positive_float_bad(none_allowed=True),
    "model.moe.num_groups": positive_int_bad() | st.integers(min_value=10**4),  # more groups than experts
    "model.moe.top_k_groups": positive_int_bad() | st.integers(min_value=10**4),  # more than the groups
    "optimizer.min_learning_rate_ratio": between_bad(0, 1, low_ok=True, high_ok=True),
    "optimizer.decay_fraction": between_bad(0, 1, low_ok=False, high_ok=True),
    "optimizer.b1": between_bad(0, 1, low_ok=True, high_ok=False),
    "optimizer.b2": between_bad(0, 1, low_ok=True, high_ok=False),
    "optimizer.muon_beta": between_bad(0, 1, low_ok=True, high_ok=False),
    "train.gpu_memory_fraction": between_bad(0, 1, low_ok=False, high_ok=True),
    "train.seed": not_an_int,
    "train.export_hf": not_a_string,
    "train.init_from": not_a_string | st.just("hf:") | st.text(min_size=1, max_size=8).filter(
        lambda s: not s.startswith("hf:")),
    "train.seq_len": positive_int_bad() | st.integers(min_value=10**6),  # beyond model.max_seq_len
    "train.grad_accum_steps": positive_int_bad() | st.sampled_from([10_007, 65_537]),  # divides no batch
    "parallel.moe_buffer_factor": (st.floats(min_value=0.0, max_value=1.0, exclude_min=True, exclude_max=True)
                                   | st.floats(max_value=0.0, exclude_max=True) | non_finite | not_a_number),
    "parallel.moe_fallback_grad_accum_steps": non_negative_int_bad() | st.sampled_from([10_007, 65_537]),
    "train.profile_steps": (st.sampled_from(["5", "5:", ":5", "a:b", "3:3", "8:2", "1:2:3", " 1:2"])
                            | not_a_string),
    "data.paths": not_a_string | st.text(min_size=1, max_size=8).filter(str.strip),  # stdlib takes no paths
    "data.eval_paths": not_a_string,
    "data.restart_positions": bool_bad() | st.just(True),  # True needs data.document_mask (default False)
    "data.eval_fraction": between_bad(0, 1, low_ok=False, high_ok=False),
    "data.tokenizer": not_a_string | st.text(max_size=8).filter(lambda s: s != "byte" and not s.endswith(".json")),
    "sample.prompt": not_a_string | st.just(""),
    "resilience.straggler_factor": between_bad(1, math.inf, low_ok=False, high_ok=False),
    "resilience.timeline_min_cost": between_bad(0, 1, low_ok=False, high_ok=False),
    "resilience.debug_slow_device": st.integers(max_value=-2) | not_an_int,
}


def _leaf_fields(obj, prefix="") -> list[str]:
  names = []
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    names += _leaf_fields(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
  return names


def test_every_field_has_a_strategy():
  assert sorted(_leaf_fields(Config())) == sorted(BAD)


def _set(config: Config, path: str, value) -> None:
  *parents, leaf = path.split(".")
  for part in parents:
    config = getattr(config, part)
  setattr(config, leaf, value)


@settings(max_examples=600, deadline=None)
@given(base=st.sampled_from(sorted(BASES)), case=st.sampled_from(sorted(BAD)).flatmap(
    lambda field: st.tuples(st.just(field), BAD[field])))
def test_any_invalid_field_raises_a_config_error_naming_it(base, case):
  field, value = case
  config = copy.deepcopy(BASES[base])
  _set(config, field, value)
  with pytest.raises(ConfigError) as info:
    config.validate()
  assert info.value.field == field, (base, field, value, str(info.value))
  assert str(info.value).startswith(f"config.{field}=")


def test_the_shipped_configs_are_valid():
  for config in BASES.values():
    config.validate()
