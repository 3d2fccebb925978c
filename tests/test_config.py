"""Config validation: every bad value raises one ConfigError naming the field, the value and what is allowed.

Each error case checks `err.field`, `err.value` (same type too, so True is not mistaken for 1) and the full
message text. Sharding-divisibility cases run what a run checks before it builds anything: `Config.validate`
with the device count, then `meshmoe.sharding.rules.check_divisibility` (ParallelPlan.build runs it).
"""

import dataclasses
import math

import pytest

import jax
from flax import nnx

from meshmoe import config as config_lib
from meshmoe.config import Config, ConfigError, MeshConfig, resolve_mesh_sizes
from meshmoe.models.decoder import Transformer
from meshmoe.sharding import rules
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.shardings import logical_axes_of

INF, NAN = float("inf"), float("nan")
ALL_PRESETS = "one of 'dp', 'fsdp', 'zero1', 'ep', 'tp_sp', 'megascale'"


def make(**fields) -> Config:
  """A fresh default Config with dotted fields set, e.g. make(**{"model.moe.top_k": 3})."""
  cfg = Config()
  for path, value in fields.items():
    *parents, leaf = path.split(".")
    obj = cfg
    for part in parents:
      obj = getattr(obj, part)
    setattr(obj, leaf, value)
  return cfg


def validate(cfg: Config, num_devices: int | None = None) -> Config:
  """What a run checks before it builds anything: every field; with a device count, the mesh and that the
  preset divides every dimension it splits (what ParallelPlan.build checks)."""
  cfg.validate(num_devices)
  if num_devices is not None:
    rules.check_divisibility(cfg, resolve_mesh_sizes(cfg.mesh, num_devices))
  return cfg


def expect_error(cfg: Config, field: str, value, message: str, num_devices: int | None = None) -> ConfigError:
  """Validates `cfg`; asserts one ConfigError with exactly this field, value and full message."""
  with pytest.raises(ConfigError) as info:
    validate(cfg, num_devices)
  err = info.value
  assert err.field == field
  assert type(err.value) is type(value)
  assert err.value is value or err.value == value or (
      isinstance(value, float) and math.isnan(value) and math.isnan(err.value))
  assert str(err) == f"config.{field}={value!r} is invalid: {message}"
  assert err.allowed == message
  return err


# --- ConfigError itself ----------------------------------------------------------------------------------------


def test_config_error_is_a_value_error_with_field_value_allowed():
  err = ConfigError("model.head_dim", 33, "an even number")
  assert isinstance(err, ValueError)
  assert (err.field, err.value, err.allowed) == ("model.head_dim", 33, "an even number")
  assert str(err) == "config.model.head_dim=33 is invalid: an even number"
  with pytest.raises(ValueError):  # callers that only know ValueError still catch it
    make(**{"model.head_dim": 33}).validate()


# --- defaults and valid boundary values ------------------------------------------------------------------------


@pytest.mark.parametrize("num_devices", [None, 1, 8])
def test_default_config_validates(num_devices):
  cfg = Config()
  assert validate(cfg, num_devices) is cfg


@pytest.mark.parametrize("fields", [
    {"model.num_kv_heads": 4},  # plain multi-head attention
    {"model.num_kv_heads": 1},  # multi-query attention
    {"model.num_dense_layers": 2},  # every layer dense: equal to num_layers is allowed
    {"model.moe.top_k": 8},  # top_k == num_experts
    {"model.moe.num_shared_experts": 2},
    {"model.moe.capacity_factor": 1.25},
    {"model.moe.capacity_factor": 1},  # an int is a number
    {"parallel.gemm_block_rows": 64},
    {"model.moe.aux_loss_weight": 0.0, "model.moe.z_loss_weight": 0, "model.moe.expert_bias_update_rate": 0.0},
    {"model.moe.score_fn": "sigmoid", "parallel.grouped_gemm": "blocked", "model.dtype": "bfloat16"},
    {"train.seq_len": 256},  # == model.max_seq_len
    {"train.seed": 12345},
], ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_valid_boundary_values(fields):
  validate(make(**fields), 8)


# --- per-field type and range checks ---------------------------------------------------------------------------

POSITIVE_INT_FIELDS = [
    "model.vocab_size", "model.embed_dim", "model.num_layers", "model.num_heads", "model.num_kv_heads",
    "model.head_dim", "model.mlp_dim", "model.max_seq_len",
    "model.moe.num_experts", "model.moe.top_k", "model.moe.expert_mlp_dim",
    "train.steps", "train.global_batch_size", "train.seq_len",
]


@pytest.mark.parametrize("value", [0, -3, True, 2.5, "4"], ids=repr)
@pytest.mark.parametrize("field", POSITIVE_INT_FIELDS)
def test_positive_int_fields(field, value):
  expect_error(make(**{field: value}), field, value, "a positive integer")


POSITIVE_FLOAT_FIELDS = [
    "model.rope_theta", "model.norm_eps", "model.init_std", "model.moe.routed_scaling",
    "optimizer.learning_rate", "optimizer.eps",
]


@pytest.mark.parametrize("value", [0, 0.0, -1, -1.0, INF, -INF, NAN, True, "1e-3"], ids=repr)
@pytest.mark.parametrize("field", POSITIVE_FLOAT_FIELDS)
def test_positive_float_fields(field, value):
  expect_error(make(**{field: value}), field, value, "a finite number > 0")


@pytest.mark.parametrize("value", [0, 0.0, -0.5, INF, NAN, True, "1.25"], ids=repr)
def test_capacity_factor(value):
  field = "model.moe.capacity_factor"
  expect_error(make(**{field: value}), field, value, "None for dropless routing, or a finite number > 0")


@pytest.mark.parametrize("value", [-1e-3, -1, NAN, INF, True, "0.01"], ids=repr)
@pytest.mark.parametrize("field", [
    "model.moe.aux_loss_weight", "model.moe.z_loss_weight", "model.moe.expert_bias_update_rate"])
def test_non_negative_loss_weights(field, value):
  expect_error(make(**{field: value}), field, value, "a finite number >= 0")


_BUFFER_FACTOR = ("0 (receive buffers for the dropless worst case) or a number >= 1 (that many times the rows of "
                  "balanced routing; an overflowing step runs again with worst-case buffers)")


@pytest.mark.parametrize("field, value, allowed", [pytest.param(*c, id=f"{c[0]}={c[1]!r}") for c in [
    ("model.dtype", "float16", "one of 'float32', 'bfloat16'"),
    ("model.dtype", "Float32", "one of 'float32', 'bfloat16'"),  # case-sensitive
    ("model.dtype", None, "one of 'float32', 'bfloat16'"),
    ("model.moe.score_fn", "tanh", "one of 'softmax', 'sigmoid'"),
    ("parallel.grouped_gemm", "dense", "one of 'auto', 'blocked', 'kernels', 'ragged_dot'"),
    ("mesh.preset", "pp", ALL_PRESETS),
    ("mesh.preset", "", ALL_PRESETS),
    ("mesh.weight_storage", "zero3", "one of 'preset', 'data', 'all'"),
    ("mesh.weight_storage", None, "one of 'preset', 'data', 'all'"),
    ("parallel.impl", "triton", "one of 'reference', 'xla', 'pallas'"),
    ("parallel.kernel_backend", "triton", "one of 'auto', 'mosaic_gpu', 'collectives'"),
    ("parallel.kernel_backend", "reference", "one of 'auto', 'mosaic_gpu', 'collectives'"),
    ("parallel.kernel_tiles", "128x256", "one of 'one_warpgroup', 'warp_specialized'"),
    ("parallel.moe_chunks", 0, "a positive integer"),
    ("parallel.moe_buffer_factor", 0.5, _BUFFER_FACTOR),
    ("parallel.moe_buffer_factor", -1, _BUFFER_FACTOR),
    ("parallel.moe_fallback_grad_accum_steps", -1, "0 (train.grad_accum_steps) or a positive number of micro-batches"),
    ("parallel.moe_fallback_grad_accum_steps", 7, "0 or a divisor of train.global_batch_size=16"),
    ("parallel.attention", "flash", "one of 'allgather', 'ring', 'ulysses'"),
    ("parallel.moe_dispatch_dtype", "fp8", "one of 'auto', 'bfloat16', 'float8_e4m3fn'"),
    ("parallel.layer_schedule", "halves", "one of 'sequential', 'two_halves'"),
    ("parallel.moe_swiglu_gradient", "save", "one of 'recompute', 'keep'"),
    ("parallel.gradient_compression", "fp8", "one of 'none', 'bfloat16', 'int8', 'sign'"),
]])
def test_choices_list_what_is_allowed(field, value, allowed):
  expect_error(make(**{field: value}), field, value, allowed)


# --- cross-field model / train checks --------------------------------------------------------------------------


def _case(fields, field, value, allowed):
  return pytest.param(fields, field, value, allowed, id=",".join(f"{k}={v!r}" for k, v in fields.items()))


@pytest.mark.parametrize("fields, field, value, allowed", [_case(*c) for c in [
    ({"model.head_dim": 33}, "model.head_dim", 33, "an even number (rotary embeddings rotate pairs)"),
    ({"model.head_dim": 1}, "model.head_dim", 1, "an even number (rotary embeddings rotate pairs)"),
    ({"model.num_heads": 4, "model.num_kv_heads": 3}, "model.num_kv_heads", 3,
     "a divisor of model.num_heads=4 (grouped-query attention)"),
    ({"model.num_heads": 4, "model.num_kv_heads": 8}, "model.num_kv_heads", 8,
     "a divisor of model.num_heads=4 (grouped-query attention)"),
    ({"model.num_dense_layers": 3}, "model.num_dense_layers", 3, "an integer from 0 to model.num_layers=2"),
    ({"model.num_dense_layers": -1}, "model.num_dense_layers", -1, "an integer from 0 to model.num_layers=2"),
    ({"model.num_dense_layers": 1.0}, "model.num_dense_layers", 1.0, "an integer from 0 to model.num_layers=2"),
    ({"model.num_dense_layers": True}, "model.num_dense_layers", True,
     "an integer from 0 to model.num_layers=2"),
    ({"model.moe.top_k": 9}, "model.moe.top_k", 9,
     "at most model.moe.num_experts=8 (each token picks distinct experts)"),
    ({"model.moe.num_experts": 1, "model.moe.top_k": 2}, "model.moe.top_k", 2,
     "at most model.moe.num_experts=1 (each token picks distinct experts)"),
    ({"model.moe.num_groups": 3}, "model.moe.num_groups", 3,
     "a divisor of model.moe.num_experts=8 leaving at least 2 experts per group (groups are ranked by their two "
     "best scores), or 1"),
    ({"model.moe.num_groups": 8}, "model.moe.num_groups", 8,
     "a divisor of model.moe.num_experts=8 leaving at least 2 experts per group (groups are ranked by their two "
     "best scores), or 1"),
    ({"model.moe.num_groups": 4, "model.moe.top_k": 4, "model.moe.top_k_groups": 1}, "model.moe.top_k_groups", 1,
     "an integer from 1 to model.moe.num_groups=4 whose groups hold at least model.moe.top_k=4 experts "
     "(2 per group)"),
    ({"train.init_from": "/models/x"}, "train.init_from", "/models/x",
     "empty (random initialisation) or 'hf:<folder>', a Hugging Face checkpoint folder"),
    ({"model.moe.num_shared_experts": -1}, "model.moe.num_shared_experts", -1, "an integer >= 0"),
    ({"model.moe.num_shared_experts": 1.5}, "model.moe.num_shared_experts", 1.5, "an integer >= 0"),
    ({"model.moe.num_shared_experts": True}, "model.moe.num_shared_experts", True, "an integer >= 0"),
    ({"parallel.gemm_block_rows": -1}, "parallel.gemm_block_rows", -1,
     "0 (chosen from the shapes) or a positive number of rows"),
    ({"parallel.gemm_block_rows": 8.0}, "parallel.gemm_block_rows", 8.0,
     "0 (chosen from the shapes) or a positive number of rows"),
    ({"parallel.gemm_block_rows": True}, "parallel.gemm_block_rows", True,
     "0 (chosen from the shapes) or a positive number of rows"),
    ({"train.seq_len": 257}, "train.seq_len", 257, "at most model.max_seq_len=256"),
    ({"model.max_seq_len": 64}, "train.seq_len", 128, "at most model.max_seq_len=64"),
    ({"train.seed": 1.0}, "train.seed", 1.0, "an integer"),
    ({"train.seed": "0"}, "train.seed", "0", "an integer"),
    ({"train.seed": True}, "train.seed", True, "an integer"),
    ({"train.seed": None}, "train.seed", None, "an integer"),
    ({"data.loader_threads": -1}, "data.loader_threads", -1, "an integer >= 0 (0: load in the train loop)"),
    *[({"data.source": "tokenized", "data.paths": paths}, "data.paths", paths, allowed) for paths, allowed in [
        ("a=/x:0.7,b=/y:0.2", "weights that sum to 1; these sum to 0.9"),
        ("a=/x:0.7,b=/y", "a weight for every dataset of a mixture (folder:weight)"),
        ("a=/x:1.5,b=/y:-0.5", "positive finite weights; 'b=/y:-0.5' has -0.5"),
        ("a=/x:half", "weights as numbers; 'half' in 'a=/x:half' is not"),
        ("a=/x:0.5,a=/y:0.5", "distinct dataset names (name=folder:weight); ['a', 'a'] repeat one"),
        ("/data/web/:0.5,/data2/web:0.5", "distinct dataset names (name=folder:weight); ['web', 'web'] repeat one"),
        ("a b=/x", "dataset names of letters, digits, '_', '.', '-'; 'a b=/x' gives 'a b'"),
    ]],
    ({"data.source": "tokenized", "data.paths": "/x", "data.eval_paths": "/e"}, "data.eval_paths", "/e",
     "empty for data.source='tokenized' (each dataset folder holds its own eval split)"),
    *[({"mesh.weight_storage": storage, "parallel.gradient_compression": "int8"}, "parallel.gradient_compression",
       "int8", f"'none' with mesh.weight_storage={storage!r}: the compressed sum runs over replicas that each hold "
       "whole expert weights, and split storage reduce-scatters their gradient instead (or "
       "mesh.weight_storage='preset')") for storage in ("data", "all")],
]])
def test_cross_field_checks(fields, field, value, allowed):
  expect_error(make(**fields), field, value, allowed)


# --- mesh ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -2, True, 2.0, "2"], ids=repr)
@pytest.mark.parametrize("axis", ["data", "expert", "tensor", "sequence"])
def test_mesh_axis_size(axis, value):
  # Checked with and without a device count: axis sizes are config values in their own right.
  for num_devices in (None, 8):
    expect_error(make(**{f"mesh.{axis}": value}), f"mesh.{axis}", value,
                 "a positive integer, or -1 to fill the remaining devices", num_devices)


def test_mesh_two_fill_axes():
  expect_error(make(**{"mesh.data": -1, "mesh.expert": -1}), "mesh",
               "data=-1, expert=-1, tensor=1, sequence=1", "at most one axis may be -1")


def test_mesh_product_must_equal_device_count():
  cfg = make(**{"mesh.data": 2, "mesh.expert": 2})
  cfg.validate()  # without a device count the product is not checked
  expect_error(cfg, "mesh", "data=2, expert=2, tensor=1, sequence=1",
               "the product of the mesh axis sizes (4) must equal the device count (8); "
               "set one axis to -1 to fill the rest", num_devices=8)


@pytest.mark.parametrize("mesh, field, product, described", [
    (MeshConfig(expert=3), "mesh.data", 3, "data=-1, expert=3, tensor=1, sequence=1"),
    (MeshConfig(data=3, expert=-1), "mesh.expert", 3, "data=3, expert=-1, tensor=1, sequence=1"),
    (MeshConfig(data=1, expert=3, tensor=-1), "mesh.tensor", 3, "data=1, expert=3, tensor=-1, sequence=1"),
    (MeshConfig(data=2, sequence=-1, tensor=3), "mesh.sequence", 6, "data=2, expert=1, tensor=3, sequence=-1"),
], ids=["expert=3", "data=3,expert=-1", "data=1,expert=3,tensor=-1", "data=2,tensor=3,sequence=-1"])
def test_mesh_fill_axis_must_divide_devices(mesh, field, product, described):
  cfg = make(mesh=mesh)
  cfg.validate()
  expect_error(cfg, field, -1,
               f"-1 fills the devices left by the other axes, but 8 devices are not divisible by their "
               f"product {product} ({described})", num_devices=8)


@pytest.mark.parametrize("mesh, num_devices, sizes", [
    (MeshConfig(), 1, (1, 1, 1, 1)),
    (MeshConfig(), 8, (8, 1, 1, 1)),
    (MeshConfig(data=-1, expert=2, tensor=2), 8, (2, 2, 2, 1)),
    (MeshConfig(data=2, expert=-1), 8, (2, 4, 1, 1)),
    (MeshConfig(data=1, expert=2, tensor=-1, sequence=2), 8, (1, 2, 2, 2)),
    (MeshConfig(data=2, expert=2, tensor=1, sequence=-1), 4, (2, 2, 1, 1)),  # -1 may resolve to 1
    (MeshConfig(data=2, expert=2, tensor=2, sequence=1), 8, (2, 2, 2, 1)),  # no -1: returned as given
])
def test_resolve_mesh_sizes(mesh, num_devices, sizes):
  expected = dict(zip(("data", "expert", "tensor", "sequence"), sizes, strict=True))
  assert resolve_mesh_sizes(mesh, num_devices) == expected


def test_resolve_mesh_sizes_does_not_modify_the_config():
  mesh = MeshConfig(data=-1, expert=2)
  resolve_mesh_sizes(mesh, 8)
  assert mesh.data == -1


def test_resolve_mesh_sizes_validates_the_axes():
  with pytest.raises(ConfigError) as info:
    resolve_mesh_sizes(MeshConfig(tensor=0), 8)
  assert (info.value.field, info.value.value) == ("mesh.tensor", 0)


# --- sharding divisibility (meshmoe.sharding.rules.check_divisibility) ------------------------------------------


def test_config_and_rules_agree_on_presets():
  assert config_lib.PRESETS == tuple(rules.PRESETS)
  assert config_lib.WEIGHT_STORAGES == tuple(rules.STORAGE_AXES)
  assert config_lib.OPTIMIZER_STORAGES == ("weights", *(s for s in rules.STORAGE_AXES if s != "preset"))
  assert config_lib.MESH_AXES == rules.ALL_AXES


@pytest.mark.parametrize("mesh", [
    MeshConfig(preset="dp"),
    MeshConfig(preset="fsdp"),
    MeshConfig(preset="zero1"),
    MeshConfig(data=1, expert=8, preset="ep"),
    MeshConfig(data=2, expert=4, preset="ep"),
    MeshConfig(data=-1, expert=2, tensor=2, preset="tp_sp"),
    MeshConfig(data=1, expert=2, tensor=2, sequence=2, preset="tp_sp"),
    MeshConfig(data=-1, expert=2, sequence=2, preset="megascale"),
    MeshConfig(data=1, expert=2, tensor=2, sequence=2, preset="megascale"),
], ids=lambda m: f"{m.preset}:{m.data},{m.expert},{m.tensor},{m.sequence}")
def test_default_model_fits_every_preset_on_8_devices(mesh):
  validate(make(mesh=mesh), 8)


# The words each error uses for a split dimension (logical name -> description).
WORDS = {
    "exp": "the experts", "heads": "the attention heads", "kv_heads": "the key/value heads",
    "vocab": "the vocabulary", "mlp": "the dense MLP width", "exp_mlp": "the expert MLP width",
    "act_attn_seq": "the sequence inside attention", "act_seq": "the sequence between blocks",
    "act_batch": "the batch", "embed": "the model dimension",
    "chunks": "the sequence into an early and a late chunk per device for attention",
    "ulysses_kv": "the key/value heads for Ulysses attention (parallel.attention='ulysses')",
}


def _split(preset: str, dim: str, axes: str) -> str:
  return f"preset {preset!r} splits {WORDS[dim]} over mesh axes {axes}"


@pytest.mark.parametrize("fields, mesh, field, value, allowed", [
    pytest.param(  # experts over the expert axis
        {"model.moe.num_experts": 6}, MeshConfig(data=2, expert=4, preset="ep"),
        "model.moe.num_experts", 6, "a multiple of 4: " + _split("ep", "exp", "expert=4"), id="ep-experts"),
    pytest.param(  # heads are checked before kv_heads (tp_sp's params table lists "heads" first)
        {"model.num_heads": 6, "model.num_kv_heads": 6}, MeshConfig(data=2, tensor=4, preset="tp_sp"),
        "model.num_heads", 6, "a multiple of 4: " + _split("tp_sp", "heads", "tensor=4"), id="tp_sp-heads"),
    pytest.param(  # GQA: 8 query heads divide, 2 kv heads do not
        {"model.num_heads": 8, "model.num_kv_heads": 2}, MeshConfig(data=2, tensor=4, preset="tp_sp"),
        "model.num_kv_heads", 2, "a multiple of 4: " + _split("tp_sp", "kv_heads", "tensor=4"),
        id="tp_sp-kv_heads"),
    pytest.param(
        {"model.num_heads": 6, "model.num_kv_heads": 6}, MeshConfig(data=1, expert=2, tensor=4, preset="megascale"),
        "model.num_heads", 6, "a multiple of 4: " + _split("megascale", "heads", "tensor=4"), id="megascale-heads"),
    pytest.param(
        {"model.vocab_size": 250, "model.num_kv_heads": 4}, MeshConfig(data=2, tensor=4, preset="tp_sp"),
        "model.vocab_size", 250, "a multiple of 4: " + _split("tp_sp", "vocab", "tensor=4"), id="tp_sp-vocab"),
    pytest.param(  # vocab is not split by ep: the same vocab is fine there
        {"model.vocab_size": 250, "model.moe.num_experts": 6}, MeshConfig(data=2, expert=4, preset="ep"),
        "model.moe.num_experts", 6, "a multiple of 4: " + _split("ep", "exp", "expert=4"), id="ep-ignores-vocab"),
    pytest.param(
        {"model.num_dense_layers": 1, "model.mlp_dim": 6, "model.num_kv_heads": 4},
        MeshConfig(data=2, tensor=4, preset="tp_sp"),
        "model.mlp_dim", 6, "a multiple of 4: " + _split("tp_sp", "mlp", "tensor=4"), id="tp_sp-dense-mlp"),
    pytest.param(
        {"model.moe.expert_mlp_dim": 6, "model.num_kv_heads": 4}, MeshConfig(data=2, tensor=4, preset="tp_sp"),
        "model.moe.expert_mlp_dim", 6, "a multiple of 4: " + _split("tp_sp", "exp_mlp", "tensor=4"),
        id="tp_sp-expert-mlp"),
    pytest.param(
        {"model.moe.expert_mlp_dim": 6, "model.num_kv_heads": 4},
        MeshConfig(data=1, expert=2, tensor=4, preset="megascale"),
        "model.moe.expert_mlp_dim", 6, "a multiple of 4: " + _split("megascale", "exp_mlp", "tensor=4"),
        id="megascale-expert-mlp"),
    pytest.param(
        # Shared experts form one dense SwiGLU of width num_shared * expert_mlp_dim = 6. Direct fields are
        # reported before derived widths, so the error names expert_mlp_dim, the field to change.
        {"model.moe.num_shared_experts": 1, "model.moe.expert_mlp_dim": 6, "model.num_kv_heads": 4},
        MeshConfig(data=2, tensor=4, preset="tp_sp"), "model.moe.expert_mlp_dim", 6,
        "a multiple of 4: " + _split("tp_sp", "exp_mlp", "tensor=4"), id="tp_sp-shared-experts-width"),
    pytest.param(  # attention sequence over `sequence`
        {"train.seq_len": 100}, MeshConfig(data=1, sequence=8, preset="tp_sp"),
        "train.seq_len", 100, "a multiple of 8: " + _split("tp_sp", "act_attn_seq", "sequence=8"),
        id="tp_sp-seq"),
    pytest.param(  # residual-stream sequence over `sequence` x `tensor`: 6 divides by 2 but not by 4
        {"train.seq_len": 6}, MeshConfig(data=2, tensor=2, sequence=2, preset="tp_sp"),
        "train.seq_len", 6, "a multiple of 4: " + _split("tp_sp", "act_seq", "sequence=2 x tensor=2"),
        id="tp_sp-seq-times-tensor"),
    pytest.param(
        {"train.seq_len": 100}, MeshConfig(data=1, sequence=8, preset="megascale"),
        "train.seq_len", 100, "a multiple of 8: " + _split("megascale", "act_attn_seq", "expert=1 x sequence=8"),
        id="megascale-seq"),
    pytest.param(  # megascale's attention sequence spans expert x sequence
        {"train.seq_len": 102}, MeshConfig(data=2, expert=2, sequence=2, preset="megascale"),
        "train.seq_len", 102, "a multiple of 4: " + _split("megascale", "act_attn_seq", "expert=2 x sequence=2"),
        id="megascale-seq-expert"),
    pytest.param(  # context-parallel attention cuts the sequence into 2 chunks per device: 36 % 8 != 0
        {"train.seq_len": 36}, MeshConfig(data=2, expert=2, sequence=2, preset="megascale"),
        "train.seq_len", 36, "a multiple of 8: " + _split("megascale", "chunks", "expert=2 x sequence=2"),
        id="megascale-zigzag-chunks"),
    pytest.param(  # Ulysses splits the 2 key/value heads over the 4 sequence devices
        {"parallel.attention": "ulysses"}, MeshConfig(data=2, expert=2, sequence=2, preset="megascale"),
        "model.num_kv_heads", 2,
        "a multiple of 4: " + _split("megascale", "ulysses_kv", "expert=2 x sequence=2 x tensor=1"),
        id="megascale-ulysses-kv-heads"),
    pytest.param(
        {"train.global_batch_size": 12}, MeshConfig(preset="dp"),
        "train.global_batch_size", 12,
        "a multiple of 8: " + _split("dp", "act_batch", "data=8 x expert=1 x tensor=1 x sequence=1"), id="dp-batch"),
    pytest.param(  # tp_sp splits the batch over data x expert only
        {"train.global_batch_size": 6}, MeshConfig(data=2, expert=2, tensor=2, preset="tp_sp"),
        "train.global_batch_size", 6, "a multiple of 4: " + _split("tp_sp", "act_batch", "data=2 x expert=2"),
        id="tp_sp-batch"),
    pytest.param(
        {"model.embed_dim": 12}, MeshConfig(preset="fsdp"),
        "model.embed_dim", 12,
        "a multiple of 8: " + _split("fsdp", "embed", "data=8 x expert=1 x tensor=1 x sequence=1"), id="fsdp-embed"),
    pytest.param(  # zero1 splits only the optimizer state, found through the optimizer rules
        {"model.embed_dim": 12}, MeshConfig(preset="zero1"),
        "model.embed_dim", 12,
        "a multiple of 8: " + _split("zero1", "embed", "data=8 x expert=1 x tensor=1 x sequence=1"),
        id="zero1-embed"),
    pytest.param(  # weight storage over `data` splits every weight's model dimension over data
        {"model.embed_dim": 12}, MeshConfig(data=8, preset="ep", weight_storage="data"),
        "model.embed_dim", 12, "a multiple of 8: preset 'ep' with mesh.weight_storage='data' splits the model "
        "dimension over mesh axes data=8", id="ep-storage-data-embed"),
    pytest.param(  # "all": the router [D, E] has no other split dimension, so its D takes every axis
        {"model.embed_dim": 20}, MeshConfig(data=2, expert=2, tensor=2, preset="tp_sp", weight_storage="all"),
        "model.embed_dim", 20, "a multiple of 8: preset 'tp_sp' with mesh.weight_storage='all' splits the model "
        "dimension over mesh axes data=2 x expert=2 x tensor=2 x sequence=1", id="tp_sp-storage-all-embed"),
])
def test_sharding_divisibility(fields, mesh, field, value, allowed):
  cfg = make(mesh=mesh, **fields)
  cfg.validate()  # every field is fine on its own: only the sharding check fails
  err = expect_error(cfg, field, value, allowed, num_devices=8)
  assert f"preset {mesh.preset!r}" in str(err)


@pytest.mark.parametrize("preset", ["dp", "fsdp", "zero1", "ep"])
def test_presets_without_tensor_parallelism_do_not_split_heads_or_vocab(preset):
  cfg = make(mesh=MeshConfig(preset=preset), **{"model.num_heads": 6, "model.num_kv_heads": 3,
                                                "model.vocab_size": 250})
  validate(cfg, 8)


def test_weight_storage_checks_each_weight_s_model_dimension_against_the_axes_it_gets():
  """Under tp_sp every weight of a dense model has a dimension split over `tensor` (vocabulary, heads, MLP
  width), so weight_storage="all" splits their model dimension over data x expert x sequence only: 12
  divides by those 4 devices though not by all 8, and the layout is valid."""
  fields = {"model.num_dense_layers": 2, "model.embed_dim": 12, "model.num_heads": 4, "model.num_kv_heads": 2}
  validate(make(mesh=MeshConfig(data=2, expert=2, tensor=2, preset="tp_sp", weight_storage="all"), **fields), 8)
  expect_error(make(mesh=MeshConfig(data=2, expert=2, tensor=2, preset="tp_sp", weight_storage="all"),
                    **{**fields, "model.embed_dim": 10}), "model.embed_dim", 10,
               "a multiple of 4: preset 'tp_sp' with mesh.weight_storage='all' splits the model dimension over "
               "mesh axes data=2 x expert=2 x sequence=1", num_devices=8)


@pytest.mark.parametrize("fields", [
    {}, {"model.tie_embeddings": False, "model.num_dense_layers": 1}, {"model.num_dense_layers": 2},
    {"model.moe.num_shared_experts": 1}, {"model.attention": "mla", "model.num_kv_heads": 4},
    {"model.attention": "mla", "model.num_kv_heads": 4, "model.q_lora_rank": 16, "model.num_dense_layers": 1},
], ids=repr)
def test_embed_layouts_are_the_model_s_weights_with_a_model_dimension(fields):
  """rules.embed_layouts (what the divisibility check reads) lists exactly the model's weights that have an
  `embed` dimension."""
  cfg = make(**fields).validate()
  params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
  layouts = jax.tree.leaves(logical_axes_of(params), is_leaf=lambda x: isinstance(x, tuple))
  model = {tuple(name for name in layout if name != "layers") for layout in layouts if "embed" in layout}
  assert set(rules.embed_layouts(cfg)) == model


def test_divisibility_is_checked_when_the_plan_is_built():
  cfg = make(mesh=MeshConfig(data=2, expert=4, preset="ep"), **{"model.moe.num_experts": 6})
  assert cfg.validate() is cfg and cfg.validate(8) is cfg  # the fields and the mesh are fine
  with pytest.raises(ConfigError, match="model.moe.num_experts=6 is invalid: a multiple of 4"):
    ParallelPlan.build(cfg, make_mesh(cfg.mesh, jax.devices()[:8]))


def test_replace_keeps_validation():
  base = Config()
  cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, head_dim=31))
  expect_error(cfg, "model.head_dim", 31, "an even number (rotary embeddings rotate pairs)")
  validate(base, 8)  # the original is untouched


@pytest.mark.parametrize("num_devices", [0, -8])
def test_resolve_mesh_sizes_rejects_impossible_device_counts(num_devices):
  with pytest.raises(ValueError, match="num_devices must be a positive integer"):
    resolve_mesh_sizes(MeshConfig(), num_devices)
