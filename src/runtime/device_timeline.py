"""Which device is slow, and what it costs: per-device timelines of one step, from a jax.profiler trace.

stragglers.py compares the processes' host time; a slow device or link makes every process wait in the
same collectives, which host timers cannot tell apart. This module reads the devices' own timelines.

Sampling (`resilience.timeline_every_steps`; 0, the default: off). Every N steps the trainer runs one step
under a jax.profiler session; the trace stays in memory and a thread of this process reduces it to a few
numbers per device while the next steps run (`Sampler`); max(1, N // 2) steps later every process gathers
them (one all-gather of a small array; no trace files are written or moved). Cost: the traced step's own
overhead (every op is recorded) plus the reading, which takes CPU from the steps beside it; measured in
`experiments/benchmarks/RESULTS.md`.

Reading. jax.profiler.ProfileData, jaxlib's reader of the XSpace protobuf (xprof's format), gives every
event with its stats. Every XLA op event of the train step's module names its device (on CPU the event's
`device_ordinal`, on GPU the `/device:GPU:N` plane it lies in, N mapped to the device's id) and its HLO
instruction, whose opcode the compiled program's HLO text gives (`program_ops`; names alone do not tell: a
psum may be called "psum_invariant.14"). Ops that contain other ops (while, call, conditional) are not
counted, their contents are. Collectives (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute; an async pair counts at its start) are the step's synchronisation points; every device
runs the same program, so the k-th collective of each device is the same one. Per device: the compute
seconds before each collective and after the last (`compute_s`, K + 1 segments: wall time from the end of
one collective to the start of the next, its kernels and the gaps between them, not a sum of op durations,
which on a CPU overlap), and each collective's waiting (on CPU the rendezvous inside it, until every
participant has arrived) and transfer (the rest). Where a trace shows no waiting for a collective on any
device (gloo between processes; a NCCL kernel on a GPU), the waiting is inferred when the samples meet
(`end_aligned`): the device that spent least time in the collective arrived last, and its time is every
participant's transfer. A slow link then slows every participant's transfer alike, so it shows as a slow
collective, not as one device: only a cluster run, with per-link figures, can show how well slow links
are told apart.

Attribution (`attribute`). Every device runs the same kernels, so a device whose compute segments, or
whose collectives' transfers (waiting excluded: waiting is what the others do for it), take longer than
the median device's holds the others up. For each device and each of the two kinds, the what-if below
gives what the step would save if that device's segments of that kind were the median device's; the
device and kind that save most are flagged ("slow compute" or "slow communication") when the saving is at
least `resilience.timeline_min_cost` of the step (below it, timer noise dominates: measured in
RESULTS.md). Segments, not totals: on an oversubscribed CPU a device that is held up in one segment runs
its other kernels faster while the others wait, so only the segment shows it. `Sampler` names a device
once it is flagged with the same kind in 2 of the last 3 samples, so one noisy sample names nobody (on the
CPU benchmark noise flags some device in half the samples, rarely the same one twice: RESULTS.md).

What-if (modelled). The step as the timeline's critical path with collectives as barriers: a collective
starts when its last device arrives, and the phase from there to the next collective lasts as long as the
slowest device's transfer plus compute segment (`modelled_step_s`; every collective is taken to span every
device: a collective over a subgroup synchronises less, which the model does not see). Replacing the named device's segments by the median device's gives the step without
it; the difference is what the straggler costs, in seconds per step. These are the model's figures, of the
traced step; the record puts the measured times beside them (the traced step's and an untraced step's),
never into them, and labels which is which. On a CPU the traced step runs slower than an untraced one (each
of thousands of op events is recorded), so the model is compared with the traced step there.

Fault injection, for tests and for trying this out (`resilience.debug_slow_device`,
`debug_slow_device_s`): the chosen device sleeps that long inside every step, in a host callback on that
device's own thread (slow_device.py), so its compute segments lengthen and every other device waits for it
in the next collective, as for a throttled GPU. A slow link cannot be made on purpose here: a CPU
collective is a copy inside the process or over gloo's TCP, neither with a hook to delay one device's
transfer, so "slow communication" is tested on constructed timelines; naming a slow NVLink or NIC end to
end needs a cluster.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import warnings

import numpy as np

from meshmoe.analysis import hlo_module
from meshmoe.config import ResilienceConfig

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
CONTAINERS = ("while", "call", "conditional")  # ops whose contents are ops of their own
_CONFIRMATIONS, _WINDOW = 2, 3  # named when flagged in 2 of the last 3 samples
_GPU_DEVICE = re.compile(r"/device:GPU:(\d+)")
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


def trace_events(data) -> list[dict]:
  """A jax.profiler.ProfileData's events in the trace viewer's form (a process per plane, a thread per line,
  microseconds; each event's stats as its args), which `device_timelines` reads."""
  events = []
  for pid, plane in enumerate(data.planes):
    events.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": plane.name}})
    for tid, line in enumerate(plane.lines):
      # A third of a CPU trace's events are the runtime's own ("ThreadpoolListener::Record"); no HLO
      # instruction's name holds "::", so they are dropped before their stats are read (most of the cost).
      events.extend({"ph": "X", "pid": pid, "tid": tid, "ts": e.start_ns * 1e-3, "dur": e.duration_ns * 1e-3,
                     "name": e.name, "args": dict(e.stats)} for e in line.events if "::" not in e.name)
  return events


def device_timelines(events: list[dict], module_prefix: str, ops: ProgramOps,
                     gpu_ids: dict[int, int] | None = None) -> dict[int, DeviceTimeline]:
  """Per device id, the timeline of the module whose name starts with `module_prefix`, whose instructions
  `ops` describes (module docstring). `gpu_ids`: a GPU plane's ordinal (this process's) -> the device's id
  (JAX's, over every process); the ordinal itself where not given."""
  processes = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name" and "args" in e}
  by_device: dict[int, list[dict]] = {}
  for e in events:
    args = e.get("args") or {}
    if e.get("ph") != "X" or "hlo_op" not in args or not str(args.get("hlo_module", "")).startswith(module_prefix):
      continue
    device = _device_of(args, processes.get(e["pid"], ""), gpu_ids or {})
    if device is not None:
      by_device.setdefault(device, []).append(e)
  waits = _rendezvous_by_thread(events)
  return {device: _timeline(device, device_events, waits, ops) for device, device_events in sorted(by_device.items())}


def _device_of(args: dict, process_name: str, gpu_ids: dict[int, int]) -> int | None:
  if "device_ordinal" in args:  # a CPU device's events carry its id (2048 x the process index + ordinal)
    return int(args["device_ordinal"])
  match = _GPU_DEVICE.search(process_name)
  return None if match is None else gpu_ids.get(int(match.group(1)), int(match.group(1)))


def _rendezvous_by_thread(events: list[dict]) -> dict[tuple, list[tuple[float, float]]]:
  """(start, end) in microseconds of every rendezvous wait (CPU collectives), by (process, thread)."""
  out: dict[tuple, list[tuple[float, float]]] = {}
  for e in events:
    if e.get("ph") == "X" and e.get("name") == "Rendezvous":
      out.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
  return out


def _timeline(device: int, events: list[dict], waits: dict, ops: ProgramOps) -> DeviceTimeline:
  """One device's timeline from its op events: each segment is wall time, from the end of one collective
  (or the step's first op) to the start of the next (or the end of the last op), so ops a CPU device runs
  side by side on several threads count once, and the gaps between kernels count too."""
  compute, transfer, wait = [], [], []
  ordered = [e for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])) if e["args"]["hlo_op"] not in ops.containers]
  segment_from = latest_end = ordered[0]["ts"] if ordered else 0.0
  for e in ordered:
    end = e["ts"] + e["dur"]
    latest_end = max(latest_end, end)
    if e["args"]["hlo_op"] not in ops.collectives:
      continue
    compute.append(max(e["ts"] - segment_from, 0.0) * 1e-6)
    waited = sum(min(b, end) - max(a, e["ts"]) for a, b in waits.get((e["pid"], e["tid"]), [])
                 if a < end and b > e["ts"]) * 1e-6
    transfer.append(max(e["dur"] * 1e-6 - waited, 0.0))
    wait.append(min(waited, e["dur"] * 1e-6))
    segment_from = end
  compute.append(max(latest_end - segment_from, 0.0) * 1e-6)
  return DeviceTimeline(device, np.asarray(compute), np.asarray(transfer), np.asarray(wait))


def modelled_step_s(compute_DK: np.ndarray, transfer_DK: np.ndarray) -> float:
  """The step's critical path with collectives as barriers (module docstring): [devices, K + 1] compute and
  [devices, K] transfer seconds. Collective k starts when its last device arrives; each device then
  finishes its transfer and computes until collective k + 1, so that phase lasts as long as the slowest
  device's transfer plus segment, together."""
  phases = np.array(compute_DK, dtype=float)
  phases[:, 1:] += transfer_DK
  return float(np.sum(np.max(phases, axis=0)))


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


def end_aligned(transfer_DK: np.ndarray, wait_DK: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Transfer and waiting [devices, K] with the waiting inferred for each collective whose trace shows none
  on any device (gloo's between processes, NCCL's kernels on GPUs: the waiting is inside the transfer). A
  collective ends at about the same time on every participant, so the device that spent least time in it
  arrived last and waited for nobody: that time is the transfer, each other device's excess over it its
  waiting. Clocks of different hosts need not agree: only durations are compared."""
  unseen = ~np.any(wait_DK > 0, axis=0)
  least = np.min(transfer_DK, axis=0, initial=np.inf)
  return np.where(unseen, least, transfer_DK), np.where(unseen, transfer_DK - least, wait_DK)


def attribute(timelines: list[DeviceTimeline], min_cost: float) -> Attribution:
  """Which device, if any, is slow in this sample, and what it costs (module docstring); `min_cost`: the
  least saving, as a fraction of the modelled step, that flags a device."""
  lengths = {len(t.compute_s) for t in timelines}
  if len(lengths) != 1:
    raise ValueError(f"the devices' timelines hold different numbers of collectives ({sorted(lengths)}): "
                     "an incomplete trace")
  compute = np.stack([t.compute_s for t in timelines])
  transfer, wait = end_aligned(np.stack([t.transfer_s for t in timelines]), np.stack([t.wait_s for t in timelines]))
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
                     wait.sum(axis=1).tolist(), None if index is None else timelines[index].device,
                     kind, step, without, worst, worst_median)


def describe(reading: Attribution, step_s: float, traced_s: float) -> str:
  """The evidence of a flagged device, for the log; `step_s` and `traced_s`: the measured times of an
  untraced step and of the traced one, shown beside the modelled figures (the model reads the traced step)."""
  what = "a compute segment" if reading.kind == "compute" else "a collective's transfer"
  return (f"{what} of {reading.worst_s:.3f} s where the median device takes {reading.worst_median_s:.3f} s; it costs "
          f"{reading.cost_s:.3f} s per step ({100 * reading.cost_s / reading.modelled_step_s:.0f}%; modelled step "
          f"{reading.modelled_step_s:.3f} s with it, {reading.modelled_without_s:.3f} s without; measured: the traced "
          f"step {traced_s:.3f} s, an untraced step {step_s:.3f} s)")


def pack(timelines: list[DeviceTimeline]) -> np.ndarray:
  """This process's timelines as one float64 array [local devices, 3K + 2] (device id, compute, transfer,
  wait), to all-gather; `unpack` reverses it."""
  return np.stack([np.concatenate([[t.device], t.compute_s, t.transfer_s, t.wait_s]) for t in timelines])


def unpack(rows: np.ndarray) -> list[DeviceTimeline]:
  k = (rows.shape[1] - 2) // 3
  return [DeviceTimeline(int(r[0]), r[1:k + 2], r[k + 2:2 * k + 2], r[2 * k + 2:]) for r in rows]


def _first_stats(data) -> None:
  """Reads one event's stats in the calling thread, its warning ignored: jaxlib makes their Python type on
  first use and warns then ("builtin type event_stats has no __module__ attribute"), which the warnings
  filters of a thread other than the main one cannot catch safely."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    for plane in data.planes:
      for line in plane.lines:
        for event in line.events:
          dict(event.stats)
          return


class Sampler:
  """Samples one step's device timelines every N steps, reads them while the next steps run, and names a
  slow device once it is confirmed.

  The trainer calls, on every process at the same steps: `due(step)`; around a due step `start()` and
  `stop(step, traced_s)`; after each step `ready(step, last)`, and when it says so `take()`, whose timelines
  it gathers from every process and passes to `judge`. The trace is read in a thread of its own (most of a
  sample's cost: pure Python over every op event), judged `lag` steps later, when it has long finished.
  """

  def __init__(self, cfg: ResilienceConfig, module_prefix: str = "jit_train_step"):
    self.every, self.min_cost, self.module_prefix = cfg.timeline_every_steps, cfg.timeline_min_cost, module_prefix
    self.lag = max(1, self.every // 2)  # steps between a sample and its judgement
    self._flags: list[tuple[int, str] | None] = []
    self._session = None
    self._pending = None  # (the sampled step, its traced step's measured seconds, the reading thread, its result)
    self.ops: ProgramOps | None = None  # of the sampled program: set by the caller before `stop`

  def due(self, step: int) -> bool:
    """Whether step `step` (1-based, the same on every process) is sampled."""
    return bool(self.every) and step % self.every == 0 and self._pending is None

  def start(self) -> None:
    import jax
    from jax._src.lib import _profiler

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # no Python function events: only the host's and the devices' own
    options.enable_hlo_proto = False  # the instructions' kinds come from the compiled program's text
    # A profiler session of jaxlib's own (as jax's PGLE uses): its events are read in memory, where
    # jax.profiler.stop_trace would write them to files first (0.7 s a sample) for xprof to convert (1.5 s).
    self._session = _profiler.ProfilerSession(options)

  def stop(self, step: int, traced_s: float) -> None:
    """Stops the trace started by `start` (the sampled step `step` must have finished, in `traced_s`
    measured seconds) and starts reading this process's devices from it."""
    import jax

    session, self._session = self._session, None
    # Serialized and parsed again: the reading thread's own copy (the session's data dies with it).
    data = jax.profiler.ProfileData.from_serialized_xspace(session.stop())
    _first_stats(data)
    gpu_ids = {d.local_hardware_id: d.id for d in jax.local_devices() if d.platform == "gpu"}
    result = {}

    def read():
      try:
        result["timelines"] = list(device_timelines(trace_events(data), self.module_prefix, self.ops, gpu_ids).values())
      except Exception as error:  # re-raised by `take`, in the trainer's thread
        result["error"] = error

    thread = threading.Thread(target=read, name="meshmoe-device-timeline", daemon=True)
    thread.start()
    self._pending = (step, traced_s, thread, result)

  def ready(self, step: int, last: bool) -> bool:
    """Whether the pending sample is judged after step `step` (`last`: the run's last step)."""
    return self._pending is not None and (last or step >= self._pending[0] + self.lag)

  def take(self) -> tuple[int, float, list[DeviceTimeline]]:
    """The pending sample's step, its traced step's measured seconds and this process's timelines."""
    step, traced_s, thread, result = self._pending
    self._pending = None
    thread.join()
    if "error" in result:
      raise result["error"]
    return step, traced_s, result["timelines"]

  def judge(self, timelines: list[DeviceTimeline]) -> tuple[Attribution, tuple[int, str] | None]:
    """This sample's attribution (over every process's devices) and the device named: flagged with the
    same kind in this sample and one of the two before it, or None."""
    reading = attribute(timelines, self.min_cost)
    self._flags = (self._flags + [None if reading.flagged is None else (reading.flagged, reading.kind)])[-_WINDOW:]
    candidate = self._flags[-1]
    named = candidate if candidate is not None and self._flags.count(candidate) >= _CONFIRMATIONS else None
    return reading, named
