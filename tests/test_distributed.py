"""Multi-process start-up: the topology from flags or SLURM, experiments.launch, and a 2-process run that
stops at the same step when one of its processes gets SIGTERM, and resumes."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from meshmoe.runtime import distributed
from meshmoe.runtime.distributed import Topology, TopologyError
from tests import runs
from tests.runs import REPO

SLURM_TASK = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8",
              "SLURM_STEP_NODELIST": "gpu[017-018,020],login1", "SLURM_LOCALID": "3"}


def test_explicit_flags_win_and_must_come_together():
  topology = distributed.resolve("node7:1234", 4, 2, [0, 1], environ=SLURM_TASK)
  assert topology == Topology(4, 2, "node7:1234", (0, 1), "flags")
  with pytest.raises(TopologyError, match="--process_id missing: a multi-process job needs"):
    distributed.resolve("node7:1234", 4, None, environ={})
  with pytest.raises(TopologyError, match=r"--process_id=4 is invalid: from 0 to --num_processes - 1 = 3"):
    distributed.resolve("node7:1234", 4, 4, environ={})
  with pytest.raises(TopologyError, match="--coordinator_address='node7' is invalid: host:port"):
    distributed.resolve("node7", 2, 0, environ={})


def test_slurm_step_environment():
  topology = distributed.resolve(environ=SLURM_TASK)
  # JAX's port for SLURM jobs: 61440 + job id % 4096; the first host of the step's node list.
  assert topology == Topology(8, 3, f"gpu017:{61440 + 4242 % 4096}", None, "SLURM")
  assert distributed.first_slurm_host("node001") == "node001"
  assert distributed.first_slurm_host("a[9,11-12]") == "a9"


def test_a_batch_script_or_a_laptop_is_one_process():
  # The batch step of an sbatch job sees SLURM_NTASKS and SLURM_PROCID too, but is not a task of a step.
  batch_step = {k: v for k, v in SLURM_TASK.items() if not k.startswith("SLURM_STEP")}
  assert distributed.resolve(environ=batch_step) == Topology()
  assert distributed.resolve(environ={}) == Topology()
  assert not Topology().is_multi_process


@pytest.mark.parametrize("args, message", [
    (["--config.train.steps=5"], "unknown launch flag(s) --config.train.steps=5; flags for experiments.train go "
                                 "after '--'"),
    (["--processes=0", "--"], "--processes=0 and --devices_per_process=4: both must be >= 1"),
    (["--", "--process_id=1"], "--process_id=1: experiments.launch sets --coordinator_address, --num_processes, "
                               "--process_id itself"),
])
def test_launch_rejects_bad_flags(args, message):
  result = subprocess.run([sys.executable, "-m", "experiments.launch", *args], cwd=REPO, env=runs.env(),
                          capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert f"error: {message}" in result.stderr and "usage: python -m experiments.launch" in result.stderr
  assert "Traceback" not in result.stderr


def test_train_rejects_half_a_topology(tmp_path):
  result = subprocess.run(runs.train_command(tmp_path, "--num_processes=2"), cwd=REPO, env=runs.env(),
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1
  assert "error: --coordinator_address, --process_id missing" in result.stderr
  assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_launch_runs_one_process_of_every_device_for_a_config_whose_kernels_need_it(tmp_path):
  """parallel.impl=pallas: its Mosaic GPU kernels need every device of their rings in one process, so
  experiments.launch starts one process of 2 x 4 devices (as train.sbatch runs one per node) and says so;
  the plan says it runs in one process."""
  workdir = tmp_path / "run"
  result = runs.run(runs.launch_command(workdir, *runs.SMALL_FLAGS, "--config.train.steps=2",
                                        "--config.checkpoint.every_steps=0", "--config.parallel.impl=pallas"))
  assert ("experiments.launch: one process of 8 devices instead of 2 of 4: parallel.impl='pallas': its Mosaic "
          "GPU kernels store into peer GPUs' memory") in result.stderr
  plan = json.loads((workdir / "plan.json").read_text())
  assert (plan["processes"], plan["devices_per_process"]) == (1, 8)
  assert sorted(p.name for p in (workdir / "logs").iterdir()) == ["process_0.log"]
  assert "in one process" in result.stdout and "[process 1]" not in result.stdout


# The small model of tests/runs.py, as test_faults.py and test_stragglers.py launch it: its compiled programs
# are in the session's compile cache once any of them has run. That 2 processes train like one is checked
# against the one-process reference by test_slurm.py (train.sbatch's 2 tasks) and test_data_runs.py
# (experiments.launch's 2 processes, resumed from a one-process run's checkpoint).
SIGTERM_STEPS = 20
SIGTERM_RUN = [*runs.SMALL_FLAGS, f"--config.train.steps={SIGTERM_STEPS}", "--config.checkpoint.every_steps=100"]


@pytest.mark.slow
def test_sigterm_to_one_of_two_processes_stops_both_at_one_step_and_the_rerun_resumes(tmp_path):
  """2 processes x 4 devices: SIGTERM to process 1 alone stops both at one step with a checkpoint, exit 0
  (a preemption notice reaches one host; the processes agree on the step); the re-run resumes there."""
  workdir, output = tmp_path / "run", tmp_path / "first.log"
  command = runs.launch_command(workdir, *SIGTERM_RUN)
  launcher = runs.start(command, output)
  runs.wait_for_step(output, 2, launcher)
  worker = runs.child_pid(launcher.pid, 1)
  signalled = time.monotonic()
  os.kill(worker, signal.SIGTERM)
  assert launcher.wait(timeout=60) == 0, output.read_text()[-3000:]
  took = time.monotonic() - signalled
  stopped_at = int((workdir / "preempted").read_text())
  print(f"SIGTERM to process 1: both processes stopped at step {stopped_at} with a checkpoint in {took:.1f}s")
  assert took < 30 and stopped_at < SIGTERM_STEPS
  assert (workdir / "checkpoints" / str(stopped_at)).is_dir()
  log = output.read_text()
  assert log.count(f"preempted (SIGTERM): stopped at step {stopped_at} of {SIGTERM_STEPS}") == 2  # both processes

  started = time.monotonic()
  result = runs.run(command)
  print(f"resumed and finished in {time.monotonic() - started:.1f}s")
  assert f"resuming from the checkpoint of step {stopped_at}" in result.stdout
  assert f"[process 1] resuming from the checkpoint of step {stopped_at}" in result.stdout
  assert not (workdir / "preempted").exists()
  steps = [r["step"] for r in runs.records(workdir, kinds=("train",))]
  assert steps == list(range(1, SIGTERM_STEPS + 1))  # each step written once, none lost
  for process in (0, 1):
    text = (workdir / "logs" / f"process_{process}.log").read_text()
    assert f"process {process} of 2 on host" in text and f"resuming from the checkpoint of step {stopped_at}" in text
  progress = f"step {SIGTERM_STEPS}/{SIGTERM_STEPS}"
  assert progress in (workdir / "logs" / "process_0.log").read_text()
  assert progress not in (workdir / "logs" / "process_1.log").read_text()  # progress: process 0 only
  assert json.loads((workdir / "config.json").read_text())["train"]["steps"] == SIGTERM_STEPS
