"""The measured GPU kernel table and its rule (sharding/gpu_kernel_table.py), and the script that measures it.

Runs on CPU: the table is data and the rule is arithmetic on it; the GPU measurement script runs its dry
run (the same code at tiny shapes, XLA's candidates). What only a GPU shows (that the chosen kernels are
correct and fast there) is tests/test_gpu_kernels.py's and the script's on a real GPU.
"""

import importlib.util
import json
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from experiments.benchmarks import gemm_cases, kernel_table
from meshmoe.sharding import gpu_kernel_table, grouped_gemm_kernels
from meshmoe.sharding.grouped_gemm_kernels import Candidate

REPO = pathlib.Path(__file__).resolve().parents[1]
RUNS = sorted(str(p) for p in (REPO / "experiments/benchmarks/gpu_runs").glob("*.jsonl"))
BF16 = jnp.bfloat16


def test_the_committed_table_is_the_one_the_committed_runs_give():
  committed = (REPO / "sharding/gpu_kernel_table.json").read_text()
  assert committed == kernel_table.table_text(RUNS), (
      "sharding/gpu_kernel_table.json differs from the runs: python -m experiments.benchmarks.kernel_table")


def _record(config, form, implementation, tflops, correct, d=1024, f=512, cc="9.0", tiles=None):
  """A gpu_measure.py grouped-GEMM record (the fields the table reads)."""
  return {"part": "gemm", "config": config, "form": form, "implementation": implementation,
          "tiles": tiles or {}, "m": 4096, "k": d, "n": 2 * f, "experts": 8, "tflops": tflops,
          "correct": correct, "error": 1e-3 if correct else 0.2, "date": "2026-01-01", "device": "GPU",
          "compute_capability": cc, "dtype": "bfloat16", "command": "cmd"}


def _rows(*records):
  return tuple(gpu_kernel_table.rows_from_measurements(list(records)))


def test_a_candidate_measured_wrong_anywhere_is_never_chosen_even_where_it_is_the_fastest():
  rows = _rows(_record("a", "weight_gradient", "tokamax_mosaic", 900.0, True),  # right here...
               _record("b", "weight_gradient", "tokamax_mosaic", 800.0, False, d=4096),  # ...wrong there
               _record("a", "weight_gradient", "meshmoe_mosaic", 150.0, True),
               _record("a", "weight_gradient", "xla", 10.0, True))
  candidate, source = gpu_kernel_table.choose_form(rows, "weight_gradient", "9.0", BF16, 1024, 512)
  assert candidate == Candidate("meshmoe_mosaic", "weight_gradient")
  assert source == "measured 2026-01-01 on GPU: 150.0 TFLOP/s at a (d_model 1024, expert width 512)"


def test_the_packaged_table_never_chooses_what_it_measured_wrong():
  """For every form and generation with a wrong row, at every measured shape class' widths."""
  rows = gpu_kernel_table.packaged_rows()
  wrong = {(r.generation, r.form, r.candidate.name) for r in rows if not r.correct}
  assert ("sm90", "weight_gradient", "tokamax_mosaic") in wrong  # measured 2026-11-27 (RESULTS.md)
  for r in rows:
    cc = r.generation[2] + "." + r.generation[3:]
    chosen, _ = gpu_kernel_table.choose_form(rows, r.form, cc, BF16, r.d_model, r.expert_width)
    assert (r.generation, r.form, chosen.name) not in wrong


def test_the_nearest_measured_shape_class_decides():
  rows = _rows(_record("small", "forward", "tokamax_mosaic", 300.0, True, d=1024, f=512),
               _record("small", "forward", "jax_mgpu", 200.0, True, d=1024, f=512, tiles=dict(gpu_kernel_table.JAX_MGPU_TILES)),
               _record("large", "forward", "tokamax_mosaic", 300.0, True, d=7168, f=2048),
               _record("large", "forward", "jax_mgpu", 450.0, True, d=7168, f=2048, tiles=dict(gpu_kernel_table.JAX_MGPU_TILES)))
  near_small, _ = gpu_kernel_table.choose_form(rows, "forward", "9.0", BF16, 1536, 768)
  near_large, _ = gpu_kernel_table.choose_form(rows, "forward", "9.0", BF16, 4096, 2048)
  assert (near_small.implementation, near_large.implementation) == ("tokamax_mosaic", "jax_mgpu")


@pytest.mark.parametrize("jax_triton", [True, False])
def test_an_ampere_gpu_gets_the_stated_triton_default_or_the_exact_path(monkeypatch, jax_triton):
  """No row measured on sm80: tokamax's Triton kernels where jax-triton imports, else the blocked GEMM, with
  the reason in one line."""
  real = importlib.util.find_spec
  monkeypatch.setattr(grouped_gemm_kernels.importlib.util, "find_spec",
                      lambda name, *a: (object() if jax_triton else None) if name == "jax_triton" else real(name, *a))
  kernels, why = gpu_kernel_table.choose("8.0", BF16, 4096, 14336)
  if jax_triton:
    assert [c.implementation for c in kernels.candidates()] == ["tokamax_triton"] * 3 and why == ""
    assert kernels.sources[0] == ("no measured forward row for sm80 and bfloat16: stated default, tokamax's "
                                  "Triton kernels (not measured here)")
  else:
    assert kernels is None and "need jax-triton" in why and "\n" not in why


def test_widths_a_kernel_cannot_tile_pass_to_the_next_measured_candidate():
  """Expert width 48 (a fused gate/up width of 96): JAX's kernels tile by 128 and tokamax's Mosaic kernels
  copy 64-element swizzled tiles, so neither takes it (tokamax's raised deep in Mosaic when it was tried);
  the forward falls to the fastest correct candidate left at the nearest class (moe_1b): XLA's ragged dot,
  22.6 TFLOP/s there against 22.5 for the cuDNN fusion."""
  assert Candidate("tokamax_mosaic", "forward").unsupported("9.0", BF16, 32, 96) == (
      "tokamax's Mosaic GPU kernels tile a width above 64 by 64: 96 is not a multiple")
  assert Candidate("tokamax_mosaic", "forward").unsupported("9.0", BF16, 32, 128) is None
  chosen, _ = gpu_kernel_table.choose_form(gpu_kernel_table.packaged_rows(), "forward", "9.0", BF16, 32, 48)
  assert chosen == Candidate("xla", "forward")


def test_a_gpu_without_kernels_runs_the_exact_path_and_says_so_in_one_line():
  kernels, why = gpu_kernel_table.choose("7.5", BF16, 2048, 768)  # a T4
  assert kernels is None
  assert why == "no measured forward row for sm75 and bfloat16, and no stated default for sm75"


def test_rows_measured_at_your_own_shapes_come_first(tmp_path):
  """The opt-in tuning: gpu_measure.py's measure.jsonl at a user's shape, given as parallel.kernel_table."""
  own = tmp_path / "measure.jsonl"
  records = [_record("mine", "forward", "tokamax_mosaic", 700.0, True, d=1024, f=512)]
  own.write_text("".join(json.dumps(r) + "\n" for r in records))
  kernels, why = gpu_kernel_table.choose("9.0", BF16, 1024, 512, extra_table=str(own))
  assert why == "" and kernels.forward == Candidate("tokamax_mosaic", "forward")
  assert kernels.sources[0].endswith("700.0 TFLOP/s at mine (d_model 1024, expert width 512)")
  assert kernels.weight_gradient.implementation == "jax_mgpu"  # forms not measured there: the packaged table
  (tmp_path / "bad.jsonl").write_text("not json\n")
  with pytest.raises(ValueError, match=r"parallel.kernel_table=.*bad.jsonl.*not a readable measure.jsonl"):
    gpu_kernel_table.choose("9.0", BF16, 1024, 512, extra_table=str(tmp_path / "bad.jsonl"))


@pytest.mark.parametrize("form", grouped_gemm_kernels.FORMS)
def test_the_measurement_script_s_reference_and_error_catch_a_wrong_group(form):
  """gpu_measure.py's check: its float32 padded reference agrees with a loop over groups, and one wrong
  group (here the one-row group), or a weight gradient written into an empty group, fails the check."""
  rng = np.random.default_rng(0)
  sizes = gemm_cases.group_sizes(6, 50, uneven=True)
  assert sizes[0] == 0 and sizes[1] == 1 and sizes.sum() == 50
  k, n = 8, 12
  a = rng.standard_normal((50, n if form == "input_gradient" else k)).astype(np.float32)
  b = rng.standard_normal((50, n) if form == "weight_gradient" else (6, k, n)).astype(np.float32)
  ref = np.asarray(gemm_cases.padded_reference(form, a, b, sizes))
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  loop = [(a[lo:hi].T @ b[lo:hi]) if form == "weight_gradient" else
          a[lo:hi] @ (b[g] if form == "forward" else b[g].T) for g, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
  expected = np.stack(loop) if form == "weight_gradient" else np.concatenate(loop)
  np.testing.assert_allclose(ref, expected, rtol=1e-5, atol=1e-5)
  assert gemm_cases.per_group_error(form, expected, ref, sizes)[0] < 1e-6
  broken = expected.copy()
  if form == "weight_gradient":
    broken[1] *= 1.1
  else:
    broken[bounds[1]] *= 1.1  # the one-row group
  err, _ = gemm_cases.per_group_error(form, broken, ref, sizes)
  assert err > gemm_cases.GEMM_TOLERANCE
  if form == "weight_gradient":
    written = expected.copy()
    written[0] = 1.0
    assert gemm_cases.per_group_error(form, written, ref, sizes) == (np.inf, "group 0 has no rows but a "
                                                                               "non-zero weight gradient")


def test_the_measurement_script_dry_run_writes_its_rows_and_tables(tmp_path):
  """The script end to end on CPU (--dry_run: tiny shapes, XLA's candidates, tiny_moe's training): every
  part runs in its own process, each row lands in measure.jsonl, measure.md has the three tables."""
  out = tmp_path / "out"
  result = subprocess.run([sys.executable, "-m", "experiments.benchmarks.gpu_measure", f"--out={out}",
                           "--dry_run", "--budget_s=400", f"--train_root={tmp_path / 'runs'}", "--train_steps=10"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  rows = [json.loads(line) for line in (out / "measure.jsonl").read_text().splitlines()]
  gemm = [r for r in rows if r["part"] == "gemm"]
  assert sorted(r["form"] for r in gemm) == sorted(grouped_gemm_kernels.FORMS)
  assert all(r["correct"] and r["tflops"] > 0 and r["command"] for r in gemm)
  attention = [r for r in rows if r["part"] == "attention"]
  assert all(r["correct"] for r in attention) and any(r["documents"] for r in attention)
  train = [r for r in rows if r["part"] == "train"]
  assert len(train) == 1 and train[0]["tokens_per_s"] > 0 and train[0]["loss"][1] < train[0]["loss"][0]
  md = (out / "measure.md").read_text()
  assert "## Grouped GEMM" in md and "## Causal attention" in md and "## Training on one device" in md


def test_the_measurement_script_refuses_unknown_parts_in_one_line(tmp_path):
  result = subprocess.run([sys.executable, "-m", "experiments.benchmarks.gpu_measure", f"--out={tmp_path}",
                           "--parts=gemm,tests_typo"], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode != 0
  assert "error: unknown --parts/--shapes tests_typo" in result.stderr.strip().splitlines()[-1]


# The kernels the plan must run for bfloat16 on an H100/H200 at every shipped config's expert shape, written
# out (RESULTS.md, 2026-11-27, one H200: JAX's Hopper kernels the fastest correct for each form at each).
EXPECTED_ON_SM90 = {"moe_1b": ("jax_mgpu",) * 3, "mixtral_8x7b": ("jax_mgpu",) * 3,
                    "qwen3_30b_a3b": ("jax_mgpu",) * 3, "deepseek_v3": ("jax_mgpu",) * 3}


@pytest.mark.parametrize("config", sorted(EXPECTED_ON_SM90))
def test_hopper_runs_the_kernels_written_out_for_each_shipped_shape(config):
  shape = gemm_cases.SHAPES[config]
  kernels, why = gpu_kernel_table.choose("9.0", BF16, shape.d_model, shape.expert_width)
  assert why == "" and tuple(c.implementation for c in kernels.candidates()) == EXPECTED_ON_SM90[config]
