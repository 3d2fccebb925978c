"""Which device is slow, and what it costs: per-device timelines of one step, from a jax.profiler trace.

stragglers.py compares the processes' host time; a slow device or link makes every process wait in the
same collectives, which host timers cannot tell apart. This module reads the devices' own timelines.

Sampling (`resilience.timeline_every_steps`; 0, the default: off). Every N steps the trainer runs one step
under jax.profiler (a trace into a temporary folder, deleted after reading) and each process reduces its
trace on the spot to a few numbers per device; only those travel between processes (one all-gather), never
trace files. Cost: the traced step's own overhead plus the reading, about 2 s per sample on the CPU
benchmark (steps of 0.43 s there: +9% at one sample in 50); `experiments/benchmarks/RESULTS.md`.

Reading. xprof, the maintained reader of jax.profiler's XSpace protobufs, converts the trace to the trace
viewer's JSON. Every XLA op event of the train step's module names its device (on CPU the event's
`device_ordinal`, on GPU the `/device:GPU:N` process it lies in) and its HLO instruction, whose opcode the
compiled program's HLO text gives (`program_ops`; names alone do not tell: a psum may be called
"psum_invariant.14"). Ops that contain other ops (while, call, conditional) are not counted, their contents
are. Collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute; an async pair
counts at its start) are the step's synchronisation points; every device runs the same program, so the
k-th collective of each device is the same one. Per device: the compute seconds before each collective and after the last (`compute_s`, K + 1
segments), and each collective's waiting (on CPU the rendezvous inside it, until every participant has
arrived) and transfer (the rest). A GPU trace does not show the wait inside a NCCL kernel: there the whole
collective counts as transfer, and only a cluster run can show how well that separates slow links.

Attribution (`attribute`). Every device runs the same kernels, so a device whose compute segments, or
whose collectives' transfers (waiting excluded: waiting is what the others do for it), take longer than
the median device's holds the others up. For each device and each of the two kinds, the what-if below
gives what the step would save if that device's segments of that kind were the median device's; the
device and kind that save most are flagged ("slow compute" or "slow communication") when the saving is at
least `resilience.timeline_min_cost` of the step (below it, timer noise dominates: measured in
RESULTS.md). Segments, not totals: on an oversubscribed CPU a device that is held up in one segment runs
its other kernels faster while the others wait, so only the segment shows it. `Sampler` names a device
after it is flagged with the same kind in 2 of the last 3 samples, so one noisy sample names nobody.

What-if (modelled). The step as the timeline's critical path with collectives as barriers: each segment
lasts as long as its slowest device's compute, then each collective its slowest participant's transfer
(`modelled_step_s`). Replacing the named device's segments by the median device's gives the step without
it; the difference is what the straggler costs, in seconds per step. These are the model's figures; the
record puts the measured step time beside them, never into them, and labels which is which (on the CPU
benchmark the modelled step is 0.98-1.41 times the measured one, median 1.20: RESULTS.md).

Fault injection, for tests and for trying this out (`resilience.debug_slow_device`,
`debug_slow_device_s`): the chosen device sleeps that long inside every step, in a host callback on that
device's own thread (slow_device.py), so its compute segments lengthen and every other device waits for it
in the next collective, as for a throttled GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np

from meshmoe.analysis import hlo_module
from meshmoe.config import ResilienceConfig

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
CONTAINERS = ("while", "call", "conditional")  # ops whose contents are ops of their own
_CONFIRMATIONS, _WINDOW = 2, 3  # named when flagged in 2 of the last 3 samples
_GPU_DEVICE = re.compile(r"/device:GPU:(\d+)")
# What xprof's converter logs on every call though nothing is wrong (it has no newer processor for the
# trace viewer and uses its older one).
_XPROF_NOISE = re.compile(r"No UnifiedProfileProcessor registered|Unified processor not found|Remapping device id"
                          r"|serving tool:|Using local processing|TraceViewerProcessor|XProf HLO fixer"
                          r"|GenerateDerivedTimeLines|XprofThreadPoolExecutor|PreprocessSingleHostXSpace"
                          r"|ConvertXSpaceToTraceEventsString|Total time for tool")


@dataclasses.dataclass
class DeviceTimeline:
  """One device's step, in program order: compute seconds before each of its K collectives and after the
  last ([K + 1]), each collective's transfer and waiting seconds ([K] each)."""

  device: int
  compute_s: np.ndarray
  transfer_s: np.ndarray
  wait_s: np.ndarray


@dataclasses.dataclass(frozen=True)
class ProgramOps:
  """The instruction names of a compiled program that are collectives, and those that contain other ops."""

  collectives: frozenset[str]
  containers: frozenset[str]


def program_ops(hlo_text: str) -> ProgramOps:
  """ProgramOps of a compiled program's HLO text (`Compiled.as_text()`)."""
  collectives, containers = set(), set()
  for _, instruction in hlo_module.parse(hlo_text).instructions():
    if instruction.opcode.removesuffix("-start") in COLLECTIVES:  # a -done waits for its start: not counted
      collectives.add(instruction.name)
    elif instruction.opcode in CONTAINERS:
      containers.add(instruction.name)
  return ProgramOps(frozenset(collectives), frozenset(containers))


def read_trace(folder: str) -> list[dict]:
  """The trace viewer's events of the newest jax.profiler trace under `folder` (xprof's conversion)."""
  from xprof.convert import raw_to_tool_data

  runs = sorted(glob.glob(os.path.join(folder, "plugins", "profile", "*")))
  if not runs:
    raise FileNotFoundError(f"no jax.profiler trace under {folder}")
  with _without_xprof_noise():
    data, _ = raw_to_tool_data.xspace_to_tool_data(sorted(glob.glob(os.path.join(runs[-1], "*.xplane.pb"))),
                                                   "trace_viewer", {})
  return json.loads(data)["traceEvents"]


@contextlib.contextmanager
def _without_xprof_noise():
  """Standard error (file descriptor 2: the converter logs from C++) captured while the converter runs and
  written out again without xprof's routine lines; whatever else was written in that time is kept."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
              if not _XPROF_NOISE.search(line)]
      if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


def device_timelines(events: list[dict], module_prefix: str, ops: ProgramOps) -> dict[int, DeviceTimeline]:
  """Per device, the timeline of the module whose name starts with `module_prefix`, whose instructions
  `ops` describes (module docstring)."""
  processes = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
  by_device: dict[int, list[dict]] = {}
  for e in events:
    args = e.get("args") or {}
    if e.get("ph") != "X" or "hlo_op" not in args or not str(args.get("hlo_module", "")).startswith(module_prefix):
      continue
    device = _device_of(args, processes.get(e["pid"], ""))
    if device is not None:
      by_device.setdefault(device, []).append(e)
  waits = _rendezvous_by_thread(events)
  return {device: _timeline(device, device_events, waits, ops) for device, device_events in sorted(by_device.items())}


def _device_of(args: dict, process_name: str) -> int | None:
  if "device_ordinal" in args:
    return int(args["device_ordinal"])
  match = _GPU_DEVICE.search(process_name)
  return int(match.group(1)) if match else None


def _rendezvous_by_thread(events: list[dict]) -> dict[tuple, list[tuple[float, float]]]:
  """(start, end) in microseconds of every rendezvous wait (CPU collectives), by (process, thread)."""
  out: dict[tuple, list[tuple[float, float]]] = {}
  for e in events:
    if e.get("ph") == "X" and e.get("name") == "Rendezvous":
      out.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
  return out


def _timeline(device: int, events: list[dict], waits: dict, ops: ProgramOps) -> DeviceTimeline:
  compute, transfer, wait = [0.0], [], []
  for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
    op = e["args"]["hlo_op"]
    if op in ops.containers:
      continue
    seconds = e["dur"] * 1e-6
    if op not in ops.collectives:
      compute[-1] += seconds
      continue
    end = e["ts"] + e["dur"]
    waited = sum(min(b, end) - max(a, e["ts"]) for a, b in waits.get((e["pid"], e["tid"]), [])
                 if a < end and b > e["ts"]) * 1e-6
    transfer.append(max(seconds - waited, 0.0))
    wait.append(min(waited, seconds))
    compute.append(0.0)
  return DeviceTimeline(device, np.asarray(compute), np.asarray(transfer), np.asarray(wait))


def modelled_step_s(compute_DK: np.ndarray, transfer_DK: np.ndarray) -> float:
  """The step's critical path with collectives as barriers (module docstring): [devices, K + 1] compute and
  [devices, K] transfer seconds."""
  return float(np.sum(np.max(compute_DK, axis=0)) + np.sum(np.max(transfer_DK, axis=0, initial=0.0)))


@dataclasses.dataclass
class Attribution:
  """One sample's reading: per device (in `devices` order) its compute, transfer and wait seconds; the
  flagged device (or None), its kind ("compute" or "communication"), and the modelled cost."""

  devices: list[int]
  compute_s: list[float]
  transfer_s: list[float]
  wait_s: list[float]
  flagged: int | None
  kind: str | None
  modelled_step_s: float
  modelled_without_s: float  # the modelled step with the flagged device at the median device's speed
  # the flagged device's seconds, and the median device's, in the segment (or collective) where it exceeds
  # the median most
  worst_s: float = 0.0
  worst_median_s: float = 0.0

  @property
  def cost_s(self) -> float:
    return self.modelled_step_s - self.modelled_without_s


def attribute(timelines: list[DeviceTimeline], min_cost: float) -> Attribution:
  """Which device, if any, is slow in this sample, and what it costs (module docstring); `min_cost`: the
  least saving, as a fraction of the modelled step, that flags a device."""
  lengths = {len(t.compute_s) for t in timelines}
  if len(lengths) != 1:
    raise ValueError(f"the devices' timelines hold different numbers of collectives ({sorted(lengths)}): "
                     "an incomplete trace")
  compute = np.stack([t.compute_s for t in timelines])
  transfer = np.stack([t.transfer_s for t in timelines])
  totals = {"compute": compute.sum(axis=1), "communication": transfer.sum(axis=1)}
  step = modelled_step_s(compute, transfer)
  best = (None, None, step)
  for kind in totals:
    for i in range(len(timelines)):
      fixed_compute, fixed_transfer = compute.copy(), transfer.copy()
      fixed = fixed_compute if kind == "compute" else fixed_transfer
      fixed[i] = np.median(fixed, axis=0)
      without = modelled_step_s(fixed_compute, fixed_transfer)
      if without < best[2] and step - without >= min_cost * step:
        best = (i, kind, without)
  index, kind, without = best
  worst = worst_median = 0.0
  if index is not None:
    values = compute if kind == "compute" else transfer
    median = np.median(values, axis=0)
    k = int(np.argmax(values[index] - median))
    worst, worst_median = float(values[index, k]), float(median[k])
  return Attribution([t.device for t in timelines], totals["compute"].tolist(), totals["communication"].tolist(),
                     [float(t.wait_s.sum()) for t in timelines], None if index is None else timelines[index].device,
                     kind, step, without, worst, worst_median)


def describe(reading: Attribution, step_s: float) -> str:
  """The evidence of a flagged device, for the log; `step_s`: the measured step time, shown beside the
  modelled figures."""
  what = "a compute segment" if reading.kind == "compute" else "a collective's transfer"
  return (f"{what} of {reading.worst_s:.3f} s where the median device takes {reading.worst_median_s:.3f} s; it costs "
          f"{reading.cost_s:.3f} s per step ({100 * reading.cost_s / reading.modelled_step_s:.0f}%; modelled step "
          f"{reading.modelled_step_s:.3f} s with it, {reading.modelled_without_s:.3f} s without; measured step "
          f"{step_s:.3f} s)")


def pack(timelines: list[DeviceTimeline]) -> np.ndarray:
  """This process's timelines as one float64 array [local devices, 3K + 2] (device id, compute, transfer,
  wait), to all-gather; `unpack` reverses it."""
  return np.stack([np.concatenate([[t.device], t.compute_s, t.transfer_s, t.wait_s]) for t in timelines])


def unpack(rows: np.ndarray) -> list[DeviceTimeline]:
  k = (rows.shape[1] - 2) // 3
  return [DeviceTimeline(int(r[0]), r[1:k + 2], r[k + 2:2 * k + 2], r[2 * k + 2:]) for r in rows]


class Sampler:
  """Samples one step's device timelines every N steps and names a slow device once it is confirmed."""

  def __init__(self, cfg: ResilienceConfig, module_prefix: str = "jit_train_step"):
    self.every, self.min_cost, self.module_prefix = cfg.timeline_every_steps, cfg.timeline_min_cost, module_prefix
    self._flags: list[tuple[int, str] | None] = []
    self._folder = None
    self.ops: ProgramOps | None = None  # of the sampled program: set by the caller before `finish`

  def due(self, step: int) -> bool:
    """Whether step `step` (1-based, the same on every process) is sampled."""
    return bool(self.every) and step % self.every == 0

  def start(self) -> None:
    import jax

    self._folder = tempfile.mkdtemp(prefix="meshmoe_timeline_")
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python function events: only the host's and the devices' own
    options.enable_hlo_proto = False  # the instructions' kinds come from the compiled program's text
    jax.profiler.start_trace(self._folder, profiler_options=options)

  def finish(self) -> list[DeviceTimeline]:
    """Stops the trace started by `start` (the step must have finished) and reads this process's devices."""
    import jax

    jax.profiler.stop_trace()
    try:
      return list(device_timelines(read_trace(self._folder), self.module_prefix, self.ops).values())
    finally:
      shutil.rmtree(self._folder, ignore_errors=True)

  def judge(self, timelines: list[DeviceTimeline]) -> tuple[Attribution, tuple[int, str] | None]:
    """This sample's attribution (over every process's devices) and the device named, confirmed by the
    samples before it, or None."""
    reading = attribute(timelines, self.min_cost)
    self._flags = (self._flags + [None if reading.flagged is None else (reading.flagged, reading.kind)])[-_WINDOW:]
    candidate = self._flags[-1]
    named = candidate if candidate is not None and self._flags.count(candidate) >= _CONFIRMATIONS else None
    return reading, named
