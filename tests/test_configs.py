"""Experiment configs: every file in experiments/configs/ validates for the devices its mesh is meant for and
documents how to run it; the full-size shape configs build, abstractly (nnx.eval_shape, no memory), to exactly
`cost_model.active_params`'s count, and that count is near the published one.

Tolerances against the published figures:
- Mixtral-8x7B and Qwen3-30B-A3B are modelled exactly (Qwen3 lacks only its 12,288 QK-norm weights), so
  total and active are asserted within 3% of the published rounded figures (46.7B / 12.9B, 30.5B / 3.3B);
  the actual gaps are 0.01% / 0.2% and 0.1% / 1.6%.
- DeepSeek-V3 (multi-head latent attention) within 0.5% of 671B and 3% of 37B (+0.004% and +1.5%), and
  its attention weights per layer exactly those computed from DeepSeek-V3's published MLA dimensions.
"""

import importlib.util
import math
import pathlib

import jax
import pytest
from flax import nnx

from meshmoe.analysis import cost_model
from meshmoe.config import resolve_mesh_sizes
from meshmoe.models.decoder import Transformer
from meshmoe.sharding import projection_blocks, rules

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs"
CONFIG_FILES = sorted(p for p in CONFIG_DIR.glob("*.py") if not p.name.startswith("_"))

# Device count each config is validated for; the full-size configs are meant for 64 GPUs and more.
NUM_DEVICES = {"tiny_moe": 8, "moe_1b": 8, "maxtext_tiny_moe": 8, "deepseek_v3": 256}
DEFAULT_DEVICES = 64

# Published (total, active) parameters and the relative tolerance of each comparison.
PUBLISHED = {
    "mixtral_8x7b": (46.7e9, 12.9e9, 0.03),
    "qwen3_30b_a3b": (30.5e9, 3.3e9, 0.03),
}
DEEPSEEK_TOTAL, DEEPSEEK_ACTIVE = 671e9, 37e9
FULL_SIZE = (*PUBLISHED, "deepseek_v3")


def load(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(f"_experiment_config_{path.stem}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def abstract_param_count(model_cfg) -> int:
  """Parameters (nnx.Param leaves) of the model `model_cfg` describes, from shapes alone."""
  model = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)))


def config_file(name: str) -> pathlib.Path:
  return CONFIG_DIR / f"{name}.py"


@pytest.fixture(params=CONFIG_FILES, ids=lambda p: p.stem)
def config_path(request) -> pathlib.Path:
  return request.param


def test_full_size_configs_are_present():
  assert set(FULL_SIZE) <= {p.stem for p in CONFIG_FILES}


def test_config_validates(config_path):
  """Every field, the mesh, and the divisibility of what its preset splits (what ParallelPlan.build checks)."""
  config = load(config_path).get_config()
  num_devices = NUM_DEVICES.get(config_path.stem, DEFAULT_DEVICES)
  config.validate(num_devices)
  rules.check_divisibility(config, resolve_mesh_sizes(config.mesh, num_devices))


def test_docstring_names_the_command_and_the_file(config_path):
  doc = load(config_path).__doc__ or ""
  assert config_path.stem in doc
  # tiny_moe documents its bootstrap command (experiments/run.sh); the others a `python -m` entry point.
  assert "python -m experiments." in doc or "experiments/run.sh" in doc


@pytest.mark.parametrize("name", FULL_SIZE)
def test_full_size_config_settings_and_docstring(name):
  module = load(config_file(name))
  config = module.get_config()
  assert config.model.dtype == "bfloat16"
  assert config.parallel.grouped_gemm == "auto"
  assert not config.model.tie_embeddings
  doc = module.__doc__
  assert f'remat "{config.model.remat}"' in doc  # the choice (the planner's, with the memory it leaves) is explained
  if config.mesh.optimizer_storage != "weights":  # so is a distributed optimizer
    assert f'mesh.optimizer_storage="{config.mesh.optimizer_storage}"' in doc
  devices = NUM_DEVICES.get(name, DEFAULT_DEVICES)  # the docstring's command compiles for the validated count
  assert (f"python -m experiments.aot --config=experiments/configs/{name}.py --target=h100 --devices={devices}"
          in doc)
  assert "does not train on CPU" in doc
  counts = cost_model.active_params(config.model)
  assert f"{counts['total']:,}" in doc and f"{counts['active']:,}" in doc  # the stated counts are current


def test_mid_size_config_states_its_current_counts():
  module = load(config_file("moe_1b"))
  config = module.get_config()
  counts = cost_model.active_params(config.model)
  assert f"{counts['total']:,}" in module.__doc__ and f"{counts['active']:,}" in module.__doc__
  assert abstract_param_count(config.model) == counts["total"]
  config.validate(1)  # one GPU: every axis 1
  rules.check_divisibility(config, resolve_mesh_sizes(config.mesh, 1))


@pytest.mark.parametrize("name", FULL_SIZE)
def test_abstract_model_has_the_cost_model_parameter_count(name):
  model_cfg = load(config_file(name)).get_config().model
  assert abstract_param_count(model_cfg) == cost_model.active_params(model_cfg)["total"]


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_published(name):
  total, active, rel = PUBLISHED[name]
  counts = cost_model.active_params(load(config_file(name)).get_config().model)
  assert counts["total"] == pytest.approx(total, rel=rel)
  assert counts["active"] == pytest.approx(active, rel=rel)


def _mla_params_per_layer(d: int) -> int:
  """DeepSeek-V3's multi-head latent attention weights per layer (its two norms excluded, as in GQA's)."""
  heads, q_rank, kv_rank, nope, rope, v = 128, 1536, 512, 128, 64, 128
  return (d * q_rank + q_rank + q_rank * heads * (nope + rope)  # query down-projection, norm, up-projection
          + d * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)  # joint key-value latent, norm, up
          + heads * v * d)  # output projection


def test_deepseek_v3_counts_match_published():
  m = load(config_file("deepseek_v3")).get_config().model
  counts = cost_model.active_params(m)
  assert counts["total"] == pytest.approx(DEEPSEEK_TOTAL, rel=0.005)
  assert counts["active"] == pytest.approx(DEEPSEEK_ACTIVE, rel=0.03)
  attention = sum(elements for _, elements in projection_blocks.attention_weights(m)) + m.q_lora_rank + m.kv_lora_rank
  assert attention == _mla_params_per_layer(m.embed_dim)
