"""Convergence of the training recipes: eval-loss curves per optimizer, schedule and balance loss, over seeds.

  .venv/bin/python -m experiments.benchmarks.recipe_convergence [--configs=tiny_moe,maxtext_tiny_moe]
      [--variants=adamw,muon] [--seeds=0,1,2,3] [--steps=300] [--workdir=/tmp/recipe_convergence]
      [--plot=recipe_convergence.png]

Trains each config once per variant and seed on one CPU device (the stdlib corpus; each run in a fresh
process, `experiments.train`), reads every run's eval losses from its metrics.jsonl (measured), and
prints per config and variant the mean final eval loss over the seeds with its spread and its difference
from AdamW's (the default recipe: warmup + cosine, batch balance loss), and, for every variant, at
each evaluation the mean eval loss. `--plot` draws the mean curves with their min-max bands, one panel
per config. Each variant changes one thing of the default recipe (VARIANTS), except global_batch_balance,
which changes one thing of micro_batches; the learning rates of the other optimizers follow their own
guidance, not a sweep (the README says which).
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

from absl import app, flags

# name -> config overrides on top of the config's own recipe (AdamW, warmup + cosine, batch balance loss)
VARIANTS = {
    "adamw": [],
    # Moonlight's recipe: AdamW's rate and decay carry over at update RMS 0.2.
    "muon": ["--config.optimizer.name=muon"],
    # T5's relative step size (Adafactor scales each step by the weight's RMS).
    "adafactor": ["--config.optimizer.name=adafactor", "--config.optimizer.learning_rate=1e-2"],
    # Lion's paper: a rate 3x below AdamW's, decay 3x above (the same product), b2 = 0.99.
    "lion": ["--config.optimizer.name=lion", "--config.optimizer.learning_rate=1e-3",
             "--config.optimizer.weight_decay=0.3", "--config.optimizer.b2=0.99"],
    "wsd": ["--config.optimizer.schedule=wsd"],
    "constant": ["--config.optimizer.schedule=constant"],
    "sequence_balance": ["--config.model.moe.balance_loss=sequence"],
    # The step in 4 micro-batches (the same tokens and cross-entropy gradient): each micro-batch's loads
    # balanced on their own, or against the step's loads so far (global-batch balance). With one
    # micro-batch, as in the recipe itself, the two are the same loss.
    "micro_batches": ["--config.train.grad_accum_steps=4"],
    "global_batch_balance": ["--config.train.grad_accum_steps=4", "--config.model.moe.balance_loss=global_batch"],
}
CONFIGS = ("tiny_moe", "maxtext_tiny_moe")
# One device: the curves do not depend on the layout, and one CPU device trains these fastest.
COMMON = ["--config.mesh.data=1", "--config.mesh.expert=1", "--config.train.log_every=50",
          "--config.train.eval_batches=8", "--config.sample.max_new_tokens=0", "--config.checkpoint.every_steps=0"]

_CONFIGS = flags.DEFINE_list("configs", list(CONFIGS), "configs from experiments/configs")
_VARIANTS = flags.DEFINE_list("variants", list(VARIANTS), f"which recipes, of {', '.join(VARIANTS)}")
_SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2", "3"], "training seeds; every variant runs with each")
_STEPS = flags.DEFINE_integer("steps", 300, "training steps of every run", lower_bound=1)
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 50, "steps between evaluations", lower_bound=1)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/recipe_convergence", "one sub-folder per run")
_PLOT = flags.DEFINE_string("plot", "", "write the curves to this PNG")
_REUSE = flags.DEFINE_bool("reuse", False, "keep runs that finished before (their metrics are read again)")


def eval_curve(workdir: pathlib.Path) -> list[tuple[int, float]]:
  """(step, eval loss) of every evaluation a run's metrics.jsonl records."""
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
  return [(r["step"], r["loss"]) for r in records if r.get("kind") == "eval"]


def final_imbalance(workdir: pathlib.Path) -> float:
  """The last logged training step's expert-load imbalance (the step's busiest expert over the mean),
  averaged over the MoE layers."""
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
  last = [r["expert_load_imbalance"] for r in records if r.get("kind") == "train" and r.get("expert_load_imbalance")][-1]
  return sum(last) / len(last)


def run(config: str, name: str, seed: str, root: pathlib.Path) -> list[tuple[int, float]]:
  workdir = root / config / f"{name}_seed{seed}"
  done = (workdir / "metrics.jsonl").is_file() and any(s == _STEPS.value for s, _ in eval_curve(workdir))
  if not (_REUSE.value and done):
    shutil.rmtree(workdir, ignore_errors=True)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-m", "experiments.train", f"--config=experiments/configs/{config}.py",
                    *COMMON, f"--workdir={workdir}", f"--config.train.steps={_STEPS.value}",
                    f"--config.train.eval_every={_EVAL_EVERY.value}", f"--config.train.seed={seed}",
                    *VARIANTS[name]], check=True, env=env, stdout=subprocess.DEVNULL)
  return eval_curve(workdir)


def mean_curve(curves: list[list[tuple[int, float]]]) -> list[tuple[int, float, float, float]]:
  """(step, mean, min, max) over the seeds' curves, at the steps every one of them evaluated."""
  steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
  at = [dict(c) for c in curves]
  return [(s, sum(a[s] for a in at) / len(at), min(a[s] for a in at), max(a[s] for a in at)) for s in steps]


def main(argv):
  del argv
  unknown = (set(_VARIANTS.value) - set(VARIANTS)) | {f"config {c}" for c in set(_CONFIGS.value) - set(CONFIGS)}
  if unknown:
    raise app.UsageError(f"unknown {sorted(unknown)}; variants: {', '.join(VARIANTS)}; configs: {', '.join(CONFIGS)}")
  root = pathlib.Path(_WORKDIR.value)
  names = ["adamw"] + [n for n in _VARIANTS.value if n != "adamw"]
  curves = {(config, name): mean_curve([run(config, name, seed, root) for seed in _SEEDS.value])
            for config in _CONFIGS.value for name in names}
  imbalance = {(config, name): sum(final_imbalance(root / config / f"{name}_seed{seed}") for seed in _SEEDS.value)
               / len(_SEEDS.value) for config in _CONFIGS.value for name in names}
  seeds = len(_SEEDS.value)
  width = max(len(name) for name in names)
  for config in _CONFIGS.value:
    print(f"{config}, {_STEPS.value} steps, {seeds} seeds: final eval loss (measured, nats/token), mean [min, max], "
          "the mean's difference from AdamW's, and the last step's expert-load imbalance (busiest / mean, "
          "mean over layers and seeds)")
    base = curves[config, "adamw"][-1][1]
    for name in names:
      step, mean, low, high = curves[config, name][-1]
      print(f"  {name:{width}s} {mean:.4f} [{low:.4f}, {high:.4f}] {mean - base:+.4f}  {imbalance[config, name]:.3f}")
    steps = [s for s, *_ in curves[config, "adamw"]]
    print(f"  {'mean eval loss at steps':{width + 1}s}" + " ".join(f"{s:>6d}" for s in steps))
    for name in names:
      print(f"  {name:{width}s} " + " ".join(f"{m:6.3f}" for _, m, _, _ in curves[config, name]))
  if _PLOT.value:
    _plot(curves, names, pathlib.Path(_PLOT.value))


def _plot(curves, names, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  configs = list(dict.fromkeys(config for config, _ in curves))
  figure, axes = plt.subplots(1, len(configs), figsize=(6 * len(configs), 4), squeeze=False)
  for axis, config in zip(axes[0], configs):
    for name in names:
      steps, mean, low, high = zip(*curves[config, name])
      axis.plot(steps, mean, label=name)
      axis.fill_between(steps, low, high, alpha=0.15)
    axis.set(title=f"{config} (mean over {len(_SEEDS.value)} seeds, min-max band)", xlabel="step",
             ylabel="eval loss (nats/token, measured)")
    axis.legend(fontsize=8)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  print(f"plot: {path}")


if __name__ == "__main__":
  app.run(main)
