"""Hugging Face checkpoints in: `config.json` to a ModelConfig, safetensors shards to sharded parameters.

Architectures (`config.json`'s "architectures"): MixtralForCausalLM, Qwen3MoeForCausalLM and
DeepseekV3ForCausalLM, computed as `transformers` computes them (Qwen3: per-head QK-norm, `norm_topk_prob`;
DeepSeek-V3: multi-head latent attention, shared experts, group-limited routing with selection biases;
dense layers allowed only as the first layers, meshmoe's `num_dense_layers`). Anything else is refused
with the reason, never approximated.

Loading streams: each device's block of each parameter is assembled from the Hugging Face tensors that
hold it (one layer's, one expert's), read one at a time with `os.pread` (only the rows the block needs,
`Shards`), transposed to meshmoe's layout, cast to float32, copied to the devices that hold that block
and written into their block in place; devices that hold the same block share the read. So host memory
holds one tensor's block at a time, never the model, and each process of a multi-process job reads only
the blocks of its own devices.

Layouts (torch `nn.Linear` stores [out, in]; meshmoe stores [in..., out...] with the heads apart):
  q_proj [N*H, D] -> query_DNH [D, N, H];  k_proj, v_proj [G*H, D] -> [D, G, H];  o_proj [D, N*H] ->
  out_NHD [N, H, D];  router gate [E, D] -> kernel_DE;  expert gate (w1) / up (w3) [F, D] -> [D, F],
  down (w2) [D, F] -> [F, D], stacked over experts [E, ...] and layers [L, ...];  lm_head [V, D] ->
  unembed_DV;  embeddings and norms as they are.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import struct
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from meshmoe.config import Config, ModelConfig, MoEConfig

ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM")


class CheckpointError(ValueError):
  """A Hugging Face folder meshmoe cannot load: what is wrong, and what is allowed."""


# --- config.json -> ModelConfig ------------------------------------------------------------------------


def read_config(folder: str | pathlib.Path) -> dict:
  path = pathlib.Path(folder) / "config.json"
  if not path.is_file():
    raise CheckpointError(f"{folder} has no config.json: a Hugging Face model folder holds config.json and "
                          "*.safetensors shards")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def architecture(hf: dict) -> str:
  names = hf.get("architectures") or []
  known = [a for a in names if a in ARCHITECTURES]
  if not known:
    raise CheckpointError(f"config.json names architectures {names}; meshmoe loads {', '.join(ARCHITECTURES)}")
  return known[0]


def model_config(hf: dict, **overrides) -> ModelConfig:
  """The ModelConfig that computes what `transformers` computes for this config.json; `overrides` set the
  fields a run chooses for itself (`_RUN_FIELDS`: dtype, remat, capacity, router loss weights...)."""
  arch = architecture(hf)
  _refuse_unsupported(hf, arch)
  d, heads = hf["hidden_size"], hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or d // heads
  layers = hf["num_hidden_layers"]
  attention = {}
  if arch == "MixtralForCausalLM":
    moe = MoEConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    expert_mlp_dim=hf["intermediate_size"], normalize_top_k=True)
    dense_layers, dense_width = 0, hf["intermediate_size"]
  elif arch == "Qwen3MoeForCausalLM":
    moe = MoEConfig(num_experts=_field(hf, "num_experts", "num_local_experts"), top_k=hf["num_experts_per_tok"],
                    expert_mlp_dim=hf["moe_intermediate_size"], normalize_top_k=bool(hf.get("norm_topk_prob")))
    dense_layers, dense_width = len(hf.get("mlp_only_layers") or []), hf["intermediate_size"]
    attention = dict(qk_norm=True)
  else:  # DeepseekV3ForCausalLM
    moe = MoEConfig(num_experts=_field(hf, "n_routed_experts", "num_local_experts"), top_k=hf["num_experts_per_tok"],
                    expert_mlp_dim=hf["moe_intermediate_size"], num_shared_experts=hf.get("n_shared_experts") or 0,
                    score_fn=hf.get("scoring_func", "sigmoid"), normalize_top_k=bool(hf.get("norm_topk_prob")),
                    routed_scaling=float(hf.get("routed_scaling_factor", 1.0)), expert_bias=True,
                    num_groups=hf.get("n_group") or 1, top_k_groups=hf.get("topk_group") or 1)
    dense_layers, dense_width = hf.get("first_k_dense_replace", 0), hf["intermediate_size"]
    heads_kv = hf.get("num_key_value_heads") or heads
    attention = dict(attention="mla", q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                     qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                     v_head_dim=hf["v_head_dim"], rope_interleave=bool(hf.get("rope_interleave", True)),
                     num_kv_heads=heads_kv, head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"])
    if moe.score_fn not in ("sigmoid", "softmax"):
      raise CheckpointError(f"DeepseekV3ForCausalLM config.json has scoring_func={moe.score_fn!r}; meshmoe "
                            "computes 'sigmoid' and 'softmax'")
  if arch != "DeepseekV3ForCausalLM":
    moe = dataclasses.replace(moe, score_fn="softmax", routed_scaling=1.0, expert_bias=False)
  fields = dict(
      vocab_size=hf["vocab_size"], embed_dim=d, num_layers=layers, num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim, mlp_dim=dense_width,
      num_dense_layers=dense_layers, max_seq_len=hf.get("max_position_embeddings", 4096),
      rope_theta=float(_rope(hf).get("rope_theta", 10_000.0)), norm_eps=float(hf["rms_norm_eps"]),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), moe=moe, **_yarn(hf))
  return _override(ModelConfig(**{**fields, **attention}), overrides)


def _yarn(hf: dict) -> dict:
  """ModelConfig's yarn_* fields from the rope settings (empty without YaRN). A missing mscale is 0, as
  transformers reads it (falsy: cos and sin then scale by mscale(factor, 1))."""
  rope = _rope(hf)
  if rope.get("rope_type", rope.get("type", "default")) != "yarn":
    return {}
  original = rope.get("original_max_position_embeddings")
  factor = rope.get("factor") or hf["max_position_embeddings"] / original
  return dict(yarn_factor=float(factor), yarn_original_max_len=int(original),
              yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1),
              yarn_mscale=float(rope.get("mscale") or 0.0),
              yarn_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0))


# The model fields a run chooses for itself: how it computes, not what. Every other model field (every
# parameter's shape and the function the model computes) comes from config.json, including fields added
# to ModelConfig later, until they are listed here.
_RUN_FIELDS = {"dtype", "remat", "logits_chunk_bytes", "init_std"}
_RUN_MOE_FIELDS = {"capacity_factor", "aux_loss_weight", "balance_loss", "z_loss_weight",
                   "expert_bias_update_rate"}


def folder_of(init_from: str) -> pathlib.Path:
  """The folder of a `train.init_from` value 'hf:<folder>'."""
  if not init_from.startswith("hf:") or not init_from[3:]:
    raise CheckpointError(f"train.init_from={init_from!r}: expected 'hf:<folder>'")
  return pathlib.Path(init_from[3:]).expanduser()


def with_checkpoint_model(config: Config) -> Config:
  """`config` with its model as `train.init_from`'s config.json says (the run's own fields kept where they
  change no shape) and, while data.tokenizer is "byte", the folder's tokenizer.json. Unchanged without
  init_from."""
  if not config.train.init_from:
    return config
  folder = folder_of(config.train.init_from)
  own = {name: getattr(config.model, name) for name in _RUN_FIELDS}
  own["moe"] = {name: getattr(config.model.moe, name) for name in _RUN_MOE_FIELDS}
  model = model_config(read_config(folder), **own)
  data = config.data
  if data.tokenizer == "byte" and (folder / "tokenizer.json").is_file():
    data = dataclasses.replace(data, tokenizer=str(folder / "tokenizer.json"))
  return dataclasses.replace(config, model=model, data=data)


def _override(config: ModelConfig, overrides: dict) -> ModelConfig:
  moe_overrides = overrides.pop("moe", {}) or {}
  for name in overrides:
    if name not in _RUN_FIELDS:
      raise CheckpointError(f"model.{name} comes from config.json and cannot be overridden; allowed: "
                            f"{', '.join(sorted(_RUN_FIELDS))}")
  for name in moe_overrides:
    if name not in _RUN_MOE_FIELDS:
      raise CheckpointError(f"model.moe.{name} comes from config.json and cannot be overridden; allowed: "
                            f"{', '.join(sorted(_RUN_MOE_FIELDS))}")
  return dataclasses.replace(config, **overrides, moe=dataclasses.replace(config.moe, **moe_overrides))


def _field(hf: dict, *names: str):
  """The first of `names` that config.json sets (transformers renamed some fields across versions)."""
  for name in names:
    if hf.get(name) is not None:
      return hf[name]
  raise CheckpointError(f"config.json sets none of {', '.join(names)}")


def _rope(hf: dict) -> dict:
  """RoPE settings: transformers 5 writes `rope_parameters` (rope_theta, rope_type); published folders
  `rope_theta` and `rope_scaling`."""
  rope = dict(hf.get("rope_parameters") or {})
  if hf.get("rope_theta") is not None:
    rope.setdefault("rope_theta", hf["rope_theta"])
  if hf.get("rope_scaling"):
    rope.update(hf["rope_scaling"])
  return rope


def _refuse_unsupported(hf: dict, arch: str) -> None:
  """Features of these architectures that meshmoe does not compute: loading would silently differ."""
  problems = []
  if hf.get("hidden_act", "silu") != "silu":
    problems.append(f"hidden_act={hf['hidden_act']!r} (meshmoe's experts are SwiGLU: 'silu')")
  rope = _rope(hf)
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type not in ("default", "yarn"):
    problems.append(f"rope scaling {rope_type!r} (meshmoe applies plain RoPE or YaRN)")
  if rope_type == "yarn" and (rope.get("attention_factor") is not None or rope.get("truncate") is False):
    problems.append("YaRN with attention_factor or truncate=false (meshmoe computes transformers' defaults)")
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    problems.append(f"partial_rotary_factor={rope['partial_rotary_factor']}")
  if hf.get("attention_bias"):
    problems.append("attention_bias=true (meshmoe's projections have no bias)")
  if hf.get("sliding_window") and hf.get("use_sliding_window", arch == "MixtralForCausalLM"):
    if hf["sliding_window"] < hf.get("max_position_embeddings", 0):
      problems.append(f"sliding_window={hf['sliding_window']} (meshmoe's attention is full causal)")
  quantization = hf.get("quantization_config") or {}
  if quantization and quantization.get("quant_method") != "fp8":
    problems.append(f"quantization_config.quant_method={quantization.get('quant_method')!r} (meshmoe "
                    "dequantizes 'fp8' block-scaled weights on load)")
  if arch == "DeepseekV3ForCausalLM" and hf.get("topk_method", "noaux_tc") != "noaux_tc":
    problems.append(f"topk_method={hf['topk_method']!r} (meshmoe routes as DeepSeek-V3: 'noaux_tc')")
  if arch == "Qwen3MoeForCausalLM":
    layers = hf["num_hidden_layers"]
    dense = sorted(hf.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
      problems.append(f"mlp_only_layers={dense} (meshmoe's dense layers must be the first ones: [0, 1, ...])")
    step = hf.get("decoder_sparse_step", 1)
    if step != 1 and any((i + 1) % step for i in range(len(dense), layers)):
      problems.append(f"decoder_sparse_step={step} (meshmoe runs an MoE block in every layer after the "
                      "dense ones: decoder_sparse_step=1)")
  if problems:
    raise CheckpointError(f"{arch} config.json uses what meshmoe does not compute: " + "; ".join(problems))


# --- safetensors -> parameters -------------------------------------------------------------------------


class Shards:
  """The tensors of a folder's safetensors shards, by name. Each shard's header is read once; tensor blocks
  are read with `os.pread`, rows at a time, into fresh arrays. (The `safetensors` package maps the whole
  file: every page a load touches would stay resident until the file is closed, and a load touches them
  all, so host memory would grow with the checkpoint.)"""

  def __init__(self, folder: str | pathlib.Path):
    self.folder = pathlib.Path(folder)
    self._shards: dict[str, _Shard] = {}
    index = self.folder / "model.safetensors.index.json"
    if index.is_file():
      weight_map = json.loads(index.read_text()).get("weight_map", {})
    else:
      weight_map = {}
      for path in sorted(self.folder.glob("*.safetensors")):
        weight_map.update({name: path.name for name in self._shard(path.name).tensors})
    if not weight_map:
      raise CheckpointError(f"{self.folder} has no *.safetensors shards (nor model.safetensors.index.json)")
    missing = sorted({f for f in weight_map.values() if not (self.folder / f).is_file()})
    if missing:
      raise CheckpointError(f"model.safetensors.index.json names shards missing from {self.folder}: "
                            f"{', '.join(missing)}")
    self.weight_map = weight_map
    self.bytes_read = 0  # tensor bytes read so far (each block once per process)
    self.fp8_block = (128, 128)  # the tiles of FP8 weights' scales (config.json's quantization_config)

  def _shard(self, name: str) -> "_Shard":
    if name not in self._shards:
      self._shards[name] = _Shard(self.folder / name, self)
    return self._shards[name]

  def tensor(self, name: str) -> "_TensorFile":
    """Tensor `name`; index it with slices to read a block."""
    if name not in self.weight_map:
      raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {self.folder}")
    shard = self._shard(self.weight_map[name])
    if name not in shard.tensors:
      raise CheckpointError(f"tensor {name!r} is not in {shard.path}, where the index says it is")
    return shard.tensors[name]

  def close(self) -> None:
    for shard in self._shards.values():
      os.close(shard.fd)
    self._shards.clear()


# safetensors dtype names -> numpy dtypes (ml_dtypes for the ones numpy lacks).
SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                      "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2, "I64": np.int64,
                      "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class _Shard:
  """One safetensors file: an 8-byte little-endian header length, a JSON header (per tensor: dtype, shape,
  data_offsets), then the tensors' bytes."""

  def __init__(self, path: pathlib.Path, owner: "Shards | None" = None):
    self.path = path
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
      (length,) = struct.unpack("<Q", os.pread(fd, 8, 0)) if size >= 8 else (None,)
      if length is None or 8 + length > size:
        raise CheckpointError(f"{path} is not a readable safetensors file: truncated header")
      try:
        header = json.loads(os.pread(fd, length, 8))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: header is not JSON ({e})") from None
    except BaseException:
      os.close(fd)
      raise
    self.fd = fd
    self.tensors = {}
    for name, entry in header.items():
      if name == "__metadata__":
        continue
      begin, end = entry["data_offsets"]
      if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"tensor {name!r} in {path} has dtype {entry['dtype']}; meshmoe reads "
                              f"{', '.join(SAFETENSORS_DTYPES)}")
      dtype = np.dtype(SAFETENSORS_DTYPES[entry["dtype"]])
      if 8 + length + end > size or end - begin != math.prod(entry["shape"]) * dtype.itemsize:
        raise CheckpointError(f"{path} is not a readable safetensors file: tensor {name!r} lies past its end "
                              "(a truncated or partly copied file)")
      self.tensors[name] = _TensorFile(fd, 8 + length + begin, tuple(entry["shape"]), dtype, owner)


@dataclasses.dataclass(frozen=True)
class _TensorFile:
  fd: int
  offset: int  # of its first byte in the file
  shape: tuple[int, ...]
  dtype: np.dtype
  owner: "Shards | None" = None  # counts the bytes read

  def get_shape(self) -> tuple[int, ...]:
    return self.shape

  def __getitem__(self, index) -> np.ndarray:
    """The block `index` (slices, one per dimension at most): whole rows of the first dimension are read,
    the other dimensions sliced in memory."""
    index = index if isinstance(index, tuple) else (index,)
    if not self.shape:
      return np.frombuffer(os.pread(self.fd, self.dtype.itemsize, self.offset), self.dtype).reshape(())
    lo, hi = _bounds(index[0], self.shape[0]) if index else (0, self.shape[0])
    row = math.prod(self.shape[1:]) * self.dtype.itemsize
    data = os.pread(self.fd, (hi - lo) * row, self.offset + lo * row)
    if self.owner is not None:
      self.owner.bytes_read += len(data)
    block = np.frombuffer(data, self.dtype).reshape(hi - lo, *self.shape[1:])
    return block[(slice(None), *index[1:])]


@dataclasses.dataclass(frozen=True)
class Source:
  """Where one meshmoe parameter comes from: `name(layer, expert)` for each of its `stacked` leading
  dimensions ("layer", "expert"); its trailing dimensions are the Hugging Face tensor's, transposed
  (`in_dims` then `out_dims`, the [out, in] matrix's two sides each split into these sizes) or as they are."""

  name: Callable[..., str]
  stacked: tuple[str, ...] = ()
  in_dims: tuple[int, ...] = ()  # empty: not transposed
  out_dims: tuple[int, ...] = ()
  layer_offset: int = 0  # the Hugging Face index of this stack's first layer


def sources(hf: dict, config: ModelConfig) -> dict[str, Source]:
  """meshmoe parameter path (as `jax.tree_util.keystr` writes it) -> its Source."""
  arch = architecture(hf)
  d, n, g, h = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
  e_, f = config.moe.num_experts, config.moe.expert_mlp_dim
  layer = lambda suffix: (lambda l, *_: f"model.layers.{l}.{suffix}")
  out = {"['embed']['table_VD']": Source(lambda *_: "model.embed_tokens.weight"),
         "['final_norm']['scale']": Source(lambda *_: "model.norm.weight")}
  if not config.tie_embeddings:
    out["['unembed_DV']"] = Source(lambda *_: "lm_head.weight", in_dims=(d,), out_dims=(config.vocab_size,))
  stacks = [("dense_layers", 0, config.num_dense_layers), ("moe_layers", config.num_dense_layers,
                                                            config.num_layers - config.num_dense_layers)]
  for stack, first, count in stacks:
    if not count:
      continue
    put = lambda path, source: out.__setitem__(f"['{stack}']['layer']{path}", dataclasses.replace(
        source, stacked=("layer", *source.stacked), layer_offset=first))
    put("['attn_norm']['scale']", Source(layer("input_layernorm.weight")))
    put("['ffn_norm']['scale']", Source(layer("post_attention_layernorm.weight")))
    if config.attention == "mla":
      for path, source in _latent_attention_sources(config, layer).items():
        put(path, source)
    else:
      put("['attn']['query_DNH']", Source(layer("self_attn.q_proj.weight"), in_dims=(d,), out_dims=(n, h)))
      put("['attn']['key_DGH']", Source(layer("self_attn.k_proj.weight"), in_dims=(d,), out_dims=(g, h)))
      put("['attn']['value_DGH']", Source(layer("self_attn.v_proj.weight"), in_dims=(d,), out_dims=(g, h)))
      put("['attn']['out_NHD']", Source(layer("self_attn.o_proj.weight"), in_dims=(n, h), out_dims=(d,)))
    if config.qk_norm:
      put("['attn']['query_norm']['scale']", Source(layer("self_attn.q_norm.weight")))
      put("['attn']['key_norm']['scale']", Source(layer("self_attn.k_norm.weight")))
    if stack == "dense_layers":
      w = config.mlp_dim
      put("['ffn']['gate_DF']", Source(layer("mlp.gate_proj.weight"), in_dims=(d,), out_dims=(w,)))
      put("['ffn']['up_DF']", Source(layer("mlp.up_proj.weight"), in_dims=(d,), out_dims=(w,)))
      put("['ffn']['down_FD']", Source(layer("mlp.down_proj.weight"), in_dims=(w,), out_dims=(d,)))
      continue
    if arch == "MixtralForCausalLM":
      router, gate, up, down = ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight")
    else:
      router, gate, up, down = ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight",
                                "mlp.experts.{e}.up_proj.weight", "mlp.experts.{e}.down_proj.weight")
    expert = lambda suffix: (lambda l, e: f"model.layers.{l}.{suffix.format(e=e)}")
    put("['ffn']['router']['kernel_DE']", Source(layer(router), in_dims=(d,), out_dims=(e_,)))
    put("['ffn']['gate_EDF']", Source(expert(gate), ("expert",), in_dims=(d,), out_dims=(f,)))
    put("['ffn']['up_EDF']", Source(expert(up), ("expert",), in_dims=(d,), out_dims=(f,)))
    put("['ffn']['down_EFD']", Source(expert(down), ("expert",), in_dims=(f,), out_dims=(d,)))
    if config.moe.num_shared_experts:  # DeepSeek: one SwiGLU of n_shared_experts x the experts' width
      w = config.moe.num_shared_experts * f
      put("['ffn']['shared']['gate_DF']", Source(layer("mlp.shared_experts.gate_proj.weight"), in_dims=(d,),
                                                  out_dims=(w,)))
      put("['ffn']['shared']['up_DF']", Source(layer("mlp.shared_experts.up_proj.weight"), in_dims=(d,),
                                                out_dims=(w,)))
      put("['ffn']['shared']['down_FD']", Source(layer("mlp.shared_experts.down_proj.weight"), in_dims=(w,),
                                                  out_dims=(d,)))
    if config.moe.expert_bias:  # DeepSeek's selection bias: a variable, not a parameter
      put("['ffn']['router']['bias_E']", Source(layer("mlp.gate.e_score_correction_bias")))
  return out


def _latent_attention_sources(config: ModelConfig, layer: Callable) -> dict[str, Source]:
  """DeepSeek's MLA tensors (models/mla.py's parameters)."""
  d, n = config.embed_dim, config.num_heads
  nope, rope, value = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
  latent, rank = config.kv_lora_rank, config.q_lora_rank
  out = {
      "['attn']['kv_down_DC']": Source(layer("self_attn.kv_a_proj_with_mqa.weight"), in_dims=(d,),
                                       out_dims=(latent + rope,)),
      "['attn']['kv_norm']['scale']": Source(layer("self_attn.kv_a_layernorm.weight")),
      "['attn']['kv_up_CNH']": Source(layer("self_attn.kv_b_proj.weight"), in_dims=(latent,),
                                      out_dims=(n, nope + value)),
      "['attn']['out_NHD']": Source(layer("self_attn.o_proj.weight"), in_dims=(n, value), out_dims=(d,)),
  }
  if rank:
    out["['attn']['query_down_DR']"] = Source(layer("self_attn.q_a_proj.weight"), in_dims=(d,), out_dims=(rank,))
    out["['attn']['query_norm']['scale']"] = Source(layer("self_attn.q_a_layernorm.weight"))
    out["['attn']['query_up_RNH']"] = Source(layer("self_attn.q_b_proj.weight"), in_dims=(rank,),
                                             out_dims=(n, nope + rope))
  else:
    out["['attn']['query_DNH']"] = Source(layer("self_attn.q_proj.weight"), in_dims=(d,), out_dims=(n, nope + rope))
  return out


def _bounds(index: slice, size: int) -> tuple[int, int]:
  start, stop, step = index.indices(size)
  if step != 1:
    raise ValueError(f"strided block {index}")
  return start, stop


def _read_block(shards: Shards, name: str, source: Source, trailing: tuple[int, ...],
                index: Sequence[slice]) -> np.ndarray:
  """Block `index` of the trailing dimensions `trailing` of one Hugging Face tensor, in meshmoe's layout."""
  tensor = shards.tensor(name)
  expected = ((math.prod(source.out_dims), math.prod(source.in_dims)) if source.in_dims else trailing)
  if tuple(tensor.get_shape()) != tuple(expected):
    raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.get_shape())}; config.json implies "
                          f"{tuple(expected)}")
  if tensor.dtype not in WEIGHT_DTYPES:
    raise CheckpointError(f"tensor {name!r} has dtype {tensor.dtype.name}; weights are float32, bfloat16, "
                          "float16 or float64, or FP8 with block scales")
  if not source.in_dims:
    return np.asarray(tensor[tuple(slice(*_bounds(i, s)) for i, s in zip(index, trailing))])
  sides = []  # per side of the matrix: (rows to read of it, then the block inside them)
  for dims, side_index in ((source.in_dims, index[:len(source.in_dims)]),
                           (source.out_dims, index[len(source.in_dims):])):
    outer_lo, outer_hi = _bounds(side_index[0], dims[0])
    inner = math.prod(dims[1:])
    inner_index = tuple(slice(*_bounds(i, s)) for i, s in zip(side_index[1:], dims[1:]))
    sides.append((slice(outer_lo * inner, outer_hi * inner), (outer_hi - outer_lo, *dims[1:]), inner_index))
  (in_rows, in_shape, in_inner), (out_rows, out_shape, out_inner) = sides
  block = np.asarray(tensor[out_rows, in_rows])  # [out, in]
  if tensor.dtype in FP8_DTYPES:
    block = _dequantize(shards, name, block, out_rows, in_rows)
  block = block.T  # [in, out]
  block = block.reshape(*in_shape, *out_shape)
  return block[(slice(None), *in_inner, slice(None), *out_inner)]


FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
WEIGHT_DTYPES = (np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
                 *FP8_DTYPES)


def _dequantize(shards: Shards, name: str, block: np.ndarray, rows: slice, columns: slice) -> np.ndarray:
  """An FP8 block times its scales: DeepSeek's checkpoints store each FP8 weight `X` with `X_scale_inv`,
  one float32 per `shards.fp8_block` (128 x 128) tile; the weight is their product."""
  scales = shards.tensor(name + "_scale_inv") if name + "_scale_inv" in shards.weight_map else None
  if scales is None:
    raise CheckpointError(f"tensor {name!r} is FP8 but the checkpoint has no {name + '_scale_inv'!r} (its scales)")
  tile_rows, tile_columns = shards.fp8_block
  grid = scales[:, :].astype(np.float32)
  total_rows, total_columns = shards.tensor(name).get_shape()
  expected = (-(-total_rows // tile_rows), -(-total_columns // tile_columns))
  if grid.shape != expected:
    raise CheckpointError(f"tensor {name + '_scale_inv'!r} has shape {grid.shape}; {name!r} in "
                          f"{tile_rows} x {tile_columns} tiles needs {expected}")
  row_tile = np.arange(rows.start, rows.stop) // tile_rows
  column_tile = np.arange(columns.start, columns.stop) // tile_columns
  return block.astype(np.float32) * grid[row_tile][:, column_tile]


@functools.cache
def _broadcast(shape: tuple[int, ...], dtype: np.dtype):
  """jit(zero) -> zeros of `shape` on the zero's device."""
  return jax.jit(lambda zero: jnp.broadcast_to(zero.astype(dtype), shape))


@functools.partial(jax.jit, donate_argnums=0)
def _write_part(block: jax.Array, part: jax.Array, at: jax.Array) -> jax.Array:
  """block[at...] = part, in place (the block is donated)."""
  return jax.lax.dynamic_update_slice(block, part[(None,) * at.shape[0]], (*at, *([0] * part.ndim)))


def load(folder: str | pathlib.Path, abstract_params, abstract_others, config: ModelConfig,
         hf: dict | None = None, report: dict | None = None):
  """(parameters, other variables) of the checkpoint at `folder`, placed like `abstract_params` and
  `abstract_others` (trees of nnx Variables holding jax.ShapeDtypeStruct with shardings, as
  training.model_state.abstract_model_state gives them; the others are DeepSeek's selection biases), each
  device's block read on its own (module docstring). `report`, if given, gets "bytes_read": the tensor
  bytes this process read."""
  hf = read_config(folder) if hf is None else hf
  table = sources(hf, config)
  if hf.get("num_nextn_predict_layers") and jax.process_index() == 0:
    print(f"note: {folder}'s multi-token-prediction layer (model.layers.{hf['num_hidden_layers']}.*) is not "
          "loaded: meshmoe trains the next-token model", flush=True)
  shards = Shards(folder)
  shards.fp8_block = tuple((hf.get("quantization_config") or {}).get("weight_block_size", shards.fp8_block))
  expected = set(table)
  seen: set[str] = set()

  def load_variable(path, variable):
    key = jax.tree_util.keystr(path)
    if key not in table:
      raise CheckpointError(f"meshmoe parameter {key} has no Hugging Face tensor (internal: no mapping)")
    seen.add(key)
    source = table[key]
    spec = variable.get_value()
    shape, dtype = tuple(spec.shape), spec.dtype
    lead = len(source.stacked)
    trailing = shape[lead:]

    def tensors(index):
      """The Hugging Face tensors' blocks that make up block `index` of this parameter, one at a time."""
      ranges = [range(*_bounds(i, n)) for i, n in zip(index[:lead], shape[:lead])]
      for combo in np.ndindex(*(len(r) for r in ranges)):
        at = {kind: r[c] for kind, r, c in zip(source.stacked, ranges, combo)}
        name = source.name(at["layer"] + source.layer_offset, at.get("expert")) if lead else source.name()
        yield _read_block(shards, name, source, trailing, index[lead:]).astype(dtype)

    def device_block(index, devices):
      """Block `index` on each of `devices` (those holding the same block): each Hugging Face tensor's
      part is read once and written into the block on every device (in place: the block is donated)
      before the next is read. Host memory holds one tensor's part at a time, each device its block and
      one part."""
      index = tuple(index) + (slice(None),) * (len(shape) - len(index))
      if not lead:
        block = next(tensors(index))
        return [jax.device_put(block, d) for d in devices]
      block_shape = tuple(len(range(*_bounds(i, n))) for i, n in zip(index, shape))
      blocks = [jax.device_put(np.zeros((), dtype), d) for d in devices]
      blocks = [_broadcast(block_shape, np.dtype(dtype))(b) for b in blocks]
      for position, part in enumerate(tensors(index)):
        at = np.asarray(np.unravel_index(position, block_shape[:lead]), np.int32)
        blocks = [_write_part(b, jax.device_put(part, d), at) for b, d in zip(blocks, devices)]
      return blocks

    by_index: dict[tuple, list] = {}
    for device, index in spec.sharding.addressable_devices_indices_map(shape).items():
      by_index.setdefault(tuple((i.start, i.stop) for i in index), []).append((device, index))
    arrays = {}
    for placements in by_index.values():
      devices = [device for device, _ in placements]
      blocks = device_block(placements[0][1], devices)
      arrays.update(zip(devices, blocks))
    array = jax.make_array_from_single_device_arrays(
        shape, spec.sharding, [arrays[d] for d in spec.sharding.addressable_devices_indices_map(shape)])
    return variable.replace(array)

  is_variable = lambda x: isinstance(x, nnx.Variable)
  try:
    params = jax.tree_util.tree_map_with_path(load_variable, abstract_params, is_leaf=is_variable)
    others = jax.tree_util.tree_map_with_path(load_variable, abstract_others, is_leaf=is_variable)
  finally:
    shards.close()
    if report is not None:
      report["bytes_read"] = shards.bytes_read
  if expected - seen:
    raise CheckpointError(f"the model has no parameters for {sorted(expected - seen)} (internal: mapping)")
  return params, others
