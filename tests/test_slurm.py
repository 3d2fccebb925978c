"""experiments/slurm/train.sbatch under a real SLURM (CI starts a one-node cluster: .ci/slurm_cluster.sh).

The job is the script users submit, in its CPU variant: 2 tasks x 4 simulated CPU devices. Part-way through,
SLURM signals the job step as it does before a time limit or a preemption; the processes save a
checkpoint and exit, the script requeues the job, and the requeued job resumes and finishes with the same
losses as the single-process 8-device reference run.

Skipped when `sbatch` is not installed, except where MESHMOE_REQUIRE_SLURM=1 (CI), which makes that a
failure: CI must never pass without running this test.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests import runs
from tests.runs import REPO, STEPS
from tests.tolerances import FP32_MODEL_RTOL


@pytest.fixture(scope="module")
def slurm():
  if shutil.which("sbatch") is None:
    if os.environ.get("MESHMOE_REQUIRE_SLURM") == "1":
      pytest.fail("MESHMOE_REQUIRE_SLURM=1 but sbatch is not on PATH: run .ci/slurm_cluster.sh first")
    pytest.skip("no SLURM here (sbatch not on PATH); .ci/slurm_cluster.sh starts a one-node cluster")
  _wait_for_a_free_node()


def _wait_for_a_free_node(timeout: float = 900) -> None:
  """The node may be busy with someone else's job (another clone's CI on the same machine): wait for it to
  free up rather than fail, and name the jobs holding it if it never does."""
  deadline = time.monotonic() + timeout
  while True:
    state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    assert state.returncode == 0, f"sinfo failed: {state.stderr.strip()}"
    if re.search(r"idle|mixed", state.stdout):
      return
    if "allocated" not in state.stdout or time.monotonic() > deadline:
      jobs = subprocess.run(["squeue", "-h", "-o", "%i %j %u %T %M"], capture_output=True, text=True, timeout=60)
      raise AssertionError(f"SLURM has no free node: sinfo says {state.stdout.strip()!r}; jobs: "
                           f"{jobs.stdout.strip() or 'none'}")
    time.sleep(2)


@pytest.mark.slow
def test_sbatch_job_is_preempted_requeued_and_trains_like_one_process(slurm, reference_run, tmp_path):
  workdir, output = tmp_path / "run", tmp_path / "slurm.out"
  environment = {"MESHMOE_PLATFORM": "cpu", "MESHMOE_CPU_DEVICES": "4", "MESHMOE_VENV": sys.prefix}
  submit = subprocess.run(
      ["sbatch", "--parsable", "--job-name=meshmoe-ci", "--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0",
       "--cpus-per-task=1", "--time=15:00", f"--output={output}",
       "--export=ALL," + ",".join(f"{k}={v}" for k, v in environment.items()),
       "experiments/slurm/train.sbatch", f"--workdir={workdir}", *runs.REFERENCE_FLAGS],
      cwd=REPO, env=runs.env(), capture_output=True, text=True, timeout=120)
  assert submit.returncode == 0, submit.stderr
  job = submit.stdout.strip().split(";")[0]
  try:
    _wait_for(lambda: output.exists() and re.search(r"^step +1[0-9]/24", output.read_text(), re.MULTILINE),
              what="step 10", job=job, output=output)
    signalled = time.monotonic()
    subprocess.run(["scancel", "--signal=TERM", job], check=True, timeout=60)  # what --signal=TERM@120 does
    _wait_for(lambda: "(restart 1)" in output.read_text(), what="the requeued job", job=job, output=output)
    print(f"SLURM's SIGTERM to the requeued job running again: {time.monotonic() - signalled:.1f}s")
    _wait_for(lambda: _state(job) == "COMPLETED", what="the requeued job to complete", job=job, output=output)
  finally:
    subprocess.run(["scancel", job], capture_output=True, timeout=60)
  text = output.read_text()
  stopped_at = int(re.search(r"train.sbatch: preempted at step (\d+); requeueing job", text).group(1))
  assert re.search(r"train.sbatch: job \d+ \(restart 1\)", text), text[-3000:]
  assert "coordinator " in text and "(from SLURM)" in text
  assert f"resuming from the checkpoint of step {stopped_at}" in text
  assert re.search(rf"^done: {STEPS} steps in", text, re.MULTILINE), text[-3000:]

  mine, reference = runs.records(workdir), runs.records(reference_run)
  assert [(r["kind"], r["step"]) for r in mine] == [(r["kind"], r["step"]) for r in reference]
  for record, expected in zip(mine, reference, strict=True):
    for field in ("loss", "cross_entropy", "grad_norm"):
      if field in expected:
        assert record[field] == pytest.approx(expected[field], rel=FP32_MODEL_RTOL), (record["step"], field)
  for process in (0, 1):
    assert "(from SLURM)" in (workdir / "logs" / f"process_{process}.log").read_text()


@pytest.mark.slow
def test_sbatch_runs_one_process_per_node_for_a_config_whose_kernels_need_it(slurm, tmp_path):
  """parallel.impl=pallas asks for one process per node (its Mosaic GPU kernels need every GPU of their
  rings in one process): the job asked for 2 tasks per node runs one process with the node's 2 x 4 devices,
  and says why."""
  workdir, output = tmp_path / "run", tmp_path / "slurm.out"
  environment = {"MESHMOE_PLATFORM": "cpu", "MESHMOE_CPU_DEVICES": "4", "MESHMOE_VENV": sys.prefix}
  submit = subprocess.run(
      ["sbatch", "--parsable", "--wait", "--job-name=meshmoe-ci-node", "--nodes=1", "--ntasks-per-node=2",
       "--gpus-per-node=0", "--cpus-per-task=1", "--time=10:00", f"--output={output}", "--no-requeue",
       "--export=ALL," + ",".join(f"{k}={v}" for k, v in environment.items()),
       "experiments/slurm/train.sbatch", f"--workdir={workdir}", *runs.SMALL_FLAGS, "--config.train.steps=2",
       "--config.checkpoint.every_steps=0", "--config.parallel.impl=pallas"],
      cwd=REPO, env=runs.env(), capture_output=True, text=True, timeout=600)
  text = output.read_text() if output.exists() else ""
  assert submit.returncode == 0, submit.stderr + text[-3000:]
  assert ("train.sbatch: one process per node instead of 2: parallel.impl='pallas': its Mosaic GPU kernels store "
          "into peer GPUs' memory") in text
  assert "1 process(es) per node" in text and "process 0 of 1 on host" in text
  assert re.search(r"^done: 2 steps in", text, re.MULTILINE), text[-3000:]
  plan = json.loads((workdir / "plan.json").read_text())
  assert (plan["processes"], plan["devices_per_process"]) == (1, 8)


def _state(job: str) -> str:
  result = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=60)
  match = re.search(r"JobState=(\w+)", result.stdout)
  return match.group(1) if match else "UNKNOWN"


def _wait_for(condition, *, what: str, job: str, output, timeout: float = 900) -> None:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if condition():
      return
    state = _state(job)
    assert state not in ("FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"), (
        f"job {job} is {state} while waiting for {what}:\n" + (output.read_text()[-4000:] if output.exists() else ""))
    time.sleep(0.5)
  raise AssertionError(f"job {job}: no {what} within {timeout}s (state {_state(job)})")
