"""Train a meshmoe experiment.

  python -m experiments.train --config=experiments/configs/tiny_moe.py [--config.a.b=value ...] [--workdir=DIR]

Examples:
  --config.mesh.expert=4 --config.mesh.preset=megascale     pick a mesh layout (-1 fills the devices)
  --config.train.steps=1000 --config.checkpoint.every_steps=200
  --config.data.source=jsonl --config.data.paths='data/*.jsonl' --config.data.tokenizer=tokenizer.json
  --config.train.init_from=hf:/path/to/Qwen3-30B-A3B      start from a Hugging Face checkpoint (fine-tuning)

Writes to the workdir (default runs/<config name>): metrics.jsonl, tensorboard/, checkpoints/, training.png,
sample.txt, config.json, and logs/process_<i>.log for every process. Re-running on a workdir that holds
checkpoints resumes from the newest usable one. All fields and their defaults: `--helpfull`, or the
dataclasses of meshmoe.config (src/config_model.py, config_parallel.py, config_run.py).

Several processes (one per host or per GPU): under SLURM's srun nothing more is needed (see
experiments/slurm/train.sbatch); elsewhere give each process --coordinator_address, --num_processes and
--process_id, or let `python -m experiments.launch` start them on this machine. SIGTERM saves a
checkpoint and exits with status 0 (a `preempted` file in the workdir says so); a process that lost another
one (its step hung past resilience.watchdog_timeout_s, or a collective failed) exits with status 3; other
errors exit with status 1.
"""

import os
import pathlib
import sys
import traceback

from absl import app, flags, logging

from experiments import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "output directory (default: runs/<config file name>)")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for a multi-process job outside SLURM")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "number of processes of the job")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index, from 0 to --num_processes - 1")
_LOCAL_DEVICE_IDS = flags.DEFINE_list(
    "local_device_ids", None, "GPUs this process uses, e.g. 0,1 (default: every GPU it sees)")
_DEBUG_STRAGGLER = flags.DEFINE_string(
    "debug_straggler", None, "PROCESS:SECONDS, a debugging aid: process PROCESS sleeps SECONDS in every step, "
    "to see the straggler detector (resilience.straggler_*) name it. Never use it in a real run.")
_PRINT_PROCESS_LAYOUT = flags.DEFINE_bool(
    "print_process_layout", False, "print the processes the config needs per node and why, then exit: 'node' "
    "(one process drives every device of a node: parallel.impl='pallas', whose kernels need their rings in one "
    "process) or 'any'. experiments/slurm/train.sbatch and experiments.launch ask before starting processes.")

PREEMPTED_MARKER = "preempted"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; flags look like --config.train.steps=10")
  if not any(a.startswith(("--verbosity", "-v")) for a in sys.argv[1:]):
    logging.set_verbosity(logging.WARNING)  # library INFO logs (orbax, grain) drown the progress lines
  from meshmoe.config import ConfigError
  from meshmoe.runtime import distributed, gpu_memory, xla_flags

  config = flags.FLAGS.config
  config_path = pathlib.Path(flags.FLAGS["config"].config_filename)
  workdir = pathlib.Path(_WORKDIR.value or pathlib.Path("runs") / config_path.stem.split(":")[0])
  try:
    from meshmoe.models import hf_checkpoint
    config = hf_checkpoint.with_checkpoint_model(config)  # train.init_from's model, before checking it
    config.validate()  # the fields alone; the mesh is checked once the devices are known
    if _PRINT_PROCESS_LAYOUT.value:
      from meshmoe.sharding.plan import process_layout

      print(*process_layout(config.parallel))
      return
    ids = _device_ids(_LOCAL_DEVICE_IDS.value)
    topology = distributed.resolve(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value, ids)
    delay = _straggler_delay(_DEBUG_STRAGGLER.value, topology)
    # After the flags' checks (a bad flag leaves no empty workdir), before the processes connect.
    cli.writable_folder(workdir, "workdir")
    xla_flags.apply(config.parallel.xla_flags)  # before JAX starts a backend
    if (note := gpu_memory.set_fraction(config.train.gpu_memory_fraction)) is not None:
      print(note, flush=True)
    distributed.initialize(topology, config.resilience.watchdog_timeout_s)
  except (ConfigError, distributed.TopologyError, ValueError) as e:
    sys.exit(f"error: {e}")
  with distributed.process_log(workdir, topology.process_id):
    try:
      status = _train(config, workdir, topology, delay)
    except Exception:  # a bug: its traceback is the message; the shutdown below must still be watched
      traceback.print_exc()
      status = 1
    _shutdown(topology, config.resilience.watchdog_timeout_s)
  sys.exit(status)


def _train(config, workdir: pathlib.Path, topology, delay: float) -> int:
  """Runs the training on this process; returns the exit status."""
  from meshmoe.config import ConfigError
  from meshmoe.data.documents import DataError
  from meshmoe.models.hf_checkpoint import CheckpointError as HfCheckpointError
  from meshmoe.runtime import distributed, resilience
  from meshmoe.runtime.nonfinite import NonFiniteError
  from meshmoe.training import trainer
  from meshmoe.training.checkpointing import CheckpointError

  is_primary = topology.process_id == 0
  print(distributed.describe(topology), flush=True)
  if is_primary:
    (workdir / PREEMPTED_MARKER).unlink(missing_ok=True)
  try:
    summary = trainer.train(config, workdir, step_delay_s=delay)
  except (ConfigError, DataError, CheckpointError, HfCheckpointError, NonFiniteError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return 1
  except resilience.ProcessLostError as e:
    print(f"error: process {topology.process_id}: {e} Exiting with status {resilience.WATCHDOG_EXIT_STATUS}.",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Not through the shutdown barrier: it would wait for the process that is gone.
    os._exit(resilience.WATCHDOG_EXIT_STATUS)
  if summary.preempted_at is not None:
    if is_primary:
      (workdir / PREEMPTED_MARKER).write_text(f"{summary.preempted_at}\n")
    print(f"\npreempted (SIGTERM): stopped at step {summary.preempted_at} of {summary.steps} with its checkpoint "
          f"saved in {summary.wall_time_s:.0f}s; run the same command again to resume", flush=True)
    return 0
  if not is_primary:
    print(f"done: {summary.steps} steps", flush=True)
    return 0
  print(f"\ndone: {summary.steps} steps in {summary.wall_time_s:.0f}s"
        + (f" (resumed from step {summary.resumed_from})" if summary.resumed_from is not None else "")
        + (f"; {summary.skipped_steps} non-finite steps skipped" if summary.skipped_steps else ""))
  print(f"final train loss {summary.final_loss:.3f}, eval loss {summary.eval_loss:.3f} nats/token; "
        f"unigram entropy of the training data {summary.unigram_entropy:.3f} nats/token")
  for name, text in summary.samples.items():
    print(f"\nsample ({name}):\n{text}")
  print(f"\noutputs in {workdir}/: metrics.jsonl, plan.json, tensorboard/, checkpoints/, training.png, sample.txt, "
        "logs/",
        flush=True)
  return 0


def _device_ids(values: list[str] | None) -> list[int] | None:
  if not values:
    return None
  if not all(v.strip().isdigit() for v in values):
    raise ValueError(f"--local_device_ids={','.join(values)!r} is invalid: comma-separated device numbers, e.g. 0,1")
  return [int(v) for v in values]


def _straggler_delay(value: str | None, topology) -> float:
  """This process's sleep per step from --debug_straggler=PROCESS:SECONDS (0 unless it names this one)."""
  if not value:
    return 0.0
  process, _, seconds = value.partition(":")
  try:
    process_id, delay = int(process), float(seconds)
  except ValueError:
    raise ValueError(f"--debug_straggler={value!r} is invalid: PROCESS:SECONDS, e.g. 1:0.5") from None
  if not 0 <= process_id < topology.num_processes or not 0 <= delay < 3600:
    raise ValueError(f"--debug_straggler={value!r} is invalid: a process from 0 to {topology.num_processes - 1} "
                     "and a delay from 0 to 3600 seconds")
  return delay if process_id == topology.process_id else 0.0


def _shutdown(topology, timeout_s: float) -> None:
  """Leaves the job; the distributed runtime waits there for every process, so watch that wait too."""
  if not topology.is_multi_process:
    return
  import jax

  from meshmoe.runtime import resilience

  with resilience.Watchdog(timeout_s, topology.process_id) as watchdog:
    watchdog.beat("shutdown (waiting for the other processes to finish)")
    jax.distributed.shutdown()


def _run():
  cli.define_config_flag(sys.argv[1:])
  app.run(main)


if __name__ == "__main__":
  _run()
