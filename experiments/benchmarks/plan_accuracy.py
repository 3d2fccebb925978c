"""How well the planner predicts: its modelled memory, FLOPs and collective bytes against the compiled
program's, for layouts it ranks, compiled deviceless for H100 clusters (no GPU).

  python -m experiments.benchmarks.plan_accuracy --out=/tmp/plan_accuracy.jsonl \
      [--models=tiny_moe:8,moe_1b:8,mixtral_8x7b:64,qwen3_30b_a3b:64 --per_model=3]

For each model:GPUs it plans, then compiles the best `per_model` layouts and prints one row each (and a
JSON line to --out): predicted and compiled peak memory per device and their ratio, whether the compiled
step fits, and compiled beside modelled matmul FLOPs outside kernels and collective bytes. Compiles take
1 to 4 minutes each on 2 cores. The table goes to experiments/benchmarks/RESULTS.md.
"""

import json
import os
import sys

from absl import app, flags

_MODELS = flags.DEFINE_list("models", ["tiny_moe:8", "moe_1b:8", "mixtral_8x7b:64", "qwen3_30b_a3b:64"],
                            "config name (experiments/configs) : GPUs")
_PER_MODEL = flags.DEFINE_integer("per_model", 3, "layouts compiled per model: the best ones", lower_bound=1)
_GPU = flags.DEFINE_string("gpu", "h100", "GPU kind")
_OUT = flags.DEFINE_string("out", None, "JSON lines output")


def main(argv):
  del argv
  os.environ["JAX_PLATFORMS"] = "cpu"
  from meshmoe.analysis import deviceless

  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *deviceless.COMPILE_FLAGS]).strip()
  import importlib

  from meshmoe.analysis import gpus, planner
  from meshmoe.runtime import xla_flags

  gpu = gpus.gpu(_GPU.value)
  out = open(_OUT.value, "a") if _OUT.value else None
  print("| model | GPUs | layout (d.e.t.s preset storage tier µb remat) | memory predicted | compiled | "
        "compiled/predicted | fits | matmul TF compiled/modelled | collective GB compiled/modelled |")
  print("|---|---|---|---|---|---|---|---|---|")
  for entry in _MODELS.value:
    name, num_gpus = entry.split(":")
    config = importlib.import_module(f"experiments.configs.{name}").get_config()
    xla_flags.apply(config.parallel.xla_flags)
    found = planner.search(config, int(num_gpus), gpu)
    for candidate in found.ranked[:_PER_MODEL.value]:
      report = planner.verify(config, candidate, found)
      peak = report["memory"]["peak_bytes_per_device"]
      flops = report["flops"]
      kinds = report["collective_bytes_by_kind"].values()
      compiled_bytes, modelled_bytes = sum(k["compiled"] for k in kinds), sum(k["cost_model"] for k in kinds)
      row = {"model": name, "gpus": int(num_gpus), "layout": candidate.layout.describe().split(),
             "overrides": candidate.layout.overrides(), "memory_predicted": candidate.memory_bytes,
             "memory_compiled": peak, "fits_compiled": report["memory"]["fits"],
             "flops_compiled": flops["compiled"], "flops_modelled_outside_kernels": flops["cost_model_outside_kernels"],
             "collective_bytes_compiled": compiled_bytes, "collective_bytes_modelled": modelled_bytes,
             "predicted_step_s": candidate.time.step_s, "compile_seconds": report["compile_seconds"]}
      if out:
        out.write(json.dumps(row) + "\n")
        out.flush()
      ratio = lambda a, b: f"{a / b:.3f}" if b else "-"
      print(f"| {name} | {num_gpus} | {' '.join(row['layout'])} | {candidate.memory_bytes / 1e9:.2f} GB | "
            f"{peak / 1e9:.2f} GB | {peak / candidate.memory_bytes:.3f} | {row['fits_compiled']} | "
            f"{ratio(flops['compiled'], flops['cost_model_outside_kernels'])} | "
            f"{ratio(compiled_bytes, modelled_bytes)} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(app.run(main))
