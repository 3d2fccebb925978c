"""Convergence with compressed communication: tiny_moe's final eval loss, exact against each compressed option.

  .venv/bin/python -m experiments.benchmarks.compression_convergence [--steps=300] [--variants=a,b]
      [--seeds=0,1] [--workdir=/tmp/compression_convergence]

Trains tiny_moe (8 simulated CPU devices, `ep` preset over data=2 x expert=4, the xla tier) once per variant
and seed, each in a fresh process, and prints each run's final eval loss (measured: read from its
metrics.jsonl) and its difference from the exact run of the same seed; then, per variant, the mean
difference over the seeds, and the exact runs' spread across seeds (how far any perturbation can move a
300-step run). The target (issue: compressed communication) is within 0.02 nats of the exact run.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

from absl import app, flags

FP8 = "float8_e4m3fn"
# name -> config overrides on top of the exact run's
VARIANTS = {
    "exact": [],
    "bf16_dispatch": ["--config.parallel.moe_dispatch_dtype=bfloat16"],
    "fp8_dispatch": [f"--config.parallel.moe_dispatch_dtype={FP8}"],
    "fp8_combine": [f"--config.parallel.moe_combine_dtype={FP8}"],
    "fp8_exchanges_and_grads": [f"--config.parallel.moe_dispatch_dtype={FP8}",
                                f"--config.parallel.moe_combine_dtype={FP8}",
                                f"--config.parallel.moe_exchange_grad_dtype={FP8}"],
}
# Experts over 4 devices (tiny_moe's default mesh is data-parallel only: nothing would be exchanged).
COMMON = ["--config=experiments/configs/tiny_moe.py", "--config.mesh.data=2", "--config.mesh.expert=4",
          "--config.parallel.impl=xla", "--config.train.log_every=50",
          "--config.train.eval_batches=16",
          "--config.sample.max_new_tokens=0", "--config.checkpoint.every_steps=0"]

_STEPS = flags.DEFINE_integer("steps", 300, "training steps of every run")
_VARIANTS = flags.DEFINE_list("variants", list(VARIANTS), f"which runs, of {', '.join(VARIANTS)}")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "training seeds; every variant runs with each")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/compression_convergence", "one sub-folder per run (replaced)")


def final_eval_loss(workdir: pathlib.Path) -> float:
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  return [r for r in records if r.get("kind") == "eval"][-1]["loss"]


def run(name: str, seed: str, steps: int, root: pathlib.Path) -> tuple[float, float]:
  workdir = root / f"{name}_seed{seed}"
  subprocess.run(["rm", "-rf", str(workdir)], check=True)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  start = time.perf_counter()
  subprocess.run([sys.executable, "-m", "experiments.train", *COMMON, f"--workdir={workdir}",
                  f"--config.train.steps={steps}", f"--config.train.eval_every={steps}", f"--config.train.seed={seed}",
                  *VARIANTS[name]],
                 check=True, env=env, stdout=subprocess.DEVNULL)
  return final_eval_loss(workdir), time.perf_counter() - start


def main(argv):
  del argv
  unknown = set(_VARIANTS.value) - set(VARIANTS)
  if unknown:
    raise app.UsageError(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
  root = pathlib.Path(_WORKDIR.value)
  names = ["exact"] + [n for n in _VARIANTS.value if n != "exact"]
  results = {(name, seed): run(name, seed, _STEPS.value, root) for seed in _SEEDS.value for name in names}
  print(f"tiny_moe, {_STEPS.value} steps, final eval loss (measured, nats), difference from the exact run:")
  for (name, seed), (loss, seconds) in results.items():
    print(f"  {name:26s} seed {seed}  {loss:.4f}  {loss - results['exact', seed][0]:+.4f}  ({seconds:.0f} s)")
  print("mean difference over the seeds:")
  for name in names[1:]:
    differences = [results[name, seed][0] - results["exact", seed][0] for seed in _SEEDS.value]
    print(f"  {name:26s} {sum(differences) / len(differences):+.4f}")
  exact = [results["exact", seed][0] for seed in _SEEDS.value]
  print(f"exact runs across seeds: {min(exact):.4f} to {max(exact):.4f} (spread {max(exact) - min(exact):.4f})")


if __name__ == "__main__":
  app.run(main)
