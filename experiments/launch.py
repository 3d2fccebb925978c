"""Run a multi-process meshmoe job on this one machine: to debug multi-host behaviour on a laptop, and for tests.

  python -m experiments.launch --processes=2 --devices_per_process=4 -- [train flags]
  (or: bash experiments/run.sh launch --processes=2 --devices_per_process=4 -- [train flags])

Starts `python -m experiments.train` --processes times, each with --devices_per_process simulated CPU
devices, joined through JAX's distributed runtime on a localhost coordinator with gloo collectives: the
same code path as a multi-host GPU job, where each host is one process. 2 x 4 devices train with the same
losses as one process with 8. Process 0 prints as usual; the others' lines come prefixed with
`[process i]`, and every process also writes <workdir>/logs/process_<i>.log.

The devices are one node's. A config whose fused kernels need their rings in one process
(parallel.impl=pallas; `python -m experiments.train --print_process_layout` says) is started as one
process with all --processes x --devices_per_process devices, as experiments/slurm/train.sbatch runs one
process per node for it, and the launcher says so (--nofit_process_layout keeps the processes as asked:
the plan then runs the xla tier where a kernel's ring spans them).

SIGTERM or Ctrl-C is passed to every process, which stop at the same step with a checkpoint (a second
Ctrl-C kills them). A process that dies is reported when it does; the others end on their own (their
watchdog turns the stuck step into an error after resilience.watchdog_timeout_s). The exit status is the
first non-zero status of a process (128 + N for a process killed by signal N), else 0.
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

REPO = pathlib.Path(__file__).resolve().parents[1]
_PROCESSES = flags.DEFINE_integer("processes", 2, "number of processes to start")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "simulated CPU devices per process")
_PORT = flags.DEFINE_integer("port", 0, "coordinator port on localhost (0: a free one)")
_FIT = flags.DEFINE_bool("fit_process_layout", True, "start one process with every device when the config's "
                         "fused kernels need their rings in one process (parallel.impl=pallas), as train.sbatch "
                         "runs one process per node")
_SET_BY_LAUNCH = ("--coordinator_address", "--num_processes", "--process_id")


def main(argv):
  train_flags = argv[1:]
  if _PROCESSES.value < 1 or _DEVICES.value < 1:
    _fail(f"--processes={_PROCESSES.value} and --devices_per_process={_DEVICES.value}: both must be >= 1")
  if not 0 <= _PORT.value < 65536:
    _fail(f"--port={_PORT.value} is invalid: 0 (a free port) or a port number")
  clash = [f for f in train_flags if f.split("=")[0] in _SET_BY_LAUNCH]
  if clash:
    _fail(f"{' '.join(clash)}: experiments.launch sets {', '.join(_SET_BY_LAUNCH)} itself")
  count, devices = _process_layout(train_flags)
  port = _PORT.value or _free_port()
  processes = [_start(i, count, devices, port, train_flags) for i in range(count)]
  _forward_signals(processes)
  sys.exit(_wait(processes))


def _process_layout(train_flags: list[str]) -> tuple[int, int]:
  """(processes, devices per process) to start: as asked, or one process with every device where the
  config needs one process per node (module docstring). A bad config or flag stops here, with its error."""
  asked = (_PROCESSES.value, _DEVICES.value)
  if _PROCESSES.value == 1 or not _FIT.value:
    return asked
  answer = subprocess.run([sys.executable, "-m", "experiments.train", "--print_process_layout", *train_flags],
                          env=_environment(), capture_output=True, text=True)
  if answer.returncode:
    sys.exit(answer.stderr.strip().splitlines()[-1] if answer.stderr.strip() else answer.returncode)
  need, _, why = answer.stdout.strip().splitlines()[-1].partition(" ")
  if need != "node":
    return asked
  total = _PROCESSES.value * _DEVICES.value
  print(f"experiments.launch: one process of {total} devices instead of {_PROCESSES.value} of {_DEVICES.value}: "
        f"{why} (--nofit_process_layout keeps the processes as asked)", file=sys.stderr, flush=True)
  return 1, total


def _environment(devices: int | None = None) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
             PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
  if devices is not None:
    kept = [f for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])
  return env


def _start(index: int, count: int, devices: int, port: int, train_flags: list[str]) -> subprocess.Popen:
  env = _environment(devices)
  command = [sys.executable, "-m", "experiments.train", f"--coordinator_address=localhost:{port}",
             f"--num_processes={count}", f"--process_id={index}", *train_flags]
  # Each process in its own session: Ctrl-C reaches the launcher alone, which turns it into a SIGTERM for
  # all of them (a clean stop with a checkpoint) instead of a KeyboardInterrupt in the middle of a step.
  if index == 0:
    return subprocess.Popen(command, env=env, start_new_session=True)
  process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             errors="replace", start_new_session=True)
  for source, sink in ((process.stdout, sys.stdout), (process.stderr, sys.stderr)):
    threading.Thread(target=_prefix_lines, args=(source, sink, f"[process {index}] "), daemon=True).start()
  return process


def _prefix_lines(source, sink, prefix: str) -> None:
  for line in source:
    sink.write(prefix + line)
    sink.flush()


def _forward_signals(processes: list[subprocess.Popen]) -> None:
  interrupts = 0

  def forward(signum, frame):
    nonlocal interrupts
    interrupts += signum == signal.SIGINT
    how = signal.SIGKILL if interrupts > 1 else signal.SIGTERM
    for process in processes:
      if process.poll() is None:
        process.send_signal(how)

  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, forward)


def _wait(processes: list[subprocess.Popen]) -> int:
  status, running = 0, dict(enumerate(processes))
  while running:
    for index, process in list(running.items()):
      code = process.poll()
      if code is None:
        continue
      del running[index]
      if code:
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        if code == -signal.SIGABRT:  # JAX's distributed runtime aborts the survivors of a dead process
          how += " (JAX's distributed runtime ends every process once one of them, e.g. process 0, is gone)"
        code = 128 - code if code < 0 else code
        print(f"experiments.launch: process {index} {how}"
              + (f"; waiting for processes {sorted(running)}" if running else ""), file=sys.stderr, flush=True)
        status = status or code
    time.sleep(0.1)
  return status


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _fail(message: str) -> None:
  sys.exit(f"error: {message}\nusage: python -m experiments.launch --processes=P --devices_per_process=D -- "
           "[train flags]")


def _check_separator(argv: list[str]) -> None:
  """Train flags before `--` would reach absl as unknown launch flags; say where they belong."""
  own = {"--processes", "--devices_per_process", "--port", "--fit_process_layout", "--nofit_process_layout",
         "--help", "--helpfull", "--helpshort"}
  before = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  stray = [a for a in before if a.split("=")[0] not in own]
  if stray:
    _fail(f"unknown launch flag(s) {' '.join(stray)}; flags for experiments.train go after '--'")


if __name__ == "__main__":
  _check_separator(sys.argv)
  app.run(main)
