"""Forward+backward step time and compiled/model FLOP ratio of a config on the local devices.

  bash experiments/run.sh bench [--devices=8] [--preset=ep] [--data=-1 ...] [--steps=10]

With --devices=N on a CPU machine, N devices are simulated (set before JAX starts). Prints the mean step
time over --steps timed runs after one warm-up, XLA's cost analysis of the compiled program (FLOPs per
device) and the useful model FLOPs per device from meshmoe.cost_model; their ratio is close to 1 when the
program does no redundant work.
"""

import os
import sys
import time

from absl import app, flags

flags.DEFINE_integer("devices", 8, "simulated CPU devices (ignored on accelerators)")
flags.DEFINE_integer("steps", 10, "timed steps")
flags.DEFINE_string("preset", None, "sharding preset (default: the config's)")
for _axis in ("data", "expert", "tensor", "sequence"):
  flags.DEFINE_integer(_axis, None, f"size of the {_axis} mesh axis")
flags.DEFINE_string("gemm_impl", None, "grouped GEMM of the dropless MoE path: auto, blocked, ragged_dot")
FLAGS = flags.FLAGS


def main(argv):
  del argv
  if "jax" in sys.modules:
    raise RuntimeError("jax was imported before the device count could be set")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={FLAGS.devices}")
  import jax
  from flax import nnx

  from experiments.configs import tiny_moe
  from meshmoe import cost_model, step
  from meshmoe.sharding.mesh import make_mesh

  config = tiny_moe.get_config()
  if FLAGS.preset:
    config.mesh.preset = FLAGS.preset
  if FLAGS.gemm_impl:
    config.model.moe.gemm_impl = FLAGS.gemm_impl
  for axis in ("data", "expert", "tensor", "sequence"):
    if getattr(FLAGS, axis) is not None:
      setattr(config.mesh, axis, getattr(FLAGS, axis))
  config.validate(jax.device_count())
  mesh = make_mesh(config.mesh)
  model = step.init_model(config, mesh)
  _, params, others = nnx.split(model, nnx.Param, ...)
  b, s = config.train.global_batch_size, config.train.seq_len
  inputs, targets = step.synthetic_batch(config, mesh)
  loss_and_grad = step.make_loss_and_grad(model, config, mesh)
  compiled = loss_and_grad.lower(params, others, inputs, targets).compile()
  jax.block_until_ready(compiled(params, others, inputs, targets))
  start = time.perf_counter()
  for _ in range(FLAGS.steps):
    jax.block_until_ready(compiled(params, others, inputs, targets))
  step_time = (time.perf_counter() - start) / FLAGS.steps

  compiled_flops = compiled.cost_analysis()["flops"]
  model_flops = cost_model.train_step_flops(config.model, b, s) / jax.device_count()
  forward = cost_model.forward_flops(config.model, b, s)
  print(f"config tiny_moe  mesh {dict(mesh.shape)}  preset {config.mesh.preset}  "
        f"gemm {config.model.moe.gemm_impl}  {jax.device_count()} {jax.default_backend()} devices")
  print(f"forward+backward step time   {step_time * 1e3:9.1f} ms  ({b * s / step_time:,.0f} tokens/s)")
  print(f"compiled FLOPs per device    {compiled_flops / 1e9:9.3f} GFLOP")
  print(f"useful model FLOPs / device  {model_flops / 1e9:9.3f} GFLOP")
  print(f"ratio compiled / model       {compiled_flops / model_flops:9.3f}")
  print("useful forward FLOPs by part: " + ", ".join(
      f"{k} {v / forward.total:.1%}" for k, v in vars(forward).items()))


if __name__ == "__main__":
  app.run(main)
