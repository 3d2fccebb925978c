"""Plan a model's layout on a GPU cluster without the GPUs: every valid layout ranked by predicted step time.

  python -m experiments.plan --config=experiments/configs/mixtral_8x7b.py --gpus=64 --gpu=h100
  python -m experiments.plan --config=experiments/configs/deepseek_v3.py --gpus=256 --verify=1
      [--gpus_per_node=8 --global_batch=1024 --seq_len=4096 --efficiency=0.5 --allow_compression ...]

Searches mesh sizes, presets, weight storage, tiers, micro-batches and remat (meshmoe.analysis.planner),
rejects what does not fit the memory JAX's allocator holds (train.gpu_memory_fraction of the GPU) less
--memory_margin, predicts the step time of the rest from
the cost model (a roofline at --efficiency of the dense peak, NVLink and network bandwidths from the GPU
spec files, each tier's overlap: meshmoe.analysis.step_time) and prints the ranked table with the
`--config...` overrides of the best, the processes per node it needs (and, where it needs one per node,
the best layout with one process per GPU). Every figure it prints is modelled; `--verify=K` compiles the top K
deviceless (minutes each) and prints the compiled memory, FLOPs and collective bytes beside them.
Where the config's own layout is valid it is ranked too. When nothing fits, it says the smallest GPU count
where something would, and why. Exit status 0 when a layout fits, 3 when none does.
"""

import os
import sys

from absl import app, flags

from experiments import cli

_GPUS = flags.DEFINE_integer("gpus", None, "number of GPUs", lower_bound=1, required=True)
_GPU = flags.DEFINE_string("gpu", "h100", "GPU kind (src/analysis/gpu_specs/hardware.toml)")
_GPUS_PER_NODE = flags.DEFINE_integer("gpus_per_node", None, "GPUs per node (default: the GPU's reference system)",
                                      lower_bound=1)
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch", None, "sequences per step (default: the config's)",
                                     lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", None, "tokens per sequence (default: the config's)", lower_bound=1)
_EFFICIENCY = flags.DEFINE_float("efficiency", 0.5, "fraction of the dense bf16 peak the GEMMs reach (stated, "
                                 "not measured)", lower_bound=0.01, upper_bound=1.0)
_MARGIN = flags.DEFINE_float("memory_margin", 0.05, "fraction of device memory kept free for what the memory "
                             "model leaves out (XLA's temporaries)", lower_bound=0.0, upper_bound=0.9)
_TOP = flags.DEFINE_integer("top", 10, "rows of the ranked table", lower_bound=1)
_VERIFY = flags.DEFINE_integer("verify", 0, "compile the best K layouts deviceless and print compiled beside "
                               "predicted", lower_bound=0)
_COMPRESSION = flags.DEFINE_bool("allow_compression", False, "also consider lossy options: int8 gradient sums "
                                 "and float8 token exchanges")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  # Before JAX starts a backend: deviceless GPU compiles run on this machine's CPU.
  os.environ["JAX_PLATFORMS"] = "cpu"
  from meshmoe.analysis import deviceless

  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *deviceless.COMPILE_FLAGS]).strip()
  from meshmoe.analysis import gpus, planner, plan_report
  from meshmoe.config import ConfigError
  from meshmoe.runtime import xla_flags

  config = flags.FLAGS.config
  if _GLOBAL_BATCH.value:
    config.train.global_batch_size = _GLOBAL_BATCH.value
  if _SEQ_LEN.value:
    config.train.seq_len = _SEQ_LEN.value
    config.model.max_seq_len = max(config.model.max_seq_len, _SEQ_LEN.value)
  try:
    gpu = gpus.gpu(_GPU.value)
    config.validate()
    xla_flags.apply(config.parallel.xla_flags)
    options = dict(efficiency=_EFFICIENCY.value, memory_margin=_MARGIN.value,
                   allow_compression=_COMPRESSION.value)
    found = planner.search(config, _GPUS.value, gpu, _GPUS_PER_NODE.value, **options)
    print(plan_report.header(found, _GPUS_PER_NODE.value or gpu.gpus_per_node, _EFFICIENCY.value))
    if not found.ranked:
      smallest = (planner.smallest_fitting(config, _GPUS.value, gpu, _GPUS_PER_NODE.value, **options)
                  if found.too_big else None)  # none valid at all: more GPUs of the same kind will not help
      print(plan_report.nothing_fits(found, smallest), file=sys.stderr)
      sys.exit(3)
    print(plan_report.ranked_table(found, _TOP.value))
    print(plan_report.own_layout(config, found, _GPUS_PER_NODE.value, _EFFICIENCY.value))
    best = found.ranked[0].layout
    print(f"\nbest: python -m experiments.train --config={flags.FLAGS['config'].config_filename} "
          f"{' '.join(_planned_overrides(sys.argv[1:], config, best.overrides().split()))}")
    per_gpu = planner.best_with_one_process_per_gpu(config, found, _GPUS_PER_NODE.value, _EFFICIENCY.value)
    print(plan_report.process_layout(found, config, per_gpu))
    for rank, candidate in enumerate(found.ranked[:_VERIFY.value], 1):
      report = planner.verify(config, candidate, found, _GPUS_PER_NODE.value)
      print(plan_report.verified(rank, candidate, report))
  except (ConfigError, RuntimeError, ValueError) as e:
    sys.exit(f"error: {e}")


def _planned_overrides(args: list[str], config, layout: list[str]) -> list[str]:
  """The --config overrides that train what was planned: the ones given to the planner (its --config.*
  overrides, and --global_batch / --seq_len as the fields they set), then the layout's, which replace any
  given for the same field."""
  given = [arg for arg in args if arg.startswith("--config.") and "=" in arg]
  if _GLOBAL_BATCH.value:
    given.append(f"--config.train.global_batch_size={config.train.global_batch_size}")
  if _SEQ_LEN.value:
    given += [f"--config.train.seq_len={config.train.seq_len}",
              f"--config.model.max_seq_len={config.model.max_seq_len}"]
  field = lambda override: override.split("=", 1)[0]
  chosen = {field(override) for override in layout}
  kept = {field(override): override for override in given if field(override) not in chosen}  # the last of each
  return [*kept.values(), *layout]


if __name__ == "__main__":
  cli.define_config_flag(sys.argv[1:])
  app.run(main)
