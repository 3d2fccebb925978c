"""End-to-end runs of `python -m experiments.train` in subprocesses on 8 simulated CPU devices.

Covers: the loss falls on the embedded corpus; a run killed with SIGKILL and restarted on its workdir
continues with bitwise the same metrics as an uninterrupted run; a checkpoint restored onto another mesh
layout continues with the same losses (float tolerance); bad flags give one clear error.
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
# Fields that depend only on the computation (not on wall-clock time).
DETERMINISTIC = ("loss", "cross_entropy", "aux_loss", "z_loss", "grad_norm", "learning_rate",
                 "expert_load_imbalance", "dropped_fraction")
STEPS, EVERY = 24, 8
RUN_FLAGS = [f"--config.train.steps={STEPS}", f"--config.checkpoint.every_steps={EVERY}",
             "--config.train.log_every=1", "--config.train.eval_every=8", "--config.train.eval_batches=2",
             "--config.sample.max_new_tokens=8", "--config.train.profile_steps=2:4",
             "--config.checkpoint.keep=2"]


def _env() -> dict:
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  env["JAX_PLATFORMS"] = "cpu"
  return env


def _command(workdir: pathlib.Path, *flags: str) -> list[str]:
  return [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *RUN_FLAGS, *flags]


def _train(workdir: pathlib.Path, *flags: str) -> subprocess.CompletedProcess:
  result = subprocess.run(_command(workdir, *flags), cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result


def _records(workdir: pathlib.Path) -> list[dict]:
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [{k: v for k, v in json.loads(line).items() if k in DETERMINISTIC or k in ("step", "kind")}
          for line in lines]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> pathlib.Path:
  workdir = tmp_path_factory.mktemp("uninterrupted")
  _train(workdir)
  return workdir


@pytest.mark.slow
def test_run_writes_everything_and_the_loss_falls(uninterrupted):
  records = _records(uninterrupted)
  train = [r for r in records if r["kind"] == "train"]
  assert [r["step"] for r in train] == list(range(1, STEPS + 1))
  assert train[-1]["loss"] < train[0]["loss"] - 1.5, (train[0]["loss"], train[-1]["loss"])
  evals = [r for r in records if r["kind"] == "eval"]
  assert [r["step"] for r in evals] == [8, 16, 24]
  assert evals[-1]["loss"] < evals[0]["loss"]
  first = json.loads((uninterrupted / "metrics.jsonl").read_text().splitlines()[0])
  for key in ("step_time_s", "tokens_per_s", "grad_norm", "learning_rate", "expert_load_imbalance"):
    assert key in first
  kept = sorted(int(p.name) for p in (uninterrupted / "checkpoints").iterdir() if p.name.isdigit())
  assert kept == [16, 24]  # keep=2: the step-8 checkpoint was deleted
  assert list((uninterrupted / "tensorboard").iterdir())
  assert (uninterrupted / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "--- greedy ---" in (uninterrupted / "sample.txt").read_text()
  assert list((uninterrupted / "profile").rglob("*.xplane.pb")), "no profiler trace for steps 2-3"


@pytest.mark.slow
def test_kill_9_and_restart_continues_bitwise(uninterrupted, tmp_path):
  workdir = tmp_path / "killed"
  process = subprocess.Popen(_command(workdir), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
  checkpoint = workdir / "checkpoints" / str(EVERY)
  deadline = time.time() + 300
  while not checkpoint.is_dir() and time.time() < deadline and process.poll() is None:
    time.sleep(0.05)
  assert process.poll() is None, "the run ended before it could be killed"
  process.send_signal(signal.SIGKILL)
  process.wait()
  killed_at = [r["step"] for r in _records(workdir) if r["kind"] == "train"][-1]
  assert killed_at < STEPS

  result = _train(workdir)
  assert "resumed from step" in result.stdout
  assert _records(workdir) == _records(uninterrupted)


@pytest.mark.slow
def test_restore_onto_another_layout(uninterrupted, tmp_path):
  workdir = tmp_path / "relayout"
  # The data=8 run's step-16 checkpoint, as if the run had stopped there, continued on data=2 x expert=4.
  shutil.copytree(uninterrupted / "checkpoints" / str(2 * EVERY), workdir / "checkpoints" / str(2 * EVERY))
  shutil.copy(uninterrupted / "metrics.jsonl", workdir / "metrics.jsonl")
  result = _train(workdir, "--config.mesh.data=2", "--config.mesh.expert=4")
  assert f"resumed from step {2 * EVERY}" in result.stdout
  moved = {(r["kind"], r["step"]): r for r in _records(workdir)}
  reference = {(r["kind"], r["step"]): r for r in _records(uninterrupted)}
  assert moved.keys() == reference.keys()
  for key, record in reference.items():
    for field in ("loss", "cross_entropy"):
      if field in record:
        assert moved[key][field] == pytest.approx(record[field], rel=1e-4), (key, field)


@pytest.mark.parametrize("flags, message", [
    (["--config.mesh.expertt=2"], "unknown config override: field 'expertt' does not exist in MeshConfig"),
    (["--config.model.moe.top_k=9"], "error: config.model.moe.top_k=9 is invalid: at most"),
    (["--config.mesh.expert=3"], "error: config.mesh.data=-1 is invalid"),
    (["--config.data.source=jsonl", "--config.data.paths=/nonexistent/*.jsonl"], "/nonexistent/*.jsonl"),
])
def test_bad_flags_give_one_clear_error(tmp_path, flags, message):
  result = subprocess.run(_command(tmp_path / "bad", *flags), cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=300)
  assert result.returncode != 0
  assert message in result.stderr, result.stderr[-2000:]
  assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_missing_config_file_is_named(tmp_path):
  result = subprocess.run([sys.executable, "-m", "experiments.train", "--config=experiments/configs/nope.py",
                           f"--workdir={tmp_path}"], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=120)
  assert result.returncode != 0
  assert "error: --config file 'experiments/configs/nope.py' does not exist; available:" in result.stderr
  assert "experiments/configs/tiny_moe.py" in result.stderr and "Traceback" not in result.stderr
