"""experiments.bench's command line: a bad mesh or choice is one error line before anything compiles.
(The Bazel target //experiments:bench_test runs one timed step of it.)"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flag, message", [
    ("--preset=megascal", "error: config.mesh.preset='megascal' is invalid: one of 'dp', 'fsdp', 'zero1',"),
    ("--data=3", "the product of the mesh axis sizes (3) must equal the device count (8)"),
    ("--attention=flash", "error: config.parallel.attention='flash' is invalid: one of 'allgather', 'ring',"),
    ("--config=maxtext_tiny", "error: --config='maxtext_tiny' is not a file in experiments/configs/; available: "),
    # --config loads the experiment: maxtext_tiny_moe's mesh has expert=4, so data=8 makes 32 devices.
    ("--config=maxtext_tiny_moe --data=8", "the product of the mesh axis sizes (32) must equal the device count"),
])
def test_bad_flag_is_one_line(flag, message):
  result = subprocess.run([sys.executable, "-m", "experiments.bench", *flag.split()], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, XLA_FLAGS=""))
  assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
  assert message in result.stderr, result.stderr[-3000:]
  assert "train step time" not in result.stdout  # nothing was compiled or timed
