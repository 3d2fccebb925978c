"""experiments.bench's command line: a bad mesh or choice is one error line before anything compiles.
(The Bazel target //experiments:bench_test runs one timed step of it.) And the GPU kernel bench's dry run
on CPU: the rows --impls asks for, and nothing else."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("flag, message", [
    ("--preset=megascal", "error: config.mesh.preset='megascal' is invalid: one of 'dp', 'fsdp', 'zero1',"),
    # tiny_moe's mesh fills `expert` (expert=-1): 8 devices over data=3 leave no whole expert axis.
    ("--data=3", "error: config.mesh.expert=-1 is invalid: -1 fills the devices left by the other axes, but 8 "
                 "devices are not divisible by their product 3"),
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


def _gpu_kernels_bench(*flags: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.benchmarks.gpu_kernels_bench", "--noplatform_check",
                         "--config=tiny_moe", "--assignments=64", "--iters=1", "--inner=1", "--warmup=0", *flags],
                        cwd=REPO, capture_output=True, text=True, timeout=600,
                        env=dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu"))


def test_gpu_kernels_bench_runs_only_the_implementations_impls_names(tmp_path):
  out = tmp_path / "rows.jsonl"
  result = _gpu_kernels_bench("--only=gemm", "--impls=dense_batched,ragged,kernels", f"--json_out={out}")
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in out.read_text().splitlines()]
  # 3 implementations x 2 GEMM shapes (gate_up, down) x 2 passes, each timed and printed as it finished.
  assert sorted((r["name"], r["shape"].split(":")[0], r["mode"]) for r in rows) == sorted(
      (name, shape, mode) for name in ("dense_batched", "kernels", "ragged_dot") for shape in ("gate_up", "down")
      for mode in ("fwd", "fwd+bwd"))
  # The plan's kernels off GPUs are XLA's for every form; their row's note names them, the others have none.
  exact = "forward xla, input_gradient xla, weight_gradient xla"
  assert all(r["seconds"] > 0 and r["note"] == (exact if r["name"] == "kernels" else "") for r in rows)
  assert all(r["err"] < 1e-2 for r in rows if r["mode"] == "fwd")  # bfloat16 against the float32 loop
  assert sum(line.startswith("  gemm dense_batched ") for line in result.stdout.splitlines()) == 4
  unmatched = _gpu_kernels_bench("--only=gemm", "--impls=mosiac")
  assert unmatched.returncode == 1 and "Traceback" not in unmatched.stderr, unmatched.stderr[-3000:]
  assert ("error: --impls 'mosiac' matched no implementation of the groups run; they have: dense_batched, "
          "dense_loop, kernels, mosaic_tiles ") in unmatched.stderr
