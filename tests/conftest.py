"""Test set-up: 8 simulated CPU devices, float32 matmuls at full precision; the session's reference run."""
import atexit
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
# One JAX compilation cache for the training runs the tests start (tests/runs.py), made by the pytest
# process that starts the session (xdist's workers inherit it) and removed when that process exits.
if "MESHMOE_TEST_RUN_CACHE" not in os.environ and not os.environ.get("PYTEST_XDIST_WORKER"):
  os.environ["MESHMOE_TEST_RUN_CACHE"] = tempfile.mkdtemp(prefix="meshmoe-test-jit-cache-")
  atexit.register(shutil.rmtree, os.environ["MESHMOE_TEST_RUN_CACHE"], ignore_errors=True)
# Raw data sources are tokenized into this cache on first use (src/data/tokenizing.py): one per machine for
# the test processes (they fill it safely at once), not the user's ~/.cache; Bazel's sandbox has TEST_TMPDIR.
os.environ.setdefault("MESHMOE_CACHE", os.path.join(os.environ.get("TEST_TMPDIR") or tempfile.gettempdir(),
                                                    "meshmoe-test-cache"))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


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
