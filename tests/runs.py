"""Running `python -m experiments.train` (one process, or several through experiments.launch or SLURM) in
subprocesses, and reading what the runs wrote. Shared by the end-to-end tests.

`REFERENCE_FLAGS` define the reference run: tiny_moe, 24 steps on 8 simulated CPU devices, a checkpoint
every 8 steps. tests/conftest.py runs it once per session (fixture `reference_run`); the tests that stop,
kill, corrupt, split across processes or submit to SLURM compare against it.
"""

import atexit
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
# Fields that depend only on the computation (not on wall-clock time).
DETERMINISTIC = ("loss", "cross_entropy", "aux_loss", "z_loss", "grad_norm", "learning_rate",
                 "expert_load_imbalance", "dropped_fraction")
PER_DATASET = ("tokens/", "loss/")  # deterministic too: each dataset's tokens so far, and its eval loss
STEPS, EVERY = 24, 8
REFERENCE_FLAGS = [f"--config.train.steps={STEPS}", f"--config.checkpoint.every_steps={EVERY}",
                   "--config.train.log_every=1", "--config.train.eval_every=8", "--config.train.eval_batches=2",
                   "--config.sample.max_new_tokens=8", "--config.train.profile_steps=2:4",
                   "--config.checkpoint.keep=2"]
# A smaller model for the fault tests that do not compare with the reference: quicker to compile and run.
SMALL_FLAGS = ["--config.model.num_layers=2", "--config.train.seq_len=64", "--config.train.global_batch_size=8",
               "--config.train.log_every=1", "--config.train.eval_every=0", "--config.train.eval_batches=1",
               "--config.sample.max_new_tokens=4"]


# JAX's persistent compilation cache for the runs: a restarted or repeated run loads the compiled steps
# instead of compiling them again, as a user's restarts do with JAX_COMPILATION_CACHE_DIR set (README.md,
# "Multi-host runs and faults"). Runs of one process use the tests' kept cache (tests/conftest.py,
# MESHMOE_TEST_JIT_CACHE_DIR), so an unchanged run compiles nothing in the next session either. Runs of
# several processes use one made for the session (MESHMOE_TEST_RUN_CACHE): JAX writes entries from process
# 0 only, and on CPUs under keys that differ by process (process 1 of a 2-process run found none of
# process 0's 160 entries), so with a warm cache process 0 loads in seconds what the others compile for
# tens of seconds, and meets them at a collective that late (gloo gives a collective's first meeting 30 s).
# Without pytest, a cache of this process for both.
_SESSION_CACHE = os.environ.get("MESHMOE_TEST_RUN_CACHE")
if not _SESSION_CACHE:
  _SESSION_CACHE = tempfile.mkdtemp(prefix="meshmoe-test-jit-cache-")
  atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
_KEPT_CACHE = os.environ.get("MESHMOE_TEST_JIT_CACHE_DIR") or _SESSION_CACHE


def env(devices: int = 8, processes: int = 2) -> dict:
  """The environment of a run of `processes` processes (2 unless the caller knows it runs one)."""
  environ = dict(os.environ)
  environ.setdefault("JAX_COMPILATION_CACHE_DIR", _KEPT_CACHE if processes == 1 else _SESSION_CACHE)
  # Every program, not only those that took a second to compile: a process's ~90 small ones (parameter
  # initialisation, metrics) cost a warm run 2.5 s of its 15 s of CPU when compiled again.
  environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
  environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  environ["JAX_PLATFORMS"] = "cpu"
  environ["PYTHONUNBUFFERED"] = "1"
  return environ


def process_count(command: list[str]) -> int:
  """How many processes a command of this module's runs starts: one for `experiments.train` alone."""
  one = command[1:3] == ["-m", "experiments.train"] and not any(
      a.startswith("--num_processes=") and a != "--num_processes=1" for a in command)
  return 1 if one else 2


def train_command(workdir: pathlib.Path, *flags: str) -> list[str]:
  return [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *flags]


def launch_command(workdir: pathlib.Path, *flags: str, processes: int = 2, devices: int = 4) -> list[str]:
  return [sys.executable, "-m", "experiments.launch", f"--processes={processes}",
          f"--devices_per_process={devices}", "--", f"--workdir={workdir}", *flags]


def run(command: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
  """Runs to the end; asserts it succeeded."""
  result = subprocess.run(command, cwd=REPO, env=env(processes=process_count(command)), capture_output=True, text=True,
                          timeout=timeout)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
  return result


def start(command: list[str], output: pathlib.Path) -> subprocess.Popen:
  """Starts in its own process group (to signal the whole run), output to a file."""
  with output.open("w") as sink:
    return subprocess.Popen(command, cwd=REPO, env=env(processes=process_count(command)), stdout=sink,
                            stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_for_step(output: pathlib.Path, step: int, process: subprocess.Popen, timeout: float = 600) -> int:
  """Waits until the run writing `output` prints its progress line of train step >= `step` (process 0's
  lines, which are not prefixed); returns the newest step printed."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    assert process.poll() is None, (f"the run ended (status {process.returncode}) before step {step}:\n"
                                    + output.read_text()[-3000:])
    printed = [int(n) for n in re.findall(r"^step +(\d+)/\d+ +loss", output.read_text(), re.MULTILINE)]
    if printed and max(printed) >= step:
      return max(printed)
    time.sleep(0.05)
  raise AssertionError(f"no step {step} within {timeout}s:\n" + output.read_text()[-3000:])


def last_step(workdir: pathlib.Path) -> int:
  steps = [r["step"] for r in records(workdir) if r["kind"] == "train"] if (workdir / "metrics.jsonl").exists() else []
  return max(steps, default=0)


def records(workdir: pathlib.Path, kinds=("train", "eval")) -> list[dict]:
  """The complete metrics.jsonl records of these kinds, deterministic fields only."""
  out = []
  for line in (workdir / "metrics.jsonl").read_text().splitlines(keepends=True):
    if not line.endswith("\n"):
      continue  # a line still being written
    record = json.loads(line)
    if record["kind"] in kinds:
      out.append({k: v for k, v in record.items()
                  if k in DETERMINISTIC or k in ("step", "kind") or k.startswith(PER_DATASET)})
  return out


def checkpoint_arrays(workdir: pathlib.Path, step: int) -> dict[str, np.ndarray]:
  """Every array of the TrainState saved at `step` (and of its error-feedback residual, where it has one),
  by path, read back as numpy."""
  import orbax.checkpoint as ocp

  arrays = {}
  for item in ("state", "grad_residual"):
    path = workdir / "checkpoints" / str(step) / item
    if not path.is_dir():
      continue
    with ocp.PyTreeCheckpointer() as checkpointer:
      tree = checkpointer.metadata(path).item_metadata.tree
      restored = checkpointer.restore(
          path, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
    prefix = "" if item == "state" else item
    arrays |= {prefix + jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(restored)[0]}
  return arrays


def assert_bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
  assert a.keys() == b.keys()
  different = [name for name in a if not np.array_equal(a[name], b[name])]
  assert not different, f"{len(different)} arrays differ, e.g. {different[:3]}"


def child_pid(launcher_pid: int, process_id: int) -> int:
  """The pid of the launcher's child that runs --process_id=<process_id>."""
  for _ in range(100):
    for pid in os.listdir("/proc"):
      if pid.isdigit():
        try:
          with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
          with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
          continue
        if parent == launcher_pid and f"--process_id={process_id}".encode() in args:
          return int(pid)
    time.sleep(0.1)
  raise AssertionError(f"no process {process_id} under the launcher")
