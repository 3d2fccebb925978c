"""Test set-up: 8 simulated CPU devices, float32 matmuls at full precision; the session's reference run."""
import os
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
# Raw data sources are tokenized into this cache on first use (src/data/tokenizing.py): one per machine for
# the test processes (they fill it safely at once), not the user's ~/.cache; Bazel's sandbox has TEST_TMPDIR.
os.environ.setdefault("MESHMOE_CACHE", os.path.join(os.environ.get("TEST_TMPDIR") or tempfile.gettempdir(),
                                                    "meshmoe-test-cache"))

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
  """The uninterrupted reference run (tests/runs.py): one process, 8 devices, 24 steps. Its workdir."""
  from tests import runs

  workdir = tmp_path_factory.mktemp("reference")
  runs.run(runs.train_command(workdir, *runs.REFERENCE_FLAGS))
  return workdir
