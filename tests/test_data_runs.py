"""`python -m experiments.train` on a mixture of tokenized datasets, killed and resumed on another process count.

Two byte-level datasets written by experiments.tokenize's library (letters a-m and n-z, so a row's dataset
shows in its tokens), mixed 0.75 / 0.25. A one-process run on 8 devices is the reference; a second run is
killed with SIGKILL after its step-4 checkpoint and finished by 2 processes x 4 devices (with an unfinished
save to set aside first). The per-dataset
token counts in metrics.jsonl must equal the mixture's exact counts (mixture.py) at every step, in both runs;
the losses must match the reference (the processes split the same batches); the eval records must hold each
dataset's loss and their weighted mean.
"""

import os
import signal

import numpy as np
import pytest

from meshmoe.data import tokenizing
from meshmoe.data.mixture import Mixture
from tests import runs
from tests.tolerances import FP32_MODEL_RTOL

STEPS, BATCH, SEQ_LEN = 8, 8, 64
WEIGHTS = {"first": 0.75, "second": 0.25}


def _dataset(tmp_path, name: str, letters: str, seed: int) -> str:
  rng = np.random.default_rng(seed)
  docs = ["".join(rng.choice(list(letters + " "), int(rng.integers(50, 400)))) for _ in range(300)]
  for i, doc in enumerate(docs):  # one file per document: text files are documents
    (tmp_path / f"{name}-{i:03d}.txt").write_text(doc)
  tokenizing.tokenize_corpus(tmp_path / name, source="text", paths=str(tmp_path / f"{name}-*.txt"),
                             eval_fraction=0.1, log=lambda _: None)
  return str(tmp_path / name)


def _flags(tmp_path) -> list[str]:
  folders = {"first": _dataset(tmp_path, "first", "abcdefghijklm", 0),
             "second": _dataset(tmp_path, "second", "nopqrstuvwxyz", 1)}
  paths = ",".join(f"{name}={folders[name]}:{weight}" for name, weight in WEIGHTS.items())
  return [*runs.SMALL_FLAGS, f"--config.train.steps={STEPS}", "--config.checkpoint.every_steps=2",
          "--config.train.eval_every=4", "--config.data.source=tokenized", f"--config.data.paths={paths}"]


@pytest.mark.slow
def test_a_mixture_killed_and_resumed_on_two_processes(tmp_path):
  flags = _flags(tmp_path)
  reference = tmp_path / "reference"
  runs.run(runs.train_command(reference, *flags))

  workdir, log = tmp_path / "killed", tmp_path / "killed.log"
  process = runs.start(runs.train_command(workdir, *flags), log)
  runs.wait_for_step(log, 5, process)  # the step-4 checkpoint has been started
  os.killpg(process.pid, signal.SIGKILL)
  process.wait()
  assert runs.last_step(workdir) < STEPS
  # An unfinished save, as a kill during a save leaves (this one's may have finished): both processes must
  # agree to set it aside before either restores (a process that does not leaves the other waiting: a hang).
  (workdir / "checkpoints" / "7.orbax-checkpoint-tmp-1").mkdir()
  result = runs.run(runs.launch_command(workdir, *flags, processes=2, devices=4))
  assert "resuming from the checkpoint of step" in result.stdout
  assert "moved the unfinished save 7.orbax-checkpoint-tmp-1" in result.stdout

  expected = Mixture(list(WEIGHTS.values())).counts(np.arange(1, STEPS + 1) * BATCH) * SEQ_LEN
  mine, theirs = runs.records(workdir), runs.records(reference)
  assert [(r["kind"], r["step"]) for r in mine] == [(r["kind"], r["step"]) for r in theirs]
  for run in (mine, theirs):
    train = [r for r in run if r["kind"] == "train"]
    assert [[r[f"tokens/{name}"] for name in WEIGHTS] for r in train] == expected.tolist()
    for record in (r for r in run if r["kind"] == "eval"):
      assert record["loss"] == pytest.approx(sum(w * record[f"loss/{n}"] for n, w in WEIGHTS.items()), rel=1e-12)
  for record, reference_record in zip(mine, theirs, strict=True):
    for field in ("loss", "cross_entropy", "grad_norm", "loss/first", "loss/second"):
      if field in reference_record:
        assert record[field] == pytest.approx(reference_record[field], rel=FP32_MODEL_RTOL), (record["step"], field)
