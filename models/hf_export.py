"""Hugging Face checkpoints out (Mixtral, Qwen3-MoE, DeepSeek-V3): a folder `transformers` loads, written
tensor by tensor.

`save` writes `model-<i>-of-<n>.safetensors` shards (at most `max_shard_bytes` each, tensors in
Hugging Face's order), `model.safetensors.index.json`, `config.json` (`hf_config`) and the tokenizer,
from parameters placed on any mesh. Each Hugging Face tensor (one layer's, one expert's matrix) is cut
out of its stacked parameter, gathered to the host (`process_allgather`, which every process calls: only
that tensor crosses the processes), transposed to torch's [out, in] layout and cast. Shard i is written
by process i % (process count), so a multi-process job writes in parallel and no host ever holds the
model, only one tensor at a time.

Files are written into `<folder>.partial-<time>` and the folder appears under its name only when every
shard, the index and the config are complete: an export that fails leaves no folder that looks complete
(the partial one says what it is by its name). An existing folder is never overwritten.

The safetensors format is written directly (an 8-byte header length, a JSON header of names, dtypes,
shapes and byte offsets, then the tensors' bytes): the `safetensors` package writes only from a dict of
tensors held in memory together, which would hold a whole shard on the host.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import shutil
import struct
import time

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from meshmoe.config import ModelConfig
from meshmoe.models import hf_checkpoint
from meshmoe.models.hf_checkpoint import CheckpointError, Source

DTYPES = {"float32": (np.float32, "F32"), "bfloat16": (ml_dtypes.bfloat16, "BF16"), "float16": (np.float16, "F16")}


def hf_config(model: ModelConfig, dtype: str) -> dict:
  """The config.json of `model` as a DeepSeek-V3 (MLA), Qwen3-MoE (QK-norm) or Mixtral (neither)
  checkpoint; a model its family does not compute is refused with the reasons."""
  moe = model.moe
  family = "DeepSeek-V3" if model.attention == "mla" else "Qwen3-MoE" if model.qk_norm else "Mixtral"
  problems = []
  if family != "DeepSeek-V3":
    if moe.score_fn != "softmax" or moe.expert_bias or moe.routed_scaling != 1.0 or moe.num_groups > 1:
      problems.append("routing must be softmax, without expert_bias, routed_scaling or groups")
    if moe.num_shared_experts:
      problems.append(f"num_shared_experts={moe.num_shared_experts} (the family has no shared experts)")
    if model.rope_interleave:
      problems.append("rope_interleave=True (the family rotates halves)")
  elif not moe.expert_bias:
    problems.append("expert_bias=False (DeepSeek-V3's routing has a selection bias, e_score_correction_bias)")
  if family == "Mixtral" and (model.num_dense_layers or not moe.normalize_top_k):
    problems.append("Mixtral has no dense layers and always renormalises its top-k weights (a model without "
                    "qk_norm or MLA exports as Mixtral)")
  if problems:
    raise CheckpointError(f"this model does not export as {family}: " + "; ".join(problems))
  config = {
      "hidden_size": model.embed_dim, "num_hidden_layers": model.num_layers,
      "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
      "head_dim": model.head_dim, "vocab_size": model.vocab_size, "rms_norm_eps": model.norm_eps,
      "rope_theta": model.rope_theta, "max_position_embeddings": model.max_seq_len,
      "tie_word_embeddings": model.tie_embeddings, "hidden_act": "silu", "num_experts_per_tok": moe.top_k,
      "attention_bias": False, "torch_dtype": dtype, "dtype": dtype}
  if model.yarn_factor > 1:
    config["rope_scaling"] = {
        "type": "yarn", "rope_type": "yarn", "factor": model.yarn_factor,
        "original_max_position_embeddings": model.yarn_original_max_len, "beta_fast": model.yarn_beta_fast,
        "beta_slow": model.yarn_beta_slow, "mscale": model.yarn_mscale, "mscale_all_dim": model.yarn_mscale_all_dim}
  if family == "DeepSeek-V3":
    return {**config, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "head_dim": model.qk_rope_head_dim, "q_lora_rank": model.q_lora_rank or None,
            "kv_lora_rank": model.kv_lora_rank, "qk_nope_head_dim": model.qk_nope_head_dim,
            "qk_rope_head_dim": model.qk_rope_head_dim, "v_head_dim": model.v_head_dim,
            "rope_interleave": model.rope_interleave, "n_routed_experts": moe.num_experts,
            "moe_intermediate_size": moe.expert_mlp_dim, "intermediate_size": model.mlp_dim,
            "n_shared_experts": moe.num_shared_experts, "first_k_dense_replace": model.num_dense_layers,
            "n_group": moe.num_groups, "topk_group": moe.top_k_groups, "routed_scaling_factor": moe.routed_scaling,
            "norm_topk_prob": moe.normalize_top_k, "scoring_func": moe.score_fn, "topk_method": "noaux_tc",
            "num_nextn_predict_layers": 0}
  if family == "Qwen3-MoE":
    return {**config, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts": moe.num_experts, "moe_intermediate_size": moe.expert_mlp_dim,
            "intermediate_size": model.mlp_dim, "norm_topk_prob": moe.normalize_top_k,
            "mlp_only_layers": list(range(model.num_dense_layers)), "decoder_sparse_step": 1,
            "use_sliding_window": False, "sliding_window": None}
  return {**config, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
          "num_local_experts": moe.num_experts, "intermediate_size": moe.expert_mlp_dim, "sliding_window": None}


@dataclasses.dataclass(frozen=True)
class _Tensor:
  name: str
  shape: tuple[int, ...]  # torch's layout
  leaf: str  # the meshmoe parameter it is cut from
  at: tuple[int, ...]  # its index in the parameter's stacked dimensions
  source: Source


def _leaves(*trees) -> dict[str, jax.Array]:
  """Each variable's array of the trees (parameters, other variables) by its path."""
  leaves = {}
  for tree in trees:
    for path, variable in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
      leaves[jax.tree_util.keystr(path)] = variable.get_value()
  return leaves


def _tensors(leaves: dict[str, jax.Array], hf: dict, model: ModelConfig) -> list[_Tensor]:
  """Every Hugging Face tensor of the model, in layer order (embeddings first, the output layer last)."""
  table = hf_checkpoint.sources(hf, model)
  shapes = {path: tuple(array.shape) for path, array in leaves.items()}
  found = []
  for leaf, source in table.items():
    shape = shapes[leaf]
    lead = shape[:len(source.stacked)]
    trailing = shape[len(source.stacked):]
    torch_shape = ((math.prod(source.out_dims), math.prod(source.in_dims)) if source.in_dims else trailing)
    for at in np.ndindex(*lead):
      where = dict(zip(source.stacked, at))
      name = (source.name(where["layer"] + source.layer_offset, where.get("expert")) if lead
              else source.name())
      found.append(_Tensor(name, tuple(torch_shape), leaf, tuple(int(i) for i in at), source))
  return sorted(found, key=lambda t: _order(t.name))


def _order(name: str):
  layer = name.split(".")[2] if name.startswith("model.layers.") else None
  parts = tuple(int(p) if p.isdigit() else p for p in name.split("."))
  group = 0 if name.startswith("model.embed") else 2 if layer is None else 1
  return (group, parts)


def _host_tensor(array: jax.Array, tensor: _Tensor, dtype) -> np.ndarray:
  """The tensor, gathered to this host and in torch's layout (every process calls this). It is cut out by
  indexing (which reads only the devices that hold it), then transposed and cast on those devices."""
  source = tensor.source
  block = array[tensor.at] if tensor.at else array
  block = _to_torch_layout(math.prod(source.in_dims) if source.in_dims else 0, np.dtype(dtype))(block)
  return np.ascontiguousarray(np.asarray(multihost_utils.process_allgather(block, tiled=True)))


@functools.cache
def _to_torch_layout(rows_in: int, dtype: np.dtype):
  """jit(block) -> the block as torch lays it out ([out, in] when `rows_in`, the in side's size), cast."""
  return jax.jit(lambda block: (block.reshape(rows_in, -1).T if rows_in else block).astype(dtype))


# Files of a Hugging Face folder besides the weights, config.json and tokenizer.json that its users rely
# on (special tokens, chat template, generation defaults): copied from the folder a run started from.
COMPANION_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


def companions(folder: str | pathlib.Path) -> list[pathlib.Path]:
  """The COMPANION_FILES present in `folder`."""
  return [pathlib.Path(folder) / name for name in COMPANION_FILES if (pathlib.Path(folder) / name).is_file()]


def save(params, model: ModelConfig, folder: str | pathlib.Path, *, others=None, dtype: str = "bfloat16",
         tokenizer: str | pathlib.Path | None = None, base_config: dict | None = None,
         extra_files: tuple[pathlib.Path, ...] | list[pathlib.Path] = (), max_shard_bytes: int = 4 << 30
         ) -> pathlib.Path:
  """Writes the Hugging Face folder of `params` (the model's nnx.Param tree, placed on any mesh; `others`,
  its other variables: DeepSeek's selection biases) at `folder` (module docstring). `base_config`: the
  config.json of the folder the run started from; its other fields (token ids, ...) are kept, those of
  `hf_config` replace theirs. `extra_files` are copied in (`companions`). Every process calls it; returns
  the folder."""
  if dtype not in DTYPES:
    raise CheckpointError(f"export dtype {dtype!r}: one of {', '.join(DTYPES)}")
  folder = pathlib.Path(folder)
  if folder.exists():
    raise CheckpointError(f"{folder} exists: export writes a new folder and never overwrites one")
  np_dtype, tag = DTYPES[dtype]
  config = hf_config(model, dtype)
  if base_config is not None:
    if base_config.get("architectures") != config["architectures"]:
      raise CheckpointError(f"the run started from a {base_config.get('architectures')} folder but its model "
                            f"exports as {config['architectures']}")
    config = {**base_config, **config}
  leaves = _leaves(params, {} if others is None else others)
  tensors = _tensors(leaves, config, model)
  shards = _plan_shards(tensors, np.dtype(np_dtype).itemsize, max_shard_bytes)
  stamp = multihost_utils.broadcast_one_to_all(np.int64(time.time_ns()))
  partial = folder.with_name(f"{folder.name}.partial-{int(stamp)}")
  primary, me, count = jax.process_index() == 0, jax.process_index(), jax.process_count()
  if primary:
    partial.mkdir(parents=True)
  multihost_utils.sync_global_devices("meshmoe: export folder made")
  weight_map = {}
  for i, shard in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    weight_map.update({t.name: name for t in shard})
    writer = _ShardWriter(partial / name, shard, tag, np.dtype(np_dtype).itemsize) if i % count == me else None
    for tensor in shard:
      value = _host_tensor(leaves[tensor.leaf], tensor, np_dtype)  # a collective: every process
      if writer is not None:
        writer.write(value)
    if writer is not None:
      writer.close()
  multihost_utils.sync_global_devices("meshmoe: export shards written")
  if primary:
    total = sum(math.prod(t.shape) for t in tensors) * np.dtype(np_dtype).itemsize
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if tokenizer is not None:
      shutil.copyfile(tokenizer, partial / "tokenizer.json")
    for path in extra_files:
      shutil.copyfile(path, partial / pathlib.Path(path).name)
    os.replace(partial, folder)  # the folder appears complete, or not at all
  multihost_utils.sync_global_devices("meshmoe: export done")
  return folder


def _plan_shards(tensors: list[_Tensor], itemsize: int, max_bytes: int) -> list[list[_Tensor]]:
  shards, size = [[]], 0
  for tensor in tensors:
    nbytes = math.prod(tensor.shape) * itemsize
    if shards[-1] and size + nbytes > max_bytes:
      shards.append([])
      size = 0
    shards[-1].append(tensor)
    size += nbytes
  return shards


class _ShardWriter:
  """One safetensors file, its header first (every shape is known), then each tensor's bytes in order."""

  def __init__(self, path: pathlib.Path, tensors: list[_Tensor], tag: str, itemsize: int):
    header, offset = {}, 0
    for t in tensors:
      nbytes = math.prod(t.shape) * itemsize
      header[t.name] = {"dtype": tag, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors writer does
    self._file = open(path, "wb")
    self._file.write(struct.pack("<Q", len(text)) + text)
    self._expected = [(t.name, t.shape) for t in tensors]

  def write(self, value: np.ndarray) -> None:
    name, shape = self._expected.pop(0)
    if value.shape != shape:
      raise AssertionError(f"{name}: {value.shape} written where the header says {shape}")
    self._file.write(value.tobytes())

  def close(self) -> None:
    if self._expected:
      raise AssertionError(f"shard closed before {self._expected[0][0]}")
    self._file.close()
