"""Test set-up: 8 simulated CPU devices, float32 matmuls at full precision; the session's reference run."""
import atexit
import contextlib
import fcntl
import os
import shutil
import tempfile

# Must happen before jax is imported anywhere. The deviceless-compile flag is deviceless.COMPILE_FLAGS
# (tests compile for H100s in-process); written out here because importing meshmoe would import jax.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
if "--xla_gpu_deviceless_cub_mode" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_gpu_deviceless_cub_mode=DEVICELESS_CUB_DISABLED"
# The tests' CPU programs are small and compiled once each: LLVM's cheapest code generation compiles them
# about a quarter faster, and the HLO (what the tests check) is the same. Subprocess runs (tests/runs.py)
# keep XLA's defaults.
for flag in ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"):
  if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + flag
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's persistent compilation cache for every CPU program the tests compile in-process: a program compiled
# by two tests, or by the last session when the code it comes from is unchanged, is compiled once. The key
# is the program with its debug information stripped, the compile options (XLA flags) and the jaxlib
# version, so any change that changes a program misses. Beside it, meshmoe's cache of the programs compiled
# only to be read (deviceless GPU compiles above all, which JAX's cache cannot hold;
# src/analysis/compiled_cache.py), keyed by the lowered program, devices, options, flags and versions.
# Both live in the user's cache folder
# (~/.cache/meshmoe/test-jit-cache and test-analysis-cache), as pip's and Bazel's do, each pruned at start
# to PERSISTENT_CACHE_BYTES (oldest first); MESHMOE_TEST_JIT_CACHE=session keeps them for this session only,
# removed at exit (Bazel's sandboxed tests always do), and any other value names the folder that holds them.
PERSISTENT_CACHE_BYTES = 3 << 30
# The training runs the tests start (tests/runs.py) use the kept cache when they are one process, and a
# cache made for the session when they are several (runs.py says why).


def _session_cache(variable: str) -> None:
  os.environ[variable] = tempfile.mkdtemp(prefix="meshmoe-test-jit-cache-")
  atexit.register(shutil.rmtree, os.environ[variable], ignore_errors=True)


def _kept_cache(folder: str) -> str:
  os.makedirs(folder, exist_ok=True)
  with contextlib.suppress(FileNotFoundError):  # another session pruning at once
    entries = sorted((e.stat().st_mtime, e.stat().st_size, e.path) for e in os.scandir(folder) if e.is_file())
    total = sum(size for _, size, _ in entries)
    for _, size, path in entries:  # oldest first
      if total <= PERSISTENT_CACHE_BYTES:
        break
      os.remove(path)
      total -= size
  return folder


if not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's workers inherit the session process' choice
  if "MESHMOE_TEST_RUN_CACHE" not in os.environ:
    _session_cache("MESHMOE_TEST_RUN_CACHE")
  if "MESHMOE_TEST_JIT_CACHE_DIR" not in os.environ:
    chosen = os.environ.get("MESHMOE_TEST_JIT_CACHE", "")
    if chosen == "session" or os.environ.get("TEST_TMPDIR"):
      _session_cache("MESHMOE_TEST_JIT_CACHE_DIR")
      _session_cache("MESHMOE_ANALYSIS_CACHE_DIR")
    else:
      kept = chosen or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshmoe")
      os.environ["MESHMOE_TEST_JIT_CACHE_DIR"] = _kept_cache(os.path.join(kept, "test-jit-cache"))
      os.environ["MESHMOE_ANALYSIS_CACHE_DIR"] = _kept_cache(os.path.join(kept, "test-analysis-cache"))
# Raw data sources are tokenized into this cache on first use (src/data/tokenizing.py): one per machine for
# the test processes (they fill it safely at once), not the user's ~/.cache; Bazel's sandbox has TEST_TMPDIR.
os.environ.setdefault("MESHMOE_CACHE", os.path.join(os.environ.get("TEST_TMPDIR") or tempfile.gettempdir(),
                                                    "meshmoe-test-cache"))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ["MESHMOE_TEST_JIT_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # smaller ones recompile faster than read
jax.config.update("jax_persistent_cache_enable_xla_caches", "none")  # XLA's GPU autotuning caches: not wanted
# Source files named from the checkout's (or the venv's) root, so that Mosaic GPU kernels, which carry them,
# lower alike in every clone and a fresh clone finds the analysis cache's entries.
from meshmoe.analysis import compiled_cache  # noqa: E402  (imports jax only)

jax.config.update("jax_hlo_source_file_canonicalization_regex", compiled_cache.LOCAL_ROOTS_PATTERN)


def _cpu_programs_only():
  """Keep deviceless GPU programs out of the cache: JAX writes them but cannot read them back ("PjRtCompiler
  must be constructed with a Client to call DeserializeLoadedExecutable"), so each would cost a write, a
  failed read and a warning. JAX has no per-compile switch; this wraps its one check (private API)."""
  from jax._src import compilation_cache

  is_cache_used = compilation_cache.is_cache_used
  compilation_cache.is_cache_used = lambda backend: backend.platform == "cpu" and is_cache_used(backend)


_cpu_programs_only()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
  """The uninterrupted reference run (tests/runs.py): one process, 8 devices, 24 steps. Its workdir, which
  tests only read. Run once for the whole session: the first pytest-xdist worker to ask runs it while the
  others wait on the lock, then all read the same run (about two minutes on 2 cores)."""
  from tests import runs

  shared = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    shared = shared.parent  # the session's directory, above each worker's own
  workdir, done = shared / "reference", shared / "reference.done"
  with open(shared / "reference.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      shutil.rmtree(workdir, ignore_errors=True)  # a run that failed in another worker
      runs.run(runs.train_command(workdir, *runs.REFERENCE_FLAGS))
      done.touch()
  return workdir
