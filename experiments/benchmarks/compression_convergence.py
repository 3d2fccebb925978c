"""Convergence with compressed communication: tiny_moe's final eval loss, exact against each compressed option
(low-precision token exchanges, and compressed gradient sums with and without error feedback).

  .venv/bin/python -m experiments.benchmarks.compression_convergence [--steps=300] [--variants=a,b]
      [--seeds=0,1] [--workdir=/tmp/compression_convergence]

Trains tiny_moe (8 simulated CPU devices, `ep` preset over data=2 x expert=4, the xla tier) once per variant
and seed, each in a fresh process, and prints each run's final eval loss (measured: the run's closing
line) and its difference from the exact run of the same seed, and the same weights evaluated with
exact exchanges (the run resumed with the exact config: is the model worse, or only its compressed
evaluation?); then, per variant, the mean differences over the seeds, and the exact runs' spread across
seeds (how far any perturbation can move a 300-step run). The target (issue: compressed communication) is
within 0.02 nats of the exact run.
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

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
    # The routed experts' gradients summed over `data` compressed (sharding/gradient_sync.py).
    "grad_bf16": ["--config.parallel.gradient_compression=bfloat16"],
    "grad_int8": ["--config.parallel.gradient_compression=int8", "--config.parallel.gradient_error_feedback=true"],
    "grad_int8_no_feedback": ["--config.parallel.gradient_compression=int8",
                              "--config.parallel.gradient_error_feedback=false"],
    "grad_sign": ["--config.parallel.gradient_compression=sign", "--config.parallel.gradient_error_feedback=true"],
    "grad_sign_no_feedback": ["--config.parallel.gradient_compression=sign",
                              "--config.parallel.gradient_error_feedback=false"],
}
# Experts over 4 devices (tiny_moe's default mesh is data-parallel only: nothing would be exchanged).
COMMON = ["--config=experiments/configs/tiny_moe.py", "--config.mesh.data=2", "--config.mesh.expert=4",
          "--config.parallel.impl=xla", "--config.train.log_every=50",
          "--config.train.eval_batches=16",
          "--config.sample.max_new_tokens=0", "--config.checkpoint.every_steps=0"]

_STEPS = flags.DEFINE_integer("steps", 300, "training steps of every run")
_VARIANTS = flags.DEFINE_list("variants", list(VARIANTS), f"which runs, of {', '.join(VARIANTS)}")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "training seeds; every variant runs with each")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/compression_convergence", "one sub-folder per run")
_REUSE = flags.DEFINE_bool("reuse", False, "keep runs that finished before (the trainer resumes a finished run "
                           "and only evaluates it); default: every run trains from scratch")


def train(workdir: pathlib.Path, seed: str, steps: int, overrides: list[str]) -> float:
  """Runs experiments.train on `workdir` (training, or resuming a finished run, which only evaluates it) and
  returns the eval loss of its closing line ("final train loss ..., eval loss X nats/token")."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-m", "experiments.train", *COMMON, f"--workdir={workdir}",
                        f"--config.train.steps={steps}", f"--config.train.eval_every={steps}",
                        f"--config.train.seed={seed}", *overrides],
                       check=True, env=env, stdout=subprocess.PIPE, text=True).stdout
  return float(re.findall(r"eval loss ([0-9.]+) nats/token", out)[-1])


def run(name: str, seed: str, steps: int, root: pathlib.Path) -> tuple[float, float]:
  """(the final eval loss of variant `name`, of its trained weights evaluated with exact exchanges)."""
  workdir = root / f"{name}_seed{seed}"
  if not _REUSE.value:
    shutil.rmtree(workdir, ignore_errors=True)
  loss = train(workdir, seed, steps, VARIANTS[name])
  return loss, (train(workdir, seed, steps, []) if VARIANTS[name] else loss)


def main(argv):
  del argv
  unknown = set(_VARIANTS.value) - set(VARIANTS)
  if unknown:
    raise app.UsageError(f"--variants: unknown {sorted(unknown)}; known: {', '.join(VARIANTS)}")
  root = pathlib.Path(_WORKDIR.value)
  names = ["exact"] + [n for n in _VARIANTS.value if n != "exact"]
  results = {(name, seed): run(name, seed, _STEPS.value, root) for seed in _SEEDS.value for name in names}
  print(f"tiny_moe, {_STEPS.value} steps, final eval loss (measured, nats) and its difference from the exact run's;")
  print("then the same weights evaluated with exact exchanges:")
  for (name, seed), (loss, exact_eval) in results.items():
    exact = results["exact", seed][0]
    print(f"  {name:26s} seed {seed}  {loss:.4f} {loss - exact:+.4f}   "
          f"exact eval {exact_eval:.4f} {exact_eval - exact:+.4f}")
  print("mean difference over the seeds (as trained; evaluated exactly):")
  for name in names[1:]:
    trained, evaluated = ([results[name, seed][i] - results["exact", seed][0] for seed in _SEEDS.value] for i in (0, 1))
    print(f"  {name:26s} {sum(trained) / len(trained):+.4f}  {sum(evaluated) / len(evaluated):+.4f}")
  exact = [results["exact", seed][0] for seed in _SEEDS.value]
  print(f"exact runs across seeds: {min(exact):.4f} to {max(exact):.4f} (spread {max(exact) - min(exact):.4f})")


if __name__ == "__main__":
  app.run(main)
