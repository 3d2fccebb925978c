"""How well the device timelines name a slow device, and what sampling them costs (src/runtime/device_timeline.py).

  .venv/bin/python -m experiments.benchmarks.device_timeline [--config=tiny_moe] [--slowdowns=0.3,0.5,1.0]
      [--repeats=3] [--unperturbed_samples=20] [--overhead_steps=150] [--workdir=/tmp/device_timeline]

Every run is `experiments.train` on 8 simulated CPU devices (one process), sampling every 2 steps:
1. unperturbed: `--unperturbed_samples` samples; how many name a device (false positives), the median
   measured step (unsampled steps) and the median device's compute per step;
2. per slowdown s and repeat: device 5 sleeps s x that compute in every step (resilience.debug_slow_device):
   whether it is named, as slow compute, within 3 samples, and the modelled step without it against the
   unperturbed run's measured step (a model checked against a measurement);
3. overhead: `--overhead_steps` steps without sampling and with a sample every 50 steps; the mean step time
   of each (measured, every step counted, the sampled ones included).
"""

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

from absl import app, flags

_CONFIG = flags.DEFINE_string("config", "tiny_moe", "a config of experiments/configs")
_SLOWDOWNS = flags.DEFINE_list("slowdowns", ["0.3", "0.5", "1.0"], "how much slower the device computes")
_REPEATS = flags.DEFINE_integer("repeats", 3, "runs per slowdown", lower_bound=1)
_UNPERTURBED = flags.DEFINE_integer("unperturbed_samples", 20, "samples of the run without injection", lower_bound=1)
_OVERHEAD_STEPS = flags.DEFINE_integer("overhead_steps", 150, "steps of each overhead run (0: skip)", lower_bound=0)
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/device_timeline", "one sub-folder per run")
SLOW_DEVICE = 5
COMMON = ["--config.train.log_every=1", "--config.train.eval_every=0", "--config.checkpoint.every_steps=-1",
          "--config.sample.max_new_tokens=0"]


def train(workdir: pathlib.Path, *overrides: str) -> list[dict]:
  shutil.rmtree(workdir, ignore_errors=True)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, "-m", "experiments.train", f"--config=experiments/configs/{_CONFIG.value}.py",
                  f"--workdir={workdir}", *COMMON, *overrides], check=True, env=env, stdout=subprocess.DEVNULL)
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def of_kind(records: list[dict], kind: str) -> list[dict]:
  return [r for r in records if r["kind"] == kind]


def main(argv):
  del argv
  root = pathlib.Path(_WORKDIR.value)
  n = _UNPERTURBED.value
  records = train(root / "unperturbed", f"--config.train.steps={2 * n + 1}", "--config.resilience.timeline_every_steps=2")
  samples = of_kind(records, "devices")
  step_s = statistics.median(r["step_time_s"] for r in of_kind(records, "train") if r["step"] % 2 and r["step"] > 1)
  compute_s = statistics.median(statistics.median(r["compute_s"]) for r in samples)
  named = [r for r in samples if r["named"] != -1]
  print(f"unperturbed: {len(samples)} samples, {len(named)} name a device (false positives), "
        f"{sum(r['flagged'] != -1 for r in samples)} flag one; measured step {step_s:.3f} s; median device "
        f"compute {compute_s:.3f} s per step")
  print("| slowdown | sleep s | named within 3 samples | at sample | modelled step without it, against the "
        "unperturbed measured step |")
  print("|---|---|---|---|---|")
  for slowdown in map(float, _SLOWDOWNS.value):
    sleep = slowdown * compute_s
    found, errors, at = 0, [], []
    for repeat in range(_REPEATS.value):
      run = of_kind(train(root / f"slow_{slowdown}_{repeat}", "--config.train.steps=7",
                          "--config.resilience.timeline_every_steps=2",
                          f"--config.resilience.debug_slow_device={SLOW_DEVICE}",
                          f"--config.resilience.debug_slow_device_s={sleep}"), "devices")
      first = next((i for i, r in enumerate(run[:3]) if r["named"] != -1), None)
      if first is not None and (run[first]["named"], run[first]["named_kind"]) == (SLOW_DEVICE, "compute"):
        found += 1
        at.append(first + 1)
        errors.append(run[first]["step_without_s_modelled"] / step_s - 1)
    error_text = ", ".join(f"{e:+.0%}" for e in errors) or "-"
    print(f"| {slowdown:.0%} | {sleep:.3f} | {found}/{_REPEATS.value} | {', '.join(map(str, at)) or '-'} | "
          f"{error_text} |")
  if _OVERHEAD_STEPS.value:
    steps = _OVERHEAD_STEPS.value
    means = {}
    for every in (0, 50):
      run = of_kind(train(root / f"overhead_{every}", f"--config.train.steps={steps}",
                          f"--config.resilience.timeline_every_steps={every}"), "train")
      means[every] = statistics.mean(r["step_time_s"] for r in run if r["step"] > 1)
    print(f"overhead of a sample every 50 steps over {steps} steps: mean step {means[0]:.3f} s without, "
          f"{means[50]:.3f} s with ({means[50] / means[0] - 1:+.1%}; measured)")


if __name__ == "__main__":
  app.run(main)
