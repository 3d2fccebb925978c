"""Capped MoE receive buffers on CPU (`parallel.moe_buffer_factor`): how often routing overflows them as a
run trains, what the fallback costs, and what the buffers use.

  .venv/bin/python -m experiments.benchmarks.moe_buffers [--config=experiments/configs/tiny_moe.py]
      [--steps=300] [--factors=0,1.5,2,3] [--workdir=/tmp/moe_buffers_bench]

One run of experiments.train per factor (0: the dropless worst case), each on 8 simulated CPU devices with
the same seed and data. Read from each run's metrics.jsonl (measured): the steps redone by the dropless
fallback, in total and in each quarter of the run; the fullest buffer's use per logged step (median and
largest, over layers and steps); the median step time of the steps without a fallback, and of those with
one (a fallback step is the capped attempt plus the worst-case step; the first also compiles the
fallback). The runs log every step. On CPU the padded exchange moves the worst-case slots whatever the cap
(sharding/expert_parallel.py), so this measures the fallback's rate and cost, not the memory saved: that is
a GPU compile's (RESULTS.md: experiments.aot with and without the factor).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "experiments/configs/tiny_moe.py", "experiment config file")
_STEPS = flags.DEFINE_integer("steps", 300, "steps per run", lower_bound=4)
_FACTORS = flags.DEFINE_list("factors", ["0", "1.5", "2", "3"], "parallel.moe_buffer_factor of each run")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/moe_buffers_bench", "scratch folder (one run per factor)")


def _run(factor: str, workdir: pathlib.Path) -> list[dict]:
  shutil.rmtree(workdir, ignore_errors=True)
  command = [sys.executable, "-m", "experiments.train", f"--config={_CONFIG.value}", f"--workdir={workdir}",
             f"--config.train.steps={_STEPS.value}", "--config.train.log_every=1", "--config.train.eval_every=0",
             "--config.checkpoint.every_steps=-1", "--config.sample.max_new_tokens=0",
             f"--config.parallel.moe_buffer_factor={factor}"]
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8 " + os.environ.get("XLA_FLAGS", ""),
         "JAX_PLATFORMS": "cpu"}
  result = subprocess.run(command, env=env, capture_output=True, text=True)
  if result.returncode:
    sys.exit(f"factor {factor}: the run failed:\n{result.stdout[-2000:]}{result.stderr[-3000:]}")
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [r for r in records if r["kind"] == "train"]


def _summary(factor: str, train: list[dict]) -> dict:
  fallbacks = np.diff([0] + [r.get("moe_fallback_steps", 0) for r in train])
  times = np.array([r["step_time_s"] for r in train])[1:]  # the first step compiles
  redone = fallbacks[1:] > 0
  uses = [max(r["moe_buffer_use"]) for r in train] if "moe_buffer_use" in train[0] else []
  quarters = [int(part.sum()) for part in np.array_split(fallbacks, 4)]
  return {"factor": float(factor), "steps": len(train), "fallback_steps": int(fallbacks.sum()),
          "fallbacks_per_quarter": quarters, "final_loss": train[-1]["loss"],
          "buffer_use_median": float(np.median(uses)) if uses else None,
          "buffer_use_max": float(np.max(uses)) if uses else None,
          "step_s_median": float(np.median(times[~redone])) if (~redone).any() else None,
          "fallback_step_s_median": float(np.median(times[redone])) if redone.any() else None}


def main(argv):
  del argv
  rows = []
  for factor in _FACTORS.value:
    rows.append(_summary(factor, _run(factor, pathlib.Path(_WORKDIR.value) / f"factor_{factor}")))
    print(json.dumps(rows[-1]), flush=True)
  print("\n| factor | fallback steps (per quarter) | buffer use, median / max | step s, median | with a fallback | final loss |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    print(f"| {r['factor']:g} | {r['fallback_steps']} ({', '.join(map(str, r['fallbacks_per_quarter']))}) | "
          f"{fmt(r['buffer_use_median'], '.2f')} / {fmt(r['buffer_use_max'], '.2f')} | "
          f"{fmt(r['step_s_median'], '.3f')} | {fmt(r['fallback_step_s_median'], '.3f')} | {r['final_loss']:.4f} |")


if __name__ == "__main__":
  app.run(main)
