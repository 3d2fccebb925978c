"""Distributed start-up: which process this is, joining the job, and one log file per process.

A job is one process per host or per GPU. Where the topology comes from, first match wins:
1. explicit flags (`--coordinator_address`, `--num_processes`, `--process_id`; what experiments.launch
   passes), all three or none;
2. SLURM, inside an `srun` step of more than one task: the process count and id are SLURM_STEP_NUM_TASKS
   and SLURM_PROCID, the coordinator is the first host of the step's node list on port
   61440 + SLURM_JOB_ID % 4096 (JAX's own choice for SLURM, so every task computes the same address);
3. otherwise a single process, and `jax.distributed` is not started at all.

Each process uses every accelerator it sees unless `local_device_ids` names some: for one process per GPU,
give each task its own GPU (`srun --gpus-per-task=1`, as experiments/slurm/train.sbatch does). JAX's own
SLURM detection is switched off because it would pin every process to GPU SLURM_LOCALID, leaving all but
one GPU idle in a one-process-per-node job.

CPU processes talk through gloo (cross-process collectives on the CPU backend). JAX's heartbeat timeout is
set above the watchdog's (resilience.watchdog_timeout_s), so a process stuck behind a dead peer reports the
step it was in before the runtime aborts it; the runtime's abort remains the backstop for the phases the
watchdog does not watch (start-up, compilation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence

SLURM_PORT_BASE = 65535 - 2**12 + 1


class TopologyError(ValueError):
  """Process-topology flags or environment that do not describe a job."""


@dataclasses.dataclass(frozen=True)
class Topology:
  num_processes: int = 1
  process_id: int = 0
  coordinator_address: str | None = None  # host:port of process 0; None for a single process
  local_device_ids: tuple[int, ...] | None = None  # None: every device this process sees
  source: str = "single process"  # "flags", "SLURM" or "single process"

  @property
  def is_multi_process(self) -> bool:
    return self.num_processes > 1


def resolve(coordinator_address: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, local_device_ids: Sequence[int] | None = None,
            environ: Mapping[str, str] = os.environ) -> Topology:
  """The topology from explicit flags, else from SLURM's environment, else a single process."""
  ids = tuple(local_device_ids) if local_device_ids else None
  given = {"--coordinator_address": coordinator_address, "--num_processes": num_processes,
           "--process_id": process_id}
  if any(v is not None for v in given.values()):
    missing = [name for name, value in given.items() if value is None]
    if missing:
      raise TopologyError(f"{', '.join(missing)} missing: a multi-process job needs --coordinator_address, "
                          "--num_processes and --process_id together (or none of them, under SLURM or for "
                          "a single process)")
    return _checked(Topology(num_processes, process_id, coordinator_address, ids, "flags"))
  # Only inside an srun step: the batch script itself also sees SLURM_NTASKS and SLURM_PROCID=0.
  tasks = environ.get("SLURM_STEP_NUM_TASKS")
  if tasks and int(tasks) > 1 and "SLURM_PROCID" in environ:
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    port = SLURM_PORT_BASE + int(environ["SLURM_JOB_ID"]) % 2**12
    return _checked(Topology(int(tasks), int(environ["SLURM_PROCID"]), f"{first_slurm_host(nodes)}:{port}",
                             ids, "SLURM"))
  return Topology(local_device_ids=ids)


def _checked(t: Topology) -> Topology:
  if t.num_processes < 1:
    raise TopologyError(f"--num_processes={t.num_processes} is invalid: a positive number of processes")
  if not 0 <= t.process_id < t.num_processes:
    raise TopologyError(f"--process_id={t.process_id} is invalid: from 0 to --num_processes - 1 = "
                        f"{t.num_processes - 1}")
  if t.num_processes > 1 and not re.fullmatch(r"\[?[\w.:-]+\]?:\d+", t.coordinator_address or ""):
    raise TopologyError(f"--coordinator_address={t.coordinator_address!r} is invalid: host:port of process 0, "
                        "e.g. localhost:12345 or node001:61440")
  return t


def first_slurm_host(nodelist: str) -> str:
  """The first host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
  match = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist.strip())
  if not match:
    raise TopologyError(f"cannot read the first host of the SLURM node list {nodelist!r}")
  return match.group(1) + (match.group(2) or "")


def initialize(topology: Topology, watchdog_timeout_s: float) -> None:
  """Joins the job (a no-op for a single process); call before anything asks JAX for a device."""
  import jax

  if topology.local_device_ids is not None and not topology.is_multi_process:
    jax.config.update("jax_cuda_visible_devices", ",".join(map(str, topology.local_device_ids)))
  if not topology.is_multi_process:
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      topology.coordinator_address, topology.num_processes, topology.process_id,
      local_device_ids=list(topology.local_device_ids) if topology.local_device_ids else None,
      cluster_detection_method="deactivate", heartbeat_timeout_seconds=int(watchdog_timeout_s) + 60)


# How long a process waits at `barrier` for the others: longer than any start-up work one process may do
# alone (compiling a large model while the others load it from the compilation cache, reading a checkpoint).
# A dead process does not make the others wait this long: the coordination service's heartbeat ends them.
BARRIER_TIMEOUT_S = 3600
_barriers_passed = 0


def barrier(name: str) -> None:
  """Every process waits here until all have arrived (a no-op for a single process).

  Through JAX's coordination service, not a device collective: gloo, which carries CPU processes'
  collectives, gives up on a collective's first meeting after 30 s ("Gloo context initialization failed:
  DEADLINE_EXCEEDED"), so a collective that processes reach at different times (after loading a checkpoint,
  tokenizing a corpus or compiling) fails under load. The first collective after such work comes after a
  barrier. Every process must call the same barriers in the same order: the name gets a sequence number,
  since the service does not let a name be used twice."""
  global _barriers_passed
  import jax

  if jax.process_count() == 1:
    return
  from jax._src import distributed as jax_distributed  # the coordination client has no public accessor

  _barriers_passed += 1
  jax_distributed.global_state.client.wait_at_barrier(f"{name} #{_barriers_passed}", BARRIER_TIMEOUT_S * 1000)


def describe(topology: Topology) -> str:
  """One line for the log: which process, where, with which devices."""
  import jax

  devices = jax.local_devices()
  where = f"process {topology.process_id} of {topology.num_processes} on host {socket.gethostname()}"
  kinds = sorted({d.device_kind for d in devices})
  line = f"{where}: {len(devices)} local {'/'.join(kinds)} device(s) of {jax.device_count()}"
  if topology.is_multi_process:
    line += f"; coordinator {topology.coordinator_address} (from {topology.source})"
  return line


def process_log_path(workdir: str | pathlib.Path, process_id: int) -> pathlib.Path:
  return pathlib.Path(workdir) / "logs" / f"process_{process_id}.log"


@contextlib.contextmanager
def process_log(workdir: str | pathlib.Path, process_id: int) -> Iterator[pathlib.Path]:
  """Copies this process's output into <workdir>/logs/process_<id>.log, appending across restarts.

  stdout is copied by Python (prints, the progress lines) and keeps its terminal, so progress bars still
  show. stderr is copied at the file-descriptor level through a `tee` process, so the log also gets what
  native code writes there (XLA, gloo, and the distributed runtime's message when it aborts the process
  because another one died), and the tee outlives an abort or os._exit to write the last lines."""
  path = process_log_path(workdir, process_id)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a", encoding="utf-8", buffering=1) as log_file, _stderr_tee(path):
    saved = sys.stdout
    sys.stdout = _Tee(saved, log_file)
    try:
      yield path
    finally:
      sys.stdout = saved


@contextlib.contextmanager
def _stderr_tee(path: pathlib.Path) -> Iterator[None]:
  if shutil.which("tee") is None:  # not a POSIX system: the log gets stdout only
    yield
    return
  sys.stderr.flush()
  console = os.dup(2)
  tee = subprocess.Popen(["tee", "-a", str(path)], stdin=subprocess.PIPE, stdout=console,
                         start_new_session=True)  # a signal for the job (SIGTERM, Ctrl-C) is not for the tee
  os.dup2(tee.stdin.fileno(), 2)
  try:
    yield
  finally:
    sys.stderr.flush()
    os.dup2(console, 2)
    os.close(console)
    tee.stdin.close()
    tee.wait()
class _Tee:
  """A text stream that writes to a console stream and a log file."""

  def __init__(self, stream, log_file):
    self._stream, self._log_file = stream, log_file

  def write(self, text: str) -> int:
    self._log_file.write(text)
    return self._stream.write(text)

  def flush(self) -> None:
    self._log_file.flush()
    self._stream.flush()

  def isatty(self) -> bool:
    return self._stream.isatty()

  def fileno(self) -> int:
    return self._stream.fileno()

  def __getattr__(self, name):
    return getattr(self._stream, name)
