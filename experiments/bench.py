"""Train-step time of a config on the local devices, and the cost model beside the compiled program.

  bash experiments/run.sh bench [--config=tiny_moe] [--devices=8] [--preset=ep] [--data=-1 ...]
      [--attention=ring] [--impl=xla] [--layer_schedule=two_halves] [--steps=10] [--repeats=1]

--config names an experiment in experiments/configs/ (default tiny_moe; maxtext_tiny_moe is MaxText's tiny
MoE shape). With --devices=N on a CPU machine, N devices are simulated (set before JAX starts). Prints the
time of a full training step (forward, backward, optimizer): the mean over --steps timed runs after one
warm-up, --repeats times (min and median of the repeats' means), then meshmoe.analysis.cost_model's figures
next to XLA's analysis of the compiled step: FLOPs per device, bytes moved per collective kind per device,
and memory per device. Each figure is labelled: "measured" (timed here), "compiled" (read from the compiled
program) or "modelled" (the cost model). Ratios compare like with like: compiled FLOPs against the modelled
FLOPs XLA can see, that is, without those inside custom-call kernels (which the compiled program's cost
analysis does not count; they are printed on their own line, modelled).
"""

import importlib
import os
import pathlib
import sys
import time

from absl import app, flags, logging

# Plain data: importing it starts no JAX backend (the device count is set in main).
from meshmoe.config import ATTENTION_KINDS, GRADIENT_COMPRESSIONS, GROUPED_GEMMS, IMPLS, LAYER_SCHEDULES

flags.DEFINE_string("config", "tiny_moe", "experiment config: a file name in experiments/configs/, no .py")
flags.DEFINE_integer("devices", 8, "simulated CPU devices (ignored on accelerators)", lower_bound=1)
flags.DEFINE_integer("steps", 10, "timed steps per repeat", lower_bound=1)
flags.DEFINE_integer("repeats", 1, "timed repeats of --steps steps", lower_bound=1)
flags.DEFINE_string("preset", None, "sharding preset (default: the config's)")
for _axis in ("data", "expert", "tensor", "sequence"):
  flags.DEFINE_integer(_axis, None, f"size of the {_axis} mesh axis")
flags.DEFINE_string("grouped_gemm", None, f"grouped GEMM of the dropless MoE path: {', '.join(GROUPED_GEMMS)}")
flags.DEFINE_string("attention", None, f"context-parallel attention: {', '.join(ATTENTION_KINDS)}")
flags.DEFINE_string("impl", None, f"parallel-op tier: {', '.join(IMPLS)}")
flags.DEFINE_string("layer_schedule", None, f"MoE layers' schedule: {', '.join(LAYER_SCHEDULES)}")
flags.DEFINE_string("gradient_compression", None,
                    f"the routed experts' gradient sum: {', '.join(GRADIENT_COMPRESSIONS)}")
flags.DEFINE_bool("document_mask", False, "attend within synthetic packed documents (data.document_mask)")
FLAGS = flags.FLAGS
CONFIGS = pathlib.Path(__file__).parent / "configs"


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # JAX's INFO lines about absent backends are not results
  if FLAGS.config.startswith("_") or not (CONFIGS / f"{FLAGS.config}.py").is_file():
    available = ", ".join(sorted(p.stem for p in CONFIGS.glob("[!_]*.py")))
    sys.exit(f"error: --config={FLAGS.config!r} is not a file in experiments/configs/; available: {available}")
  if "jax" in sys.modules:
    raise RuntimeError("jax was imported before the device count could be set")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={FLAGS.devices}")
  import jax
  import numpy as np

  from meshmoe.analysis import cost_collectives, cost_model, hlo_collectives
  from meshmoe.config import ConfigError
  from meshmoe.data.pipeline import document_starts
  from meshmoe.sharding.mesh import make_mesh
  from meshmoe.sharding.plan import ParallelPlan
  from meshmoe.training import train_step

  config = importlib.import_module(f"experiments.configs.{FLAGS.config}").get_config()
  if FLAGS.preset:
    config.mesh.preset = FLAGS.preset
  if FLAGS.grouped_gemm:
    config.parallel.grouped_gemm = FLAGS.grouped_gemm
  if FLAGS.attention:
    config.parallel.attention = FLAGS.attention
  if FLAGS.impl:
    config.parallel.impl = FLAGS.impl
  if FLAGS.layer_schedule:
    config.parallel.layer_schedule = FLAGS.layer_schedule
  if FLAGS.gradient_compression:
    config.parallel.gradient_compression = FLAGS.gradient_compression
  config.data.document_mask = config.data.document_mask or FLAGS.document_mask
  for axis in ("data", "expert", "tensor", "sequence"):
    if getattr(FLAGS, axis) is not None:
      setattr(config.mesh, axis, getattr(FLAGS, axis))
  n = jax.device_count()
  try:
    config.validate(n)
    plan = ParallelPlan.build(config, make_mesh(config.mesh))
  except ConfigError as e:
    sys.exit(f"error: {e}")
  print(plan.table())
  trainer, state = train_step.create(config, plan)
  b, s = config.train.global_batch_size, config.train.seq_len
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (b, s + 1), dtype=np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((b, s), np.float32)}
  if config.data.document_mask:  # token 0 ends the synthetic documents
    batch["document_starts"] = document_starts(batch["inputs"], 0)
  batch = train_step.place_batch(batch, config, plan)
  compiled = trainer.train_step.lower(state, batch).compile()
  state, _ = compiled(state, batch)
  jax.block_until_ready(state)
  times, cpu_times = [], []  # wall clock; this process's CPU time (steadier where other jobs share the cores)
  for _ in range(FLAGS.repeats):
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(FLAGS.steps):
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append((time.perf_counter() - start) / FLAGS.steps)
    cpu_times.append((time.process_time() - cpu_start) / FLAGS.steps)
  step_time = float(np.median(times))

  cost = cost_model.step_cost(config, plan)
  compiled_flops = compiled.cost_analysis()["flops"]
  executed = cost.executed_flops_per_device.total
  in_kernels = sum(cost_model.flops_in_kernels(config, plan).values())
  print(f"config {FLAGS.config}  mesh {dict(plan.mesh.shape)}  preset {plan.preset}  attention "
        f"{plan.ops['attention'].implementation}  gemm {plan.grouped_gemm}  {n} {plan.hardware.platform} devices")
  print(f"train step time (measured)     {step_time * 1e3:9.1f} ms  ({b * s / step_time:,.0f} tokens/s)"
        + (f"  median of {FLAGS.repeats} repeats; min {min(times) * 1e3:.1f} ms; each "
           + " ".join(f"{t * 1e3:.1f}" for t in times) if FLAGS.repeats > 1 else ""))
  print(f"CPU time per step (measured)   {np.median(cpu_times) * 1e3:9.1f} ms  (this process, all threads; "
        f"min {min(cpu_times) * 1e3:.1f} ms)")
  print(f"FLOPs/device: compiled, XLA's  {compiled_flops / 1e9:9.3f} GFLOP  (custom-call kernels not counted)")
  print(f"              modelled, XLA's  {(executed - in_kernels) / 1e9:9.3f} GFLOP  "
        f"(compiled/modelled {compiled_flops / (executed - in_kernels):.3f})")
  print(f"              modelled, kernels{in_kernels / 1e9:9.3f} GFLOP  (inside custom calls; not in compiled)")
  print(f"              modelled, useful {cost.model_flops / n / 1e9:9.3f} GFLOP  "
        f"(modelled executed/useful {executed * n / cost.model_flops:.3f})")
  found = hlo_collectives.bytes_by_kind(hlo_collectives.collectives(compiled.as_text(), n))
  modelled = cost_collectives.bytes_by_kind(cost.collectives)
  print("collective bytes/device/step:  kind                 modelled         compiled HLO")
  for kind in sorted(set(found) | set(modelled)):
    print(f"                               {kind:18s} {modelled.get(kind, 0) / 1e6:10.3f} MB  "
          f"{found.get(kind, 0) / 1e6:10.3f} MB")
  memory = compiled.memory_analysis()
  peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
          + memory.temp_size_in_bytes)
  print(f"memory/device: modelled {cost.memory.total / 1e6:.1f} MB (params {cost.memory.params / 1e6:.1f}, "
        f"grads {cost.memory.gradients / 1e6:.1f}, optimizer {cost.memory.optimizer / 1e6:.1f}, "
        f"activations {cost.memory.activations / 1e6:.1f});  compiled {peak / 1e6:.1f} MB")


if __name__ == "__main__":
  app.run(main)
