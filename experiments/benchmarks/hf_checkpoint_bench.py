"""Import and export of Hugging Face checkpoints: time and peak host memory against the checkpoint's size.

  .venv/bin/python -m experiments.benchmarks.hf_checkpoint_bench [--layers=2,8,32] [--folder=/tmp/hf_bench]

Writes synthetic Mixtral-layout checkpoints (bfloat16; d_model 1024, 8 experts of width 3584, 16 query /
8 key-value heads of 128, vocabulary 32000) at each depth, then for each one, in a fresh process on 8
simulated CPU devices (`ep` preset, expert=8): loads it (models/hf_checkpoint.py) and exports it
(models/hf_export.py, bfloat16). Prints, per size: seconds and GB/s of checkpoint bytes for each, the
process's peak resident memory, the bytes of the loaded parameters on all the devices together, and the
peak of the host buffers the loader and the exporter allocate (numpy arrays, traced by `tracemalloc`;
XLA's device buffers are not traced). On a CPU the "devices" are host memory, so the parameters (float32:
twice the checkpoint; the replicated ones once per device) are resident; what must not grow with the
checkpoint is the host buffers, and peak RSS minus the parameters.
"""

import json
import os
import pathlib
import resource
import subprocess
import sys
import time
import tracemalloc

import ml_dtypes
import numpy as np

SHAPE = dict(hidden_size=1024, intermediate_size=3584, num_local_experts=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=32000)


def write_checkpoint(folder: pathlib.Path, layers: int) -> int:
  """A Mixtral folder of random bfloat16 tensors, one shard per layer (written one tensor at a time)."""
  from safetensors.numpy import save_file
  folder.mkdir(parents=True, exist_ok=True)
  d, f, e = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_local_experts"]
  n, g, h, v = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"], SHAPE["head_dim"], SHAPE["vocab_size"]
  rng = np.random.default_rng(0)
  rand = lambda *shape: (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
  weight_map, total = {}, 0

  def shard(name: str, tensors: dict) -> None:
    nonlocal total
    save_file(tensors, folder / name)
    weight_map.update({key: name for key in tensors})
    total += sum(t.nbytes for t in tensors.values())

  shard("embed.safetensors", {"model.embed_tokens.weight": rand(v, d), "model.norm.weight": rand(d),
                              "lm_head.weight": rand(v, d)})
  for layer in range(layers):
    p = f"model.layers.{layer}."
    tensors = {p + "input_layernorm.weight": rand(d), p + "post_attention_layernorm.weight": rand(d),
               p + "self_attn.q_proj.weight": rand(n * h, d), p + "self_attn.k_proj.weight": rand(g * h, d),
               p + "self_attn.v_proj.weight": rand(g * h, d), p + "self_attn.o_proj.weight": rand(d, n * h),
               p + "block_sparse_moe.gate.weight": rand(e, d)}
    for expert in range(e):
      q = f"{p}block_sparse_moe.experts.{expert}."
      tensors.update({q + "w1.weight": rand(f, d), q + "w3.weight": rand(f, d), q + "w2.weight": rand(d, f)})
    shard(f"layer-{layer:03d}.safetensors", tensors)
  (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  config = {"architectures": ["MixtralForCausalLM"], "num_hidden_layers": layers, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "max_position_embeddings": 4096, "num_experts_per_tok": 2,
            "tie_word_embeddings": False, "hidden_act": "silu", "sliding_window": None, **SHAPE}
  (folder / "config.json").write_text(json.dumps(config))
  return total


def measure(folder: str, out: str) -> None:
  """In this (fresh) process: load, then export; print one JSON line."""
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  import jax
  from flax import nnx

  from meshmoe.config import Config, MeshConfig, TrainConfig
  from meshmoe.models import hf_checkpoint, hf_export
  from meshmoe.sharding.mesh import make_mesh
  from meshmoe.sharding.plan import ParallelPlan
  from meshmoe.training import model_state

  hf = hf_checkpoint.read_config(folder)
  config = Config(model=hf_checkpoint.model_config(hf), mesh=MeshConfig(data=1, expert=8, preset="ep"),
                  train=TrainConfig(global_batch_size=8, seq_len=128))
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  _, abstract, abstract_others = model_state.abstract_model_state(config, plan)
  tracemalloc.start()
  start = time.perf_counter()
  params, _ = jax.block_until_ready(hf_checkpoint.load(folder, abstract, abstract_others, config.model, hf))
  load_s = time.perf_counter() - start
  load_staging = tracemalloc.get_traced_memory()[1]
  tracemalloc.reset_peak()
  rss_after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  # Bytes on all the devices together: a replicated parameter (the embeddings under `ep`) is one copy per
  # device, all of them in this host's memory here.
  param_bytes = sum(shard.data.nbytes for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
                    for shard in v.get_value().addressable_shards)
  start = time.perf_counter()
  hf_export.save(params, config.model, out, dtype="bfloat16", max_shard_bytes=1 << 30)
  export_s = time.perf_counter() - start
  export_staging = tracemalloc.get_traced_memory()[1]
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(json.dumps({"load_s": load_s, "export_s": export_s, "peak_rss": peak, "rss_after_load": rss_after_load,
                    "param_bytes": param_bytes, "load_staging": load_staging,
                    "export_staging": export_staging}))


def main() -> None:
  args = dict(a.lstrip("-").split("=", 1) for a in sys.argv[1:])
  if "measure" in args:
    measure(args["measure"], args["out"])
    return
  base = pathlib.Path(args.get("folder", "/tmp/hf_bench"))
  print(f"{'layers':>6} {'GB':>6} {'load s':>7} {'GB/s':>6} {'export s':>8} {'GB/s':>6} {'peak RSS GB':>11} "
        f"{'params GB':>9} {'RSS - params GB':>15} {'host buffers GB: load':>21} {'export':>6}")
  for layers in (int(x) for x in args.get("layers", "2,8,32").split(",")):
    folder = base / f"mixtral_{layers}"
    out = base / f"export_{layers}"
    subprocess.run(["rm", "-rf", str(folder), str(out)], check=True)
    size = write_checkpoint(folder, layers)
    result = subprocess.run([sys.executable, "-m", "experiments.benchmarks.hf_checkpoint_bench",
                             f"--measure={folder}", f"--out={out}"], capture_output=True, text=True, check=True)
    r = json.loads(result.stdout.strip().splitlines()[-1])
    gb = size / 1e9
    print(f"{layers:>6} {gb:6.2f} {r['load_s']:7.1f} {gb / r['load_s']:6.2f} {r['export_s']:8.1f} "
          f"{gb / r['export_s']:6.2f} {r['peak_rss'] / 1e9:11.2f} {r['param_bytes'] / 1e9:9.2f} "
          f"{(r['peak_rss'] - r['param_bytes']) / 1e9:15.2f} {r['load_staging'] / 1e9:21.3f} "
          f"{r['export_staging'] / 1e9:6.3f}", flush=True)
    subprocess.run(["rm", "-rf", str(folder), str(out)], check=True)


if __name__ == "__main__":
  main()
