"""A short training run of the default experiment (tiny_moe) with AdamW.

  bash experiments/run.sh train [--steps=N] [--preset=ep] [--data=-1 --expert=1 --tensor=1 --sequence=1]

Trains tiny_moe with AdamW on bytes of this interpreter's standard-library source files (text present on
every machine) on all local devices, printing the loss as it falls.
"""

import os
import pathlib
import time

from absl import app, flags

flags.DEFINE_integer("steps", None, "training steps (default: the config's train.steps)")
flags.DEFINE_string("preset", None, "sharding preset: dp, fsdp, zero1, ep, tp_sp, megascale")
for _axis in ("data", "expert", "tensor", "sequence"):
  flags.DEFINE_integer(_axis, None, f"size of the {_axis} mesh axis (-1 fills the remaining devices)")
FLAGS = flags.FLAGS


def stdlib_bytes(limit: int = 4 << 20):
  import numpy as np

  root = pathlib.Path(os.__file__).parent
  chunks, total = [], 0
  for path in sorted(root.glob("*.py")):
    data = path.read_bytes()
    chunks.append(np.frombuffer(data, np.uint8))
    total += len(data)
    if total >= limit:
      break
  if not chunks:
    raise SystemExit(f"no Python source files found under {root} to train on")
  return np.concatenate(chunks).astype(np.int32)


def main(argv):
  del argv
  import jax
  import numpy as np
  import optax
  from flax import nnx

  from experiments.configs import tiny_moe
  from meshmoe import step
  from meshmoe.config import ConfigError
  from meshmoe.sharding.mesh import make_mesh

  config = tiny_moe.get_config()
  if FLAGS.steps is not None:
    config.train.steps = FLAGS.steps
  if FLAGS.preset is not None:
    config.mesh.preset = FLAGS.preset
  for axis in ("data", "expert", "tensor", "sequence"):
    if getattr(FLAGS, axis) is not None:
      setattr(config.mesh, axis, getattr(FLAGS, axis))
  try:
    config.validate(jax.device_count())
  except ConfigError as e:
    raise SystemExit(f"error: {e}") from None

  mesh = make_mesh(config.mesh)
  print(f"mesh {dict(mesh.shape)} preset {config.mesh.preset} on {jax.device_count()} {jax.default_backend()} "
        "device(s)")
  model = step.init_model(config, mesh)
  optimizer = optax.adamw(config.optimizer.learning_rate, weight_decay=0.01)
  _, params, others = nnx.split(model, nnx.Param, ...)
  opt_state = step.init_optimizer_state(optimizer, params, config, mesh)
  train_step = step.make_train_step(model, optimizer, config, mesh)

  corpus = stdlib_bytes()
  rng = np.random.default_rng(config.train.seed)
  b, s = config.train.global_batch_size, config.train.seq_len
  start = time.perf_counter()
  for i in range(config.train.steps):
    offsets = rng.integers(0, len(corpus) - s - 1, size=b)
    window = np.stack([corpus[o:o + s + 1] for o in offsets])
    inputs = step.shard_batch(window[:, :-1], config, mesh)
    targets = step.shard_batch(window[:, 1:], config, mesh)
    params, others, opt_state, metrics = train_step(params, others, opt_state, inputs, targets)
    if i % 10 == 0 or i == config.train.steps - 1:
      print(f"step {i:4d}  loss {float(metrics['loss']):.3f}  "
            f"aux {float(metrics['aux_loss']):.3f}  {time.perf_counter() - start:6.1f}s")
  tokens = config.train.steps * b * s
  print(f"trained {config.train.steps} steps ({tokens} tokens) in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
  app.run(main)
