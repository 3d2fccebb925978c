"""Hugging Face checkpoints load into meshmoe and compute what `transformers` computes.

The fixtures (tests/golden/hf/<case>/) were made by experiments/hf_parity/make_fixtures.py with
`transformers` 5.24 and CPU torch: tiny random Mixtral (top-2, top-1) and Qwen3-MoE (with and without
top-k renormalisation, with a dense first layer) folders, the input tokens, `transformers`' float32 logits
and every MoE layer's chosen experts per token. The model loaded by models/hf_checkpoint.py must give the
same logits (to 1e-4 of their scale) on one device and on four mesh layouts, and choose the same experts
for every token.
"""

import dataclasses
import json
import re
import pathlib
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from meshmoe.config import Config, MeshConfig, ParallelConfig, TrainConfig
from meshmoe.models import hf_checkpoint
from meshmoe.sharding import expert_parallel
from meshmoe.sharding.shardings import use_plan
from meshmoe.training import model_state
from tests.model_steps import plan_for

FIXTURES = pathlib.Path(__file__).parent / "golden" / "hf"
CASES = sorted(p.name for p in FIXTURES.iterdir())
RTOL = 1e-4  # of the logits' scale (their largest magnitude)
# (data, expert, tensor, sequence), preset: expert-, tensor- and sequence-parallel layouts.
LAYOUTS = [((1, 1, 1, 1), "dp"), ((2, 4, 1, 1), "ep"), ((2, 2, 2, 1), "tp_sp"), ((2, 2, 1, 2), "megascale")]


def _load(case: str, layout=((1, 1, 1, 1), "dp"), **parallel):
  folder = FIXTURES / case
  hf = hf_checkpoint.read_config(folder)
  (data, expert, tensor, sequence), preset = layout
  expected = np.load(folder / "expected.npz")
  batch, seq = expected["tokens"].shape
  config = Config(model=hf_checkpoint.model_config(hf),
                  mesh=MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset),
                  train=TrainConfig(global_batch_size=batch, seq_len=seq), parallel=ParallelConfig(**parallel))
  devices = jax.devices()[:data * expert * tensor * sequence]
  config.validate(len(devices))
  plan = plan_for(config, devices)
  graphdef, params, others = model_state.abstract_model_state(config, plan)
  params, others = hf_checkpoint.load(folder, params, others, config.model, hf)
  return nnx.merge(graphdef, params, others), config, plan, expected


def _logits_and_experts(model, plan, tokens, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
  """The model's logits and every MoE layer's chosen experts per token ([layers, B*S, K], sorted), in
  sequence order whatever order the plan's attention wants."""
  chosen = []
  original = expert_parallel.moe_ffn_and_buffer_use  # what the MoE block calls

  def recording(x, experts_BSK, *args):
    # Every MoE layer's choice, whole: the layer scan is a sequential loop, so the calls come in layer order
    # (`ordered=True` is not allowed with more than one device; a wrong order fails the comparison).
    jax.debug.callback(lambda e: chosen.append(np.asarray(e)), experts_BSK)
    return original(x, experts_BSK, *args)

  monkeypatch.setattr(expert_parallel, "moe_ffn_and_buffer_use", recording)
  tokens = jax.device_put(jnp.asarray(tokens), plan.batch_sharding())
  with use_plan(plan):
    permuted, _, _, positions = model_state.in_sequence_order(plan, tokens, tokens, jnp.ones(tokens.shape))
    logits, _ = nnx.jit(lambda m, t, p: m(t, p))(model, permuted, positions)
  logits, experts = np.asarray(logits), np.stack(chosen)
  if positions is not None:  # back into sequence order
    order = np.argsort(np.asarray(positions[0]))
    logits, experts = logits[:, order], experts[:, :, order]
  # The chosen sets (the fixtures store them sorted: transformers' DeepSeek router returns them unsorted).
  return logits, np.sort(experts.reshape(experts.shape[0], -1, experts.shape[-1]), axis=-1)


def _assert_logits_match(logits, expected):
  scale = np.abs(expected).max()
  error = np.abs(logits - expected).max() / scale
  assert error <= RTOL, f"max |logits - transformers'| / scale = {error:.2e} > {RTOL}"


@pytest.mark.parametrize("case", CASES)
def test_logits_and_experts_match_transformers_on_one_device(case, monkeypatch):
  model, config, plan, expected = _load(case)
  logits, experts = _logits_and_experts(model, plan, expected["tokens"], monkeypatch)
  _assert_logits_match(logits, expected["logits"])
  np.testing.assert_array_equal(experts, expected["experts"])


# Loading places every tensor by the plan's rules, the same code for every family; what differs by family is
# which parameters exist. DeepSeek-V3 has them all (latent attention, shared experts, the router's bias, a
# dense first layer) and runs on every layout; the variant without q_lora on the tensor-parallel layout
# (the one that splits its query projection differently); Mixtral (no shared experts, softmax top-2) where
# experts are split most (ep), and Qwen3 (normalised top-k, dense first) on megascale's sequence split.
MESH_CASES = [("deepseek_v3", LAYOUTS[1]), ("deepseek_v3", LAYOUTS[2]), ("deepseek_v3", LAYOUTS[3]),
              ("deepseek_v3_no_q_lora", LAYOUTS[2]), ("mixtral_top2", LAYOUTS[1]),
              ("qwen3_moe_dense_first", LAYOUTS[3])]


@pytest.mark.parametrize("case,layout", MESH_CASES,
                         ids=[f"{c}-{l[1]}-{'x'.join(map(str, l[0]))}" for c, l in MESH_CASES])
def test_logits_and_experts_match_transformers_on_mesh_layouts(case, layout, monkeypatch):
  model, config, plan, expected = _load(case, layout)
  logits, experts = _logits_and_experts(model, plan, expected["tokens"], monkeypatch)
  _assert_logits_match(logits, expected["logits"])
  np.testing.assert_array_equal(experts, expected["experts"])


@pytest.mark.parametrize("parallel", [dict(attention="ring"), dict(attention="ulysses"), dict(impl="xla"),
                                      dict(impl="pallas", kernel_backend="collectives")],
                         ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_latent_attention_matches_transformers_with_each_attention_kind_and_tier(parallel, monkeypatch):
  """MLA through ring and Ulysses context-parallel attention (sequence over 2 devices, heads over 2), the
  xla tier's chunked expert pipeline and ring projections, and the pallas tier's fused kernels as their
  plain-collective versions (the kernels themselves need Hopper GPUs)."""
  layout = ((2, 1, 2, 2), "tp_sp") if "attention" in parallel else ((2, 2, 2, 1), "tp_sp")
  model, config, plan, expected = _load("deepseek_v3", layout, **parallel)
  logits, experts = _logits_and_experts(model, plan, expected["tokens"], monkeypatch)
  _assert_logits_match(logits, expected["logits"])
  np.testing.assert_array_equal(experts, expected["experts"])


def test_config_maps_each_family(tmp_path):
  mixtral = hf_checkpoint.model_config(hf_checkpoint.read_config(FIXTURES / "mixtral_top1"))
  assert (mixtral.moe.top_k, mixtral.moe.normalize_top_k, mixtral.qk_norm) == (1, True, False)
  qwen = hf_checkpoint.model_config(hf_checkpoint.read_config(FIXTURES / "qwen3_moe_no_norm_topk"))
  assert (qwen.moe.num_experts, qwen.moe.normalize_top_k, qwen.qk_norm, qwen.num_dense_layers) == (8, False, True, 0)
  dense_first = hf_checkpoint.model_config(hf_checkpoint.read_config(FIXTURES / "qwen3_moe_dense_first"))
  assert (dense_first.num_dense_layers, dense_first.mlp_dim) == (1, 80)
  # Published folders (transformers 4 names): num_experts, rope_theta.
  published = hf_checkpoint.read_config(FIXTURES / "qwen3_moe_no_norm_topk")
  published["num_experts"] = published.pop("num_local_experts")
  published.pop("rope_parameters")
  published["rope_theta"] = 1e6
  config = hf_checkpoint.model_config(published)
  assert (config.moe.num_experts, config.rope_theta) == (8, 1e6)


def _copy(tmp_path, case="mixtral_top2") -> pathlib.Path:
  folder = tmp_path / case
  shutil.copytree(FIXTURES / case, folder)
  return folder


def _edit_config(folder: pathlib.Path, **changes) -> dict:
  hf = json.loads((folder / "config.json").read_text())
  hf.update(changes)
  (folder / "config.json").write_text(json.dumps(hf))
  return hf


@pytest.mark.parametrize("changes, message", [
    (dict(architectures=["LlamaForCausalLM"]), "meshmoe loads MixtralForCausalLM, Qwen3MoeForCausalLM"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0}), "rope scaling 'longrope'"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                        "attention_factor": 0.5}), "YaRN with attention_factor"),
    (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope scaling 'linear'"),
    (dict(sliding_window=8), "sliding_window=8"),
])
def test_unsupported_configs_are_refused_by_name(tmp_path, changes, message):
  hf = _edit_config(_copy(tmp_path), **changes)
  with pytest.raises(hf_checkpoint.CheckpointError, match=message.replace("[", r"\[").replace("(", r"\(")):
    hf_checkpoint.model_config(hf)


def test_qwen3_dense_layers_must_come_first(tmp_path):
  hf = _edit_config(_copy(tmp_path, "qwen3_moe_norm_topk"), mlp_only_layers=[1])
  with pytest.raises(hf_checkpoint.CheckpointError, match=r"mlp_only_layers=\[1\]"):
    hf_checkpoint.model_config(hf)


def test_shape_fields_cannot_be_overridden():
  hf = hf_checkpoint.read_config(FIXTURES / "mixtral_top2")
  assert hf_checkpoint.model_config(hf, remat="full").remat == "full"
  with pytest.raises(hf_checkpoint.CheckpointError, match="model.embed_dim comes from config.json"):
    hf_checkpoint.model_config(hf, embed_dim=128)
  with pytest.raises(hf_checkpoint.CheckpointError, match="model.moe.top_k comes from config.json"):
    hf_checkpoint.model_config(hf, moe={"top_k": 1})


def test_a_run_keeps_only_how_it_computes_from_its_own_model_fields():
  from meshmoe.config import ModelConfig, MoEConfig
  folder = FIXTURES / "qwen3_moe_norm_topk"
  mine = Config(model=ModelConfig(remat="full", dtype="bfloat16", qk_norm=False, num_layers=7,
                                  moe=MoEConfig(num_experts=16, num_groups=4, top_k_groups=2, capacity_factor=1.5)),
                train=TrainConfig(init_from=f"hf:{folder}"))
  model = hf_checkpoint.with_checkpoint_model(mine).model
  assert (model.remat, model.dtype, model.moe.capacity_factor) == ("full", "bfloat16", 1.5)
  assert model == dataclasses.replace(
      hf_checkpoint.model_config(hf_checkpoint.read_config(folder)), remat="full", dtype="bfloat16",
      moe=dataclasses.replace(hf_checkpoint.model_config(hf_checkpoint.read_config(folder)).moe,
                              capacity_factor=1.5))
  assert (model.qk_norm, model.num_layers, model.moe.num_experts, model.moe.num_groups) == (True, 2, 8, 1)


def _load_into_fresh_model(folder: pathlib.Path):
  hf = hf_checkpoint.read_config(folder)
  config = Config(model=hf_checkpoint.model_config(hf), mesh=MeshConfig(data=1, preset="dp"),
                  train=TrainConfig(global_batch_size=8, seq_len=16))
  plan = plan_for(config, jax.devices()[:1])
  _, params, others = model_state.abstract_model_state(config, plan)
  return jax.block_until_ready(hf_checkpoint.load(folder, params, others, config.model, hf)[0])


Q_PROJ, EXPERT_W2 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.block_sparse_moe.experts.3.w2.weight"


@pytest.mark.parametrize("name, edit, message", [
    (EXPERT_W2, lambda t: None, rf"'{EXPERT_W2}' is not in the checkpoint"),
    (Q_PROJ, lambda t: t[:32], rf"'{Q_PROJ}' has shape \(32, 64\)"),
    ("model.norm.weight", lambda t: t.astype(np.int32), r"'model.norm.weight' has dtype int32; weights are"),
], ids=["missing", "shape", "dtype"])
def test_a_bad_tensor_is_named(tmp_path, name, edit, message):
  """A tensor removed (edit gives None), cut to another shape or cast to an integer dtype."""
  from safetensors.numpy import load_file, save_file
  folder = _copy(tmp_path)
  tensors = load_file(folder / "model.safetensors")
  tensors[name] = edit(tensors[name])
  save_file({k: v for k, v in tensors.items() if v is not None}, folder / "model.safetensors")
  with pytest.raises(hf_checkpoint.CheckpointError, match=message):
    _load_into_fresh_model(folder)


def test_fp8_weights_need_their_scales(tmp_path):
  folder = _copy(tmp_path, "deepseek_v3_fp8")
  shard = folder / "model.safetensors"
  # Renamed in the header (same length, so the file stays valid): the weight has no scales any more.
  data = shard.read_bytes()
  scale = b"model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"
  assert data.count(scale) == 1
  shard.write_bytes(data.replace(scale, scale[:-1] + b"x"))
  with pytest.raises(hf_checkpoint.CheckpointError, match=r"'model.layers.1.mlp.experts.5.up_proj.weight' is FP8 "
                                                          r"but the checkpoint has no"):
    _load_into_fresh_model(folder)


def test_truncated_shard_and_missing_folder_are_named(tmp_path):
  folder = _copy(tmp_path)
  data = (folder / "model.safetensors").read_bytes()
  (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(hf_checkpoint.CheckpointError, match="model.safetensors is not a readable safetensors file"):
    _load_into_fresh_model(folder)
  with pytest.raises(hf_checkpoint.CheckpointError, match="has no config.json"):
    hf_checkpoint.read_config(tmp_path / "nowhere")


# --- export -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["mixtral_top2", "qwen3_moe_dense_first", "deepseek_v3", "deepseek_v3_no_q_lora"])
def test_export_writes_the_tensors_it_loaded_bitwise(case, tmp_path):
  from safetensors.numpy import load_file
  from meshmoe.models import hf_export
  model, config, plan, _ = _load(case, LAYOUTS[2])  # tensor- and expert-parallel: blocks on many devices
  _, params, others = nnx.split(model, nnx.Param, ...)
  out = hf_export.save(params, config.model, tmp_path / "export", others=others, dtype="float32",
                       max_shard_bytes=50_000)
  original = load_file(FIXTURES / case / "model.safetensors")
  index = json.loads((out / "model.safetensors.index.json").read_text())
  assert sorted(index["weight_map"]) == sorted(original)
  assert len(set(index["weight_map"].values())) > 1  # several shards
  exported = {}
  for shard in sorted(set(index["weight_map"].values())):
    exported.update(load_file(out / shard))
  for name, tensor in original.items():
    np.testing.assert_array_equal(exported[name], tensor, err_msg=name)
  # The exported folder loads back to the same model.
  assert hf_checkpoint.model_config(hf_checkpoint.read_config(out)) == config.model
  again = jax.tree.map(np.asarray, _load_into_fresh_model(out))
  for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(again)[0],
                               jax.tree_util.tree_flatten_with_path(jax.tree.map(np.asarray, params))[0]):
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_failed_export_leaves_no_complete_looking_folder(tmp_path, monkeypatch):
  from meshmoe.models import hf_export
  model, config, _, _ = _load("mixtral_top2")
  _, params, _ = nnx.split(model, nnx.Param, ...)
  real, calls = hf_export._host_tensor, []

  def failing(*args):
    calls.append(1)
    if len(calls) == 5:
      raise OSError("disk full")
    return real(*args)

  monkeypatch.setattr(hf_export, "_host_tensor", failing)
  with pytest.raises(OSError, match="disk full"):
    hf_export.save(params, config.model, tmp_path / "export", max_shard_bytes=50_000)
  assert not (tmp_path / "export").exists()
  assert [p.name.split(".partial-")[0] for p in tmp_path.iterdir()] == ["export"]
  monkeypatch.setattr(hf_export, "_host_tensor", real)
  (tmp_path / "taken").mkdir()
  with pytest.raises(hf_checkpoint.CheckpointError, match="exists: export writes a new folder"):
    hf_export.save(params, config.model, tmp_path / "taken")


def test_models_their_family_does_not_compute_are_not_exported():
  from meshmoe.models import hf_export
  hf = hf_checkpoint.read_config(FIXTURES / "mixtral_top2")
  model = hf_checkpoint.model_config(hf)
  assert hf_export.hf_config(model, "bfloat16")["architectures"] == ["MixtralForCausalLM"]
  shared = dataclasses.replace(model, moe=dataclasses.replace(model.moe, num_shared_experts=1))
  with pytest.raises(hf_checkpoint.CheckpointError, match="num_shared_experts=1"):
    hf_export.hf_config(shared, "bfloat16")
  deepseek = hf_checkpoint.model_config(hf_checkpoint.read_config(FIXTURES / "deepseek_v3"))
  assert hf_export.hf_config(deepseek, "bfloat16")["architectures"] == ["DeepseekV3ForCausalLM"]
  unbiased = dataclasses.replace(deepseek, moe=dataclasses.replace(deepseek.moe, expert_bias=False))
  with pytest.raises(hf_checkpoint.CheckpointError, match="does not export as DeepSeek-V3: expert_bias=False"):
    hf_export.hf_config(unbiased, "bfloat16")
  with pytest.raises(hf_checkpoint.CheckpointError, match="does not export as Mixtral: Mixtral has no dense layers"):
    hf_export.hf_config(dataclasses.replace(model, num_dense_layers=1), "bfloat16")


# --- training from a checkpoint -------------------------------------------------------------------------


def _char_tokenizer(path: pathlib.Path) -> None:
  """A tokenizer.json of 96 entries (unknown + printable ASCII), the fixtures' vocabulary size."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers
  vocab = {"<unk>": 0, **{chr(c): c - 31 for c in range(32, 127)}}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
  tokenizer.decoder = decoders.Fuse()
  tokenizer.save(str(path))


def test_training_starts_from_the_checkpoint_and_resumes_its_own(tmp_path, capsys):
  from meshmoe.config import DataConfig, OptimizerConfig, SampleConfig
  from meshmoe.training import trainer
  folder = _copy(tmp_path, "qwen3_moe_dense_first")
  _char_tokenizer(folder / "tokenizer.json")
  _edit_config(folder, eos_token_id=3)  # what meshmoe does not use, the export keeps
  (folder / "tokenizer_config.json").write_text('{"eos_token": "$"}')
  text = tmp_path / "corpus.txt"
  text.write_text("def f(x):\n  return x * 2\n" * 400)
  config = Config(mesh=MeshConfig(data=4, expert=2, preset="ep"),
                  train=TrainConfig(steps=1, global_batch_size=8, seq_len=16, eval_every=0, eval_batches=1,
                                    init_from=f"hf:{folder}"),
                  # A vanishing rate: after one step the parameters are still the checkpoint's, bit for bit.
                  optimizer=OptimizerConfig(learning_rate=1e-30, warmup_steps=0),
                  data=DataConfig(source="text", paths=str(text), eval_paths=str(text)),
                  sample=SampleConfig(max_new_tokens=0))
  trainer.train(config, tmp_path / "run")
  assert "parameters from" in capsys.readouterr().out
  saved = json.loads((tmp_path / "run" / "config.json").read_text())
  assert (saved["model"]["qk_norm"], saved["model"]["vocab_size"]) == (True, 96)  # from config.json
  assert saved["data"]["tokenizer"] == str(folder / "tokenizer.json")
  exported = tmp_path / "export"
  from meshmoe.training import hf_convert
  assert hf_convert.to_hf_folder(tmp_path / "run", exported, "float32") == 1
  from safetensors.numpy import load_file
  original = load_file(folder / "model.safetensors")
  index = json.loads((exported / "model.safetensors.index.json").read_text())
  written = {}
  for shard in set(index["weight_map"].values()):
    written.update(load_file(exported / shard))
  for name, tensor in original.items():
    np.testing.assert_array_equal(written[name], tensor, err_msg=name)
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (exported / name).read_text() == (folder / name).read_text()
  assert json.loads((exported / "config.json").read_text())["eos_token_id"] == 3
  # A second run in the same workdir resumes from its own checkpoint, not from the Hugging Face folder.
  trainer.train(dataclasses.replace(config, train=dataclasses.replace(config.train, steps=2)), tmp_path / "run")
  out = capsys.readouterr().out
  assert "resuming from the checkpoint of step 1" in out and "parameters from" not in out


def test_two_processes_load_their_own_blocks_and_export_together(tmp_path):
  """2 processes x 4 CPU devices, experts over all 8: each process reads only its experts' tensors (the
  rest, replicated, once each), and the export at the end of training writes the checkpoint's tensors
  back bit for bit (shards from both processes)."""
  from safetensors.numpy import load_file
  from tests import runs
  folder = _copy(tmp_path, "qwen3_moe_norm_topk")  # 8 experts: one per device
  _char_tokenizer(folder / "tokenizer.json")
  text = tmp_path / "corpus.txt"
  text.write_text("def f(x):\n  return x * 2\n" * 400)
  exported = tmp_path / "export"
  result = runs.run(runs.launch_command(
      tmp_path / "run", f"--config.train.init_from=hf:{folder}", f"--config.train.export_hf={exported}",
      "--config.mesh.data=1", "--config.mesh.expert=8", "--config.mesh.preset=ep", "--config.train.steps=1",
      "--config.train.global_batch_size=8", "--config.train.seq_len=16", "--config.train.eval_every=0",
      "--config.optimizer.learning_rate=1e-30", "--config.optimizer.warmup_steps=0",
      "--config.data.source=text", f"--config.data.paths={text}", f"--config.data.eval_paths={text}",
      "--config.sample.max_new_tokens=0"), timeout=900)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  logs = "".join((tmp_path / "run" / "logs" / f"process_{i}.log").read_text() for i in range(2))
  read = {int(p): float(mb.replace(",", "")) for mb, p in re.findall(r"\(([\d.,]+) MB read by process (\d)\)", logs)}
  original = load_file(folder / "model.safetensors")
  expert_mb = sum(t.nbytes for n, t in original.items() if ".experts." in n) / 1e6
  shared_mb = sum(t.nbytes for n, t in original.items() if ".experts." not in n) / 1e6
  # Each process reads the replicated tensors once (its 4 devices share the read) and its 4 experts.
  for process in (0, 1):
    assert read[process] == pytest.approx(shared_mb + expert_mb / 2, abs=0.01), (read, shared_mb, expert_mb)
  index = json.loads((exported / "model.safetensors.index.json").read_text())
  written = {}
  for shard in set(index["weight_map"].values()):
    written.update(load_file(exported / shard))
  assert sorted(written) == sorted(original)
  for name, tensor in original.items():  # exported in bfloat16: the checkpoint's values rounded to it
    assert written[name].dtype == ml_dtypes.bfloat16, name
    np.testing.assert_array_equal(written[name], tensor.astype(ml_dtypes.bfloat16), err_msg=name)
