"""Hugging Face checkpoints to meshmoe training checkpoints and back (Mixtral, Qwen3-MoE).

  # A Hugging Face folder -> the step-0 checkpoint of a run in --workdir (experiments.train then resumes it):
  python -m experiments.convert --to=orbax --hf=/models/Qwen3-30B-A3B --workdir=runs/qwen3 \
      [--config=experiments/configs/<file>.py --config.mesh.expert=8 ...]
  # The newest checkpoint of a run -> a Hugging Face folder (safetensors shards, index, config.json, tokenizer):
  python -m experiments.convert --to=hf --workdir=runs/qwen3 --hf=/exports/qwen3-finetuned [--dtype=bfloat16]

--to=orbax takes the run's settings from --config (as experiments.train does) with the model from the
folder's config.json (train.init_from); the checkpoint holds the parameters, a fresh optimizer state and
the data position of step 0, so `python -m experiments.train` with the same flags and --workdir starts
training from it. --to=hf reads the run's own config.json in --workdir (written by experiments.train or
by --to=orbax) and writes the folder without ever holding the model on the host (models/hf_export.py).
Runs on this machine's devices (8 simulated CPU devices by default on a CPU machine).
"""

import os
import pathlib
import sys

from absl import app, flags, logging

from experiments import cli

_TO = flags.DEFINE_enum("to", None, ["orbax", "hf"], "what to write: a run's checkpoint, or a Hugging Face folder")
_HF = flags.DEFINE_string("hf", None, "the Hugging Face folder: read with --to=orbax, written with --to=hf")
_WORKDIR = flags.DEFINE_string("workdir", None, "the run's folder (its checkpoints/ and config.json)")
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "--to=hf: the tensors' dtype")
_DEVICES = flags.DEFINE_integer("devices", 8, "simulated CPU devices (ignored on accelerators)", lower_bound=1)
flags.mark_flags_as_required(["to", "hf", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  logging.set_verbosity(logging.WARNING)  # orbax's INFO lines are not results
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={_DEVICES.value}")
  from meshmoe.config import ConfigError
  from meshmoe.data.documents import DataError
  from meshmoe.models.hf_checkpoint import CheckpointError
  from meshmoe.training import hf_convert
  from meshmoe.training.checkpointing import CheckpointError as RunCheckpointError

  workdir, folder = pathlib.Path(_WORKDIR.value), pathlib.Path(_HF.value)
  try:
    if _TO.value == "orbax":
      hf_convert.to_run_checkpoint(flags.FLAGS.config, folder, workdir)
      print(f"wrote the step-0 checkpoint of {folder} to {workdir}/checkpoints/0")
    else:
      step = hf_convert.to_hf_folder(workdir, folder, _DTYPE.value)
      print(f"wrote the step-{step} parameters of {workdir} to {folder} ({_DTYPE.value})")
  except (ConfigError, DataError, CheckpointError, RunCheckpointError) as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  cli.define_config_flag(sys.argv[1:])
  app.run(main)
