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
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_DEFAULT_CONFIG = pathlib.Path(__file__).parent / "configs" / "tiny_moe.py"
_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (default: runs/<config file name>)")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --config.train.steps=10")
  if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
    logging.set_verbosity(logging.WARNING)  # library INFO logs (orbax, grain) drown the progress lines
  from meshmoe import trainer
  from meshmoe.config import ConfigError
  from meshmoe.data import DataError

  config_path = pathlib.Path(flags.FLAGS["config"].config_filename)
  workdir = pathlib.Path(_WORKDIR.value or pathlib.Path("runs") / config_path.stem.split(":")[0])
  try:
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


def _check_config_path(argv: list[str]) -> None:
  """A missing --config file gets one line naming the configs that exist, not a loader traceback."""
  for arg in argv:
    if arg.startswith("--config="):
      path = pathlib.Path(arg.split("=", 1)[1].split(":")[0])
      if not path.is_file():
        available = ", ".join(str(p.relative_to(pathlib.Path.cwd())) if p.is_relative_to(pathlib.Path.cwd())
                              else str(p) for p in sorted(_DEFAULT_CONFIG.parent.glob("[!_]*.py")))
        sys.exit(f"error: --config file {str(path)!r} does not exist; available: {available}")


def _run():
  _check_config_path(sys.argv[1:])
  try:
    # Defining the flag loads the config file and applies the --config.a.b overrides from sys.argv.
    config_flags.DEFINE_config_file(
        "config", str(_DEFAULT_CONFIG), "experiment config file (a .py with get_config()); override fields "
        "with --config.<section>.<field>=<value>", lock_config=False)
  except KeyError as e:  # ml_collections reports an unknown --config.a.b field as a bare KeyError
    match = re.search(r"Field (\w+) not found on dataclass <class '[\w.]+\.(\w+)'>", str(e))
    what = f"field {match.group(1)!r} does not exist in {match.group(2)}" if match else str(e)
    sys.exit(f"error: unknown config override: {what}; see src/config.py for the fields")
  app.run(main)


if __name__ == "__main__":
  _run()
