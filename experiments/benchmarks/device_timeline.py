"""How well the device timelines name a slow device, and what sampling them costs (src/runtime/device_timeline.py).

  .venv/bin/python -m experiments.benchmarks.device_timeline [--config=tiny_moe] [--slowdowns=0.3,0.5,1.0]
      [--repeats=3] [--unperturbed_samples=20] [--overhead_steps=150] [--processes=1]
      [--workdir=/tmp/device_timeline]

Every run is `experiments.train` on 8 simulated CPU devices (one process, or two of 4 devices each through
`experiments.launch` with `--processes=2`), sampling every 3 steps (a sample at step 3k is read during step
3k + 1, so step 3k + 2 is an untraced step untouched by the sampling):
1. unperturbed: `--unperturbed_samples` samples; how many name a device (false positives), the median
   measured untraced step and traced step, and the median device's compute per step;
2. per slowdown s and repeat: device 5 (2049 with two processes) sleeps s x that compute in every step
   (resilience.debug_slow_device): whether it is named, as slow compute, within 3 samples; the modelled
   step without it against the unperturbed run's measured traced step (a model checked against a
   measurement of the same kind of step); and the measured untraced step with the slow device (what it
   really costs);
3. overhead: `--repeats` runs of `--overhead_steps` steps with a sample every 50 steps; what each sample
   adds to the measured time of the sampled step and the two after it (its reading runs beside them), over
   the run's median untraced step (sample_costs).
"""

import json
import math
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
_PROCESSES = flags.DEFINE_enum("processes", "1", ["1", "2"],
                               "the 8 simulated devices in 1 process, or in 2 processes of 4 (gloo)")
EVERY = 3
OVERHEAD_EVERY = 50
COMMON = ["--config.train.log_every=1", "--config.train.eval_every=0", "--config.checkpoint.every_steps=-1",
          "--config.sample.max_new_tokens=0"]


def slow_device() -> int:
  """The device slowed on purpose: one of process 0's 8, or process 1's second (JAX numbers a CPU
  process's devices from 2048 x its index)."""
  return 5 if _PROCESSES.value == "1" else 2049


def train(workdir: pathlib.Path, *overrides: str) -> list[dict]:
  shutil.rmtree(workdir, ignore_errors=True)
  flags_ = [f"--config=experiments/configs/{_CONFIG.value}.py", f"--workdir={workdir}", *COMMON, *overrides]
  if _PROCESSES.value == "1":
    command = [sys.executable, "-m", "experiments.train", *flags_]
  else:
    command = [sys.executable, "-m", "experiments.launch", "--processes=2", "--devices_per_process=4", "--", *flags_]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
  return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def of_kind(records: list[dict], kind: str) -> list[dict]:
  return [r for r in records if r["kind"] == kind]


def untraced(records: list[dict]) -> list[float]:
  """The measured times of the steps neither sampled nor beside a sample's reading."""
  return [r["step_time_s"] for r in of_kind(records, "train") if r["step"] % EVERY == 2 and r["step"] > EVERY]


def main(argv):
  del argv
  root = pathlib.Path(_WORKDIR.value)
  n = _UNPERTURBED.value
  records = train(root / "unperturbed", f"--config.train.steps={EVERY * n + 1}",
                  f"--config.resilience.timeline_every_steps={EVERY}")
  samples = of_kind(records, "devices")
  step_s = statistics.median(untraced(records))
  traced_s = statistics.median(r["traced_step_s_measured"] for r in samples)
  compute_s = statistics.median(statistics.median(r["compute_s"]) for r in samples)
  modelled = sorted(r["step_s_modelled"] / r["traced_step_s_measured"] for r in samples)
  named = [r for r in samples if r["named"] != -1]
  print(f"unperturbed: {len(samples)} samples, {len(named)} name a device (false positives), "
        f"{sum(r['flagged'] != -1 for r in samples)} flag one; measured: an untraced step {step_s:.3f} s, a traced one "
        f"{traced_s:.3f} s; median device compute {compute_s:.3f} s per step; modelled step / measured traced step "
        f"{modelled[0]:.2f}-{modelled[-1]:.2f} (median {statistics.median(modelled):.2f})")
  print("| slowdown | sleep s | named within 3 samples | at sample | modelled step without it, against the "
        "unperturbed run's measured traced step | measured untraced step with it |")
  print("|---|---|---|---|---|---|")
  for slowdown in map(float, _SLOWDOWNS.value):
    sleep = slowdown * compute_s
    found, errors, at, slowed_steps = 0, [], [], []
    for repeat in range(_REPEATS.value):
      records = train(root / f"slow_{slowdown}_{repeat}", f"--config.train.steps={3 * EVERY + 1}",
                      f"--config.resilience.timeline_every_steps={EVERY}",
                      f"--config.resilience.debug_slow_device={slow_device()}",
                      f"--config.resilience.debug_slow_device_s={sleep}")
      run = of_kind(records, "devices")
      slowed_steps += untraced(records)
      first = next((i for i, r in enumerate(run[:3]) if r["named"] != -1), None)
      if first is not None and (run[first]["named"], run[first]["named_kind"]) == (slow_device(), "compute"):
        found += 1
        at.append(first + 1)
        errors.append(run[first]["step_without_s_modelled"] / traced_s - 1)
    error_text = ", ".join(f"{e:+.0%}" for e in errors) or "-"
    slowed = statistics.median(slowed_steps)
    print(f"| {slowdown:.0%} | {sleep:.3f} | {found}/{_REPEATS.value} | {', '.join(map(str, at)) or '-'} | "
          f"{error_text} | {slowed:.3f} s ({slowed / step_s - 1:+.0%}) |")
  if _OVERHEAD_STEPS.value:
    costs, steps = [], []
    for repeat in range(_REPEATS.value):
      run = of_kind(train(root / f"overhead_{repeat}", f"--config.train.steps={_OVERHEAD_STEPS.value}",
                          f"--config.resilience.timeline_every_steps={OVERHEAD_EVERY}"), "train")
      cost, step = sample_costs({r["step"]: r["step_time_s"] for r in run})
      costs += cost
      steps.append(step)
    cost, step = statistics.median(costs), statistics.median(steps)
    print(f"overhead: {len(costs)} samples cost {min(costs):.3f}-{max(costs):.3f} s each (median {cost:.3f} s) over an "
          f"untraced step of {step:.3f} s: {cost / (OVERHEAD_EVERY * step):.1%} of the step time at a sample every "
          f"{OVERHEAD_EVERY} steps, under 2% from a sample every {math.ceil(cost / (0.02 * step))} steps (measured)")


def sample_costs(times: dict[int, float]) -> tuple[list[float], float]:
  """What each sample of a run sampling every OVERHEAD_EVERY steps costs: the measured time of the sampled
  step and the two after it (its reading runs beside them) above the run's median untraced step; and that
  median. Within one run, so a slower spell of the machine between runs does not enter it."""
  near = {s + i for s in times if s % OVERHEAD_EVERY == 0 for i in range(3)}
  step = statistics.median(t for s, t in times.items() if s > 1 and s not in near)
  costs = [sum(times[s + i] - step for i in range(3) if s + i in times) for s in times if s % OVERHEAD_EVERY == 0]
  return costs, step


if __name__ == "__main__":
  app.run(main)
