"""Train a meshmoe experiment.

  python -m experiments.train --config=experiments/configs/tiny_moe.py [--config.a.b=value ...] [--workdir=DIR]

Examples:
  --config.mesh.expert=4 --config.mesh.preset=megascale     pick a mesh layout (-1 fills the devices)
  --config.train.steps=1000 --config.checkpoint.every_steps=200
  --config.data.source=jsonl --config.data.paths='data/*.jsonl' --config.data.tokenizer=tokenizer.json

Writes to the workdir (default runs/<config name>): metrics.jsonl, tensorboard/, checkpoints/, training.png,
sample.txt, config.json. Re-running on a workdir that holds checkpoints resumes from the newest one.
All fields and their defaults: `--helpfull`, or the dataclasses in src/config.py.
"""

import pathlib
import sys

from absl import app, flags, logging

from experiments import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (default: runs/<config file name>)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --config.train.steps=10")
  if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
    logging.set_verbosity(logging.WARNING)  # library INFO logs (orbax, grain) drown the progress lines
  from meshmoe import trainer, xla_flags
  from meshmoe.config import ConfigError
  from meshmoe.data import DataError

  config_path = pathlib.Path(flags.FLAGS["config"].config_filename)
  workdir = pathlib.Path(_WORKDIR.value or pathlib.Path("runs") / config_path.stem.split(":")[0])
  try:
    xla_flags.apply(flags.FLAGS.config.parallel.xla_flags)  # before JAX starts a backend
    summary = trainer.train(flags.FLAGS.config, workdir)
  except (ConfigError, DataError) as e:
    sys.exit(f"error: {e}")
  print(f"\ndone: {summary.steps} steps in {summary.wall_time_s:.0f}s"
        + (f" (resumed from step {summary.resumed_from})" if summary.resumed_from is not None else ""))
  print(f"final train loss {summary.final_loss:.3f}, eval loss {summary.eval_loss:.3f} nats/token; "
        f"unigram entropy of the training data {summary.unigram_entropy:.3f} nats/token")
  for name, text in summary.samples.items():
    print(f"\nsample ({name}):\n{text}")
  print(f"\noutputs in {workdir}/: metrics.jsonl, tensorboard/, checkpoints/, training.png, sample.txt")


def _run():
  cli.define_config_flag(sys.argv[1:])
  app.run(main)


if __name__ == "__main__":
  _run()
