"""The AOT comparison table: every preset x parallel-op tier of some configs, compiled deviceless for GPUs.

  python -m experiments.aot_table --configs=tiny_moe,moe_1b --devices=8 [--impls=reference,xla] [--out=rows.json]

For each config, preset (on the mesh layout of LAYOUTS) and tier, compiles the real train step for
`--devices` H100s without a GPU (meshmoe.analysis.aot) and prints one markdown row. Compiled figures (read
from XLA's program) and modelled ones (the cost model's) sit in separate columns and are never added:
overlap_fraction (compiled), the compiled matmul FLOPs over the cost model's FLOPs outside custom-call
kernels, the kernels' FLOPs (modelled from the tiles they compute under balanced routing, worst case in
parentheses), expert-kernel FLOPs over the useful expert FLOPs (modelled), collective bytes compiled / cost
model, the fused kernels' bytes (modelled: they show no HLO collective), peak memory compiled / modelled.
The rows go into experiments/benchmarks/RESULTS.md. With --out, the JSON is rewritten after every row, so
a sweep that is stopped (each full-size row compiles for minutes) keeps the rows it has.
"""

import json
import os
import sys

from absl import app, flags

from experiments import cli
from meshmoe.config import IMPLS  # plain data: importing it starts no JAX backend

_CONFIGS = flags.DEFINE_list("configs", ["tiny_moe", "moe_1b"], "experiment configs (experiments/configs/<name>.py)")
_IMPLS = flags.DEFINE_list("impls", list(IMPLS), "parallel-op tiers to compile")
_PRESETS = flags.DEFINE_list("presets", None, "presets to compile (default: all of LAYOUTS)")
_DEVICES = flags.DEFINE_integer("devices", 8, "GPUs to compile for")
_OUT = flags.DEFINE_string("out", None, "also write the rows as JSON here (rewritten after every row)")

# (data, expert, tensor, sequence) per preset for 8 devices: each preset on a layout that exercises it.
LAYOUTS = {
    "dp": (8, 1, 1, 1), "fsdp": (8, 1, 1, 1), "zero1": (8, 1, 1, 1), "ep": (2, 4, 1, 1),
    "tp_sp": (2, 2, 2, 1), "megascale": (2, 2, 1, 2),
}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if _DEVICES.value != 8:
    sys.exit("error: LAYOUTS are written for --devices=8")
  _check_choices()
  out = cli.writable_output(_OUT.value, "out")
  os.environ["JAX_PLATFORMS"] = "cpu"
  from meshmoe.analysis import deviceless
  from meshmoe.runtime import xla_flags

  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *deviceless.COMPILE_FLAGS]).strip()
  xla_flags.apply("overlap")  # the default preset; every row compiles under the same flags
  import importlib

  from meshmoe.analysis import aot
  from meshmoe.config import MeshConfig

  rows = []
  print(HEADER)
  for name in _CONFIGS.value:
    module = importlib.import_module(f"experiments.configs.{name}")
    for preset, sizes in LAYOUTS.items():
      if _PRESETS.value and preset not in _PRESETS.value:
        continue
      for impl in _IMPLS.value:
        config = module.get_config()
        data, expert, tensor, sequence = sizes
        config.mesh = MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset)
        config.parallel.impl = impl
        config.parallel.xla_flags = "overlap"
        report = aot.analyze(config, "h100", _DEVICES.value).data
        row = _row(name, preset, sizes, impl, report)
        rows.append(row)
        print(_markdown(row), flush=True)
        if out:
          try:
            out.write_text(json.dumps(rows, indent=1) + "\n")
          except OSError as e:
            sys.exit(f"error: writing {out}: {e.strerror}; the rows so far are printed above")


def _check_choices() -> None:
  """One line naming the bad value and the allowed ones, before anything compiles."""
  available = [p.stem for p in cli.experiment_configs()]
  for flag, values, allowed in (("configs", _CONFIGS.value, available), ("impls", _IMPLS.value, IMPLS),
                                ("presets", _PRESETS.value or [], list(LAYOUTS))):
    unknown = [v for v in values if v not in allowed]
    if unknown:
      sys.exit(f"error: --{flag} has unknown {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")


HEADER = ("| config | mesh (d,e,t,s) / preset | impl | overlap (compiled) | XLA FLOPs compiled / modelled | "
          "kernel TF modelled (worst) | expert kernels / useful (modelled) | collective MB compiled / modelled | "
          "fused-kernel MB modelled | peak GB compiled / modelled | compile s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def _row(name, preset, sizes, impl, report) -> dict:
  by_kind, flops = report["collective_bytes_by_kind"], report["flops"]
  return {
      "config": name, "preset": preset, "mesh": sizes, "impl": impl,
      "overlap_fraction": report["overlap_fraction"],
      "compiled_over_cost_model": flops["compiled_over_cost_model"],
      "kernel_flops_modelled": sum(flops["kernels_modelled"].values()),
      "kernel_flops_modelled_worst_case": sum(flops["kernels_modelled_worst_case"].values()),
      "expert_kernels_over_useful": flops["expert_kernels_over_useful"],
      "fused_kernel_bytes_modelled": sum(report["fused_kernels"]["bytes_by_kind_modelled"].values()),
      "collective_bytes_compiled": sum(r["compiled"] for r in by_kind.values()),
      "collective_bytes_cost_model": sum(r["cost_model"] for r in by_kind.values()),
      "by_kind": by_kind,
      "peak_bytes": report["memory"]["peak_bytes_per_device"],
      "peak_bytes_cost_model": report["memory"]["cost_model"]["total"],
      "fits": report["memory"]["fits"],
      "compile_seconds": report["compile_seconds"],
  }


def _markdown(row: dict) -> str:
  mesh = ",".join(str(s) for s in row["mesh"])
  compiled, modelled = row["collective_bytes_compiled"], row["collective_bytes_cost_model"]
  ratio = f" ({compiled / modelled:.3f})" if modelled else ""
  kernels = (f"{row['kernel_flops_modelled'] / 1e12:.2f} ({row['kernel_flops_modelled_worst_case'] / 1e12:.2f})"
             if row["kernel_flops_modelled"] else "-")
  experts = f"{row['expert_kernels_over_useful']:.3f}" if row["expert_kernels_over_useful"] else "-"
  fused = f"{row['fused_kernel_bytes_modelled'] / 1e6:.2f}" if row["fused_kernel_bytes_modelled"] else "-"
  return (f"| {row['config']} | {mesh} {row['preset']} | {row['impl']} | {row['overlap_fraction']:.3f} | "
          f"{row['compiled_over_cost_model']:.3f} | {kernels} | {experts} | "
          f"{compiled / 1e6:.2f} / {modelled / 1e6:.2f}{ratio} | {fused} | "
          f"{row['peak_bytes'] / 1e9:.2f} / {row['peak_bytes_cost_model'] / 1e9:.2f} | {row['compile_seconds']:.0f} |")


if __name__ == "__main__":
  app.run(main)
