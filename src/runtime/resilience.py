"""Stopping cleanly when preempted, and not hanging when a peer is gone.

Preemption. SLURM (and most schedulers) send SIGTERM some time before they kill a job. `Preemption.reached`
is asked once per step; it turns True at the same step on every process, after which the trainer saves a
checkpoint, waits for it to be on disk and exits with status 0; re-running the command resumes from it.
- several processes: JAX's preemption service (started by `jax.distributed.initialize`) catches SIGTERM
  on whichever processes receive it and the processes agree, through the distributed runtime, on the
  first step that every one of them has yet to reach (JAX keeps the step number of the latest call, so the
  loop must be its only caller: meshmoe.training.checkpointing keeps orbax from calling it too);
- one process: a Python SIGTERM handler sets a flag, checked before each step.

Watchdog. A collective waiting for a process that died or hangs never returns, and cannot be interrupted.
When gloo or NCCL notice the dead peer themselves, the
step fails with an error instead of hanging; the trainer reports that as a ProcessLostError naming the
step. The trainer tells the watchdog what it is about to wait for (`beat`: "train step 12", "checkpoint save of
step 100", ...); a thread ends the process when one such wait exceeds `resilience.watchdog_timeout_s`,
after writing which step was stuck, for how long, and the main thread's stack to stderr (and so to the
per-process log). It exits with status WATCHDOG_EXIT_STATUS through os._exit: a hung collective holds
the main thread, and Python's normal exit would wait for it forever.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

import jax

# The exit status of a process that lost contact with another one: the watchdog fired, or a collective
# failed in a multi-process job (ProcessLostError).
WATCHDOG_EXIT_STATUS = 3


class ProcessLostError(RuntimeError):
  """A collective or the distributed runtime failed during a multi-process run, most often because another
  process died (gloo and NCCL report a closed connection instead of hanging when they notice)."""

  def __init__(self, what: str, error: Exception):
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    super().__init__(
        f"{what or 'the run'} failed: {first_line}. In a multi-process job this is most often another "
        "process that died or cannot be reached: the first error is in its log (<workdir>/logs/process_*.log). "
        "Re-running the job resumes from the newest checkpoint.")


class Preemption:
  """Whether a SIGTERM asked the job to stop; the same answer on every process at every step."""

  def __init__(self):
    self._flag = threading.Event()
    self._previous = None
    if jax.process_count() == 1:
      self._previous = signal.signal(signal.SIGTERM, lambda signum, frame: self._flag.set())

  def __enter__(self) -> Preemption:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def reached(self, step: int) -> bool:
    """Call at every step, on every process, with the same step numbers."""
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils

      return multihost_utils.reached_preemption_sync_point(step)
    return self._flag.is_set()

  def close(self) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None


class Watchdog:
  """Ends the process when one watched wait makes no progress for `timeout_s` seconds."""

  def __init__(self, timeout_s: float, process_index: int = 0):
    self.timeout_s, self.process_index = timeout_s, process_index
    self._lock = threading.Lock()
    self._what: str | None = None
    self._since = time.monotonic()
    self._stop = threading.Event()
    self._main = threading.main_thread().ident
    self._thread = threading.Thread(target=self._run, name="meshmoe-watchdog", daemon=True)

  def __enter__(self) -> Watchdog:
    self._thread.start()
    return self

  def __exit__(self, *exc_info) -> None:
    self._stop.set()
    self._thread.join()

  @property
  def what(self) -> str | None:
    with self._lock:
      return self._what

  def beat(self, what: str | None) -> None:
    """From now on the process is waiting for `what` (None: nothing watched, e.g. a compilation)."""
    with self._lock:
      self._what, self._since = what, time.monotonic()

  def _run(self) -> None:
    poll = min(1.0, self.timeout_s / 10)
    while not self._stop.wait(poll):
      with self._lock:
        what, waited = self._what, time.monotonic() - self._since
      if what is not None and waited > self.timeout_s:
        self._fire(what, waited)

  def _fire(self, what: str, waited: float) -> None:
    frame = sys._current_frames().get(self._main)
    stack = _our_frames(frame) if frame is not None else "  (main thread not found)\n"
    message = (
        f"\nerror: watchdog: process {self.process_index} made no progress for {waited:.1f} s in {what} "
        f"(resilience.watchdog_timeout_s={self.timeout_s:g}). A collective is most likely waiting for a "
        f"process that died or hangs: look for the first error in the other processes' logs "
        f"(<workdir>/logs/process_*.log). Exiting with status {WATCHDOG_EXIT_STATUS}; re-running the job "
        f"resumes from the newest checkpoint.\nThe main thread was here:\n{stack}")
    try:
      sys.stderr.write(message)
      sys.stderr.flush()
      sys.stdout.flush()
    finally:
      os._exit(WATCHDOG_EXIT_STATUS)


def _our_frames(frame) -> str:
  """The main thread's stack, meshmoe's frames and the innermost one (where it is blocked)."""
  frames = traceback.extract_stack(frame)
  ours = [f for f in frames[:-1] if "site-packages" not in f.filename and not f.filename.startswith("<")]
  return "".join(traceback.format_list(ours + frames[-1:]))
