"""Compile the training step for a GPU cluster without GPUs and report memory, FLOPs and communication.

  python -m experiments.aot --config=experiments/configs/mixtral_8x7b.py --target=h100 --devices=64 --hosts=8 \
      --out=mixtral.json [--config.mesh.preset=megascale --config.parallel.impl=xla ...]
  python -m experiments.aot --target=cpu --devices=8 --out=tiny.json      # the local (simulated) devices

--target is a GPU kind, h100 (the default), h200, a100 or b200 (meshmoe.analysis.gpus; XLA's spec of each
in src/analysis/gpu_specs/), or cpu. Prints the cost model's figures beside the compiled program's (matmul
FLOPs, peak memory, bytes per collective kind and how much of it overlaps compute) and whether the step fits
in device memory; writes the JSON report (meshmoe.analysis.aot) to --out. Needs the `deviceless` extra for GPU
targets (the CUDA PJRT plugin; no GPU or CUDA libraries). With capped MoE receive buffers
(--config.parallel.moe_buffer_factor) it compiles the dropless fallback step too, which must fit as well.
Exit status 0 when the step fits, 3 when it does not.
--kernel_resources adds each Mosaic GPU kernel's registers and spills as ptxas reports them (compiled;
meshmoe.analysis.kernel_resources).
"""

import contextlib
import json
import os
import sys
import tempfile

from absl import app, flags

from experiments import cli
from meshmoe.analysis import gpus  # plain data: importing it starts no JAX (JAX_PLATFORMS is set in main)

_TARGET = flags.DEFINE_enum("target", "h100", [*gpus.GPUS, "cpu"], "what to compile for: a GPU kind or cpu")
_DEVICES = flags.DEFINE_integer("devices", 8, "number of devices (GPUs, or simulated CPU devices)", lower_bound=1)
_HOSTS = flags.DEFINE_integer("hosts", 1, "hosts the GPUs are spread over (devices per host = devices / hosts)",
                              lower_bound=1)
_OUT = flags.DEFINE_string("out", None, "where to write the JSON report (default: print only)")
_HLO = flags.DEFINE_string("hlo", None, "where to write the compiled, scheduled HLO text (optional)")
_KERNEL_RESOURCES = flags.DEFINE_bool(
    "kernel_resources", False, "GPU targets: also report each Mosaic GPU kernel's registers and spilled bytes "
    "from ptxas (its dumps go to a temporary folder, removed after; jaxlib says on stderr, once per kernel, that "
    "it found no nvdisasm, which only its disassembly needs)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if _DEVICES.value % _HOSTS.value:
    sys.exit(f"error: --devices={_DEVICES.value} does not split evenly over --hosts={_HOSTS.value}")
  if _KERNEL_RESOURCES.value and _TARGET.value == "cpu":
    sys.exit("error: --kernel_resources reads ptxas' reports on Mosaic GPU kernels: it needs a GPU --target "
             f"({', '.join(gpus.GPUS)}), not cpu")
  out, hlo = cli.writable_output(_OUT.value, "out"), cli.writable_output(_HLO.value, "hlo")
  # Before JAX is imported (the platform) and starts its backend (the device count, the XLA flags).
  os.environ["JAX_PLATFORMS"] = "cpu"  # GPU targets compile on this machine's CPU, without a GPU
  from meshmoe.analysis import deviceless

  extra = ((f"--xla_force_host_platform_device_count={_DEVICES.value}",) if _TARGET.value == "cpu"
           else deviceless.COMPILE_FLAGS)
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *extra]).strip()
  config = flags.FLAGS.config
  from meshmoe.config import ConfigError
  from meshmoe.runtime import xla_flags

  from meshmoe.analysis import kernel_resources

  with contextlib.ExitStack() as scope:  # the kernels' dumps (hundreds of MB) are removed however it ends
    dumps = scope.enter_context(tempfile.TemporaryDirectory(prefix="meshmoe_kernels_")) if _KERNEL_RESOURCES.value \
        else None
    try:
      config.validate(_DEVICES.value)
      xla_flags.apply(config.parallel.xla_flags)
      from meshmoe.analysis import aot

      if dumps:
        kernel_resources.dump_to(dumps)
      report = aot.analyze(config, _TARGET.value, _DEVICES.value, _HOSTS.value)
    except (ConfigError, RuntimeError, ValueError) as e:
      sys.exit(f"error: {e}")
    if dumps:
      try:  # a log this cannot read costs its table, not the report
        report.data["mosaic_kernels"] = kernel_resources.read(dumps)
      except (OSError, ValueError) as e:
        print(f"warning: no kernel registers and spills: {e}", file=sys.stderr)
  print(report.table())
  if "mosaic_kernels" in report.data:
    print("\n".join(kernel_resources.format_lines(report.data["mosaic_kernels"])))
  try:
    if out:
      out.write_text(json.dumps(report.data, indent=1) + "\n")
      print(f"report: {out}")
    if hlo:
      hlo.write_text(report.hlo_text)
      print(f"compiled HLO: {hlo}")
  except OSError as e:
    sys.exit(f"error: writing {e.filename}: {e.strerror}")
  fallback = report.data["dropless_fallback"]
  fits = [report.data["memory"]["fits"], *([fallback["memory"]["fits"]] if fallback else [])]
  sys.exit(3 if False in fits else 0)


if __name__ == "__main__":
  cli.define_config_flag(sys.argv[1:])
  app.run(main)
