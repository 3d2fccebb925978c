"""Straggler detection: which process is slowing the job down.

In a synchronous job every process's step takes as long as the slowest one's, since each collective waits
for the last process to reach it: wall-clock step times are the same everywhere and name nobody. What
differs is the time each process spends on its own work, outside waiting for the devices: loading and
placing the batch, dispatching the step, anything else the host does. A process whose host is slow (CPU
contention, slow storage, a throttled node) spends more; the others spend the difference waiting for it.

Every `resilience.straggler_every_steps` steps the processes exchange their mean own time and wall time per
step over the window (one small all-gather) and compare each process's own time with the median process's
(the lower median: an actual process, so with two processes the faster is the reference). A process is a
straggler when its own time exceeds the median's by `resilience.straggler_factor` and by more than 10% of
the step time (below that the job would not be much faster without it, and timer noise dominates). The
first step after a start is left out: each process pays one-time costs there. Every process logs the
comparison's outcome; the primary also writes it to metrics.jsonl as a record of kind "processes".

A device that computes slowly makes every process wait in the same collectives; host timers cannot tell
which device that is (a profile of the slow steps can).
"""

from __future__ import annotations

import dataclasses
import socket
import statistics
import time

import numpy as np

from meshmoe.config import ResilienceConfig

_NEGLIGIBLE_FRACTION_OF_STEP = 0.1


@dataclasses.dataclass
class Comparison:
  own_time_s: list[float]  # per process, mean seconds per step spent outside waiting for the devices
  step_time_s: list[float]  # per process, mean wall seconds per step
  median_own_time_s: float
  stragglers: list[int]

  def record(self) -> dict:
    return dataclasses.asdict(self)


def find_stragglers(own: list[float], step: list[float], factor: float) -> Comparison:
  median = statistics.median_low(own)
  floor = _NEGLIGIBLE_FRACTION_OF_STEP * statistics.median(step)
  slow = [p for p, t in enumerate(own) if t > factor * median and t - median > floor]
  return Comparison(own, step, median, slow)


class Monitor:
  """Times this process's steps and compares the processes every N steps (a collective: all must call)."""

  def __init__(self, cfg: ResilienceConfig, process_count: int, process_index: int):
    self.every = cfg.straggler_every_steps if process_count > 1 else 0
    self.factor, self.process_index = cfg.straggler_factor, process_index
    self._own = self._wall = 0.0
    self._steps = 0
    self._hosts: list[str] | None = None
    self._waiting_since = self._step_start = time.perf_counter()
    self._waited = 0.0
    self._warm = False  # the first step after a start pays one-time costs on each process: not compared

  def step_started(self) -> None:
    self._step_start = time.perf_counter()
    self._waited = 0.0

  def waiting(self) -> None:
    self._waiting_since = time.perf_counter()

  def done_waiting(self) -> None:
    self._waited += time.perf_counter() - self._waiting_since

  def step_finished(self) -> None:
    if not self._warm:
      self._warm = True
      return
    wall = time.perf_counter() - self._step_start
    self._wall += wall
    self._own += wall - self._waited
    self._steps += 1

  def compare(self, step: int) -> Comparison | None:
    """At every N-th step (the same steps on all processes): the comparison over the last window."""
    if not self.every or step % self.every or not self._steps:
      return None
    from jax.experimental import multihost_utils

    self.hosts()
    mine = np.array([self._own / self._steps, self._wall / self._steps], np.float32)
    gathered = multihost_utils.process_allgather(mine)
    self._own = self._wall = 0.0
    self._steps = 0
    return find_stragglers(gathered[:, 0].tolist(), gathered[:, 1].tolist(), self.factor)

  def hosts(self) -> list[str]:
    """Each process's host name, gathered on the first call (a collective then: all processes must call)."""
    if self._hosts is None:
      from jax.experimental import multihost_utils

      name = np.frombuffer(socket.gethostname().encode()[:64].ljust(64), np.uint8)
      self._hosts = [bytes(row).decode().strip() for row in multihost_utils.process_allgather(name)]
    return self._hosts

  def describe(self, step: int, c: Comparison) -> str:
    """The log line naming the stragglers of a comparison that found some."""
    named = ", ".join(f"process {p} on {self._hosts[p]} ({c.own_time_s[p]:.3f} s, "
                      f"{c.own_time_s[p] / max(c.median_own_time_s, 1e-9):.1f}x)" for p in c.stragglers)
    return (f"warning: step {step}: straggler: {named} spends more time per step on its own work than the "
            f"median process ({c.median_own_time_s:.3f} s; resilience.straggler_factor={self.factor:g}); "
            f"step time {statistics.median(c.step_time_s):.3f} s")
