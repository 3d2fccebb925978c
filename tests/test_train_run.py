"""End-to-end runs of `python -m experiments.train` in subprocesses on 8 simulated CPU devices.

Covers: the loss falls on the embedded corpus; a run killed with SIGKILL at three random steps in turn and
restarted each time on its workdir ends with bitwise the same metrics and parameters as an uninterrupted
run; a finished run run again trains nothing and says so; a checkpoint restored onto another mesh layout
continues with the same losses (float tolerance); bad flags give one clear error.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys

import pytest

from tests import runs
from tests.runs import EVERY, REPO, STEPS

_env, _records = runs.env, runs.records


def _command(workdir, *flags):
  return runs.train_command(workdir, *runs.REFERENCE_FLAGS, *flags)


def _train(workdir, *flags):
  return runs.run(_command(workdir, *flags))


@pytest.mark.slow
def test_run_writes_everything_and_the_loss_falls(reference_run):
  uninterrupted = reference_run
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
  plan = json.loads((uninterrupted / "plan.json").read_text())  # what ran, op by op
  assert plan["preset"] == "ep" and plan["ops"]["moe"]["implementation"] == "all_to_all"  # expert=8: exchanged
  assert plan["ops"]["moe"]["grouped_gemm"] == "blocked"  # "auto" on CPU


@pytest.mark.slow
def test_a_finished_run_run_again_compiles_no_train_step_and_reports_its_last_loss(reference_run, tmp_path):
  """Running a finished run's command again (what a requeued job or a second try does) resumes from the last
  checkpoint with nothing to train: no train step is compiled, the metrics stay as they were, and the final
  train loss printed is the last logged one (it was NaN before)."""
  workdir = tmp_path / "run"
  shutil.copytree(reference_run, workdir)
  before = (workdir / "metrics.jsonl").read_bytes()
  result = _train(workdir)
  assert f"resuming from the checkpoint of step {STEPS}" in result.stdout
  assert f"the run has already trained its {STEPS} steps" in result.stdout and "steps to go" not in result.stdout
  last = [r for r in _records(workdir) if r["kind"] == "train"][-1]
  assert f"final train loss {last['loss']:.3f}," in result.stdout, result.stdout[-2000:]
  assert (workdir / "metrics.jsonl").read_bytes() == before


@pytest.mark.slow
def test_kill_9_at_three_random_steps_resumes_bitwise(reference_run, tmp_path):
  seed = int(os.environ.get("MESHMOE_KILL_SEED", random.randrange(10_000)))
  kill_steps = sorted(random.Random(seed).sample(range(2, STEPS), 3))
  print(f"kill steps {kill_steps} (MESHMOE_KILL_SEED={seed} repeats them)")
  workdir = tmp_path / "killed"
  newest_checkpoint = None
  for number, target in enumerate(kill_steps):
    process = runs.start(_command(workdir), tmp_path / f"attempt{number}.log")
    runs.wait_for_step(tmp_path / f"attempt{number}.log", target, process)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    log = (tmp_path / f"attempt{number}.log").read_text()
    _assert_resumed_from(log, newest_checkpoint)
    killed_at = runs.last_step(workdir)
    newest_checkpoint = max((int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()),
                            default=None)
    print(f"killed at step {killed_at}; newest checkpoint {newest_checkpoint}")
    assert killed_at < STEPS

  result = _train(workdir)
  _assert_resumed_from(result.stdout, newest_checkpoint)
  assert _records(workdir) == _records(reference_run)
  runs.assert_bitwise_equal(runs.checkpoint_arrays(workdir, STEPS), runs.checkpoint_arrays(reference_run, STEPS))


def _assert_resumed_from(log: str, step: int | None) -> None:
  resumed = re.findall(r"resuming from the checkpoint of step (\d+)", log)
  assert resumed == ([] if step is None else [str(step)]), log[-3000:]


@pytest.mark.slow
def test_restore_onto_another_layout(reference_run, tmp_path):
  uninterrupted = reference_run
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
    (["--config.mesh.expertt=2"], "unknown config override: field 'expertt' does not exist in MeshConfig; "
                                  "did you mean --config.mesh.expert? MeshConfig's fields: data, expert, tensor,"),
    (["--config.moe.top_k=2"], "--config.moe.top_k names no config field; did you mean --config.model.moe.top_k?"),
    (["--config.model.moe.top_k=9"], "error: config.model.moe.top_k=9 is invalid: at most"),
    (["--config.mesh.data=3"], "error: config.mesh.expert=-1 is invalid"),  # 8 devices leave no whole expert axis
    (["--config.data.source=jsonl", "--config.data.paths=/nonexistent/*.jsonl"], "/nonexistent/*.jsonl"),
])
def test_bad_flags_give_one_clear_error(tmp_path, flags, message):
  result = subprocess.run(runs.train_command(tmp_path / "bad", *runs.REFERENCE_FLAGS, *flags), cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=300)
  assert result.returncode != 0
  assert message in result.stderr, result.stderr[-2000:]
  assert "Traceback" not in result.stderr, result.stderr[-2000:]


def test_workdir_that_cannot_be_a_folder_is_named(tmp_path):
  a_file = tmp_path / "a_file"
  a_file.write_text("kept")
  result = subprocess.run(runs.train_command(a_file / "run", *runs.REFERENCE_FLAGS), cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert f"error: --workdir={a_file}/run cannot be written ({a_file} is a file, not a folder)" in result.stderr
  assert a_file.read_text() == "kept"


def test_missing_config_file_is_named(tmp_path):
  result = subprocess.run([sys.executable, "-m", "experiments.train", "--config=experiments/configs/nope.py",
                           f"--workdir={tmp_path}"], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=120)
  assert result.returncode != 0
  assert "error: --config file 'experiments/configs/nope.py' does not exist; available:" in result.stderr
  assert "experiments/configs/tiny_moe.py" in result.stderr and "Traceback" not in result.stderr
