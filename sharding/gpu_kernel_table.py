"""Which kernel runs each grouped-GEMM form on a GPU, decided by measurements: the measured table and its rule.

The table (`gpu_kernel_table.json` beside this file) holds one row per candidate measured on a GPU by
experiments/benchmarks/gpu_measure.py: GPU generation ("sm90"), operand dtype, shape class (a config's
expert shape: d_model, expert width, experts, rows), form, implementation and tiles, TFLOP/s, whether its
result was correct, and the date, device and command of the measurement. `python -m
experiments.benchmarks.kernel_table` writes it from the committed runs (experiments/benchmarks/gpu_runs/);
tests/test_kernel_table.py checks that it still matches them.

The rule (`choose`), per form, for a device of generation G running operands of dtype T in experts of
widths (d, f):
1. a candidate measured wrong for this form on G, at any shape, is never chosen;
2. among the shape classes measured on (G, T), the nearest to (d, f) (distance |log(d/d')| + |log(f/f')|);
3. there, the fastest candidate measured correct that can take (d, f) (grouped_gemm_kernels.Candidate
   .unsupported); if none can, the next nearest class;
4. no measured row left: the stated default of `DEFAULTS` for G (said so in the plan), else the exact path
   (the blocked GEMM), as for operands other than bfloat16/float16.
Nothing is autotuned in this path. Measuring your own shapes is opt-in: run gpu_measure.py with --shape
for them and point `parallel.kernel_table` at its measure.jsonl; those rows come before the table's.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import math
import pathlib

import jax.numpy as jnp

from meshmoe.sharding.grouped_gemm_kernels import FORMS, KERNEL_DTYPES, Candidate, GemmKernels

# JAX's Hopper kernels' tiles as measured (experiments/benchmarks/gpu_measure.py), for defaults and overrides.
JAX_MGPU_TILES = (("block_m", 128), ("block_n", 128), ("block_k", 64), ("max_concurrent_steps", 4),
                  ("grid_block_n", 1))

# Per generation without a measured row: (forward, input gradient, weight gradient) implementations and
# why. Hopper's are the measured best of 2026-11-27 (for shapes far from every measured class); the others
# are unmeasured: Ampere and Ada run tokamax's Triton kernels (the one family there that has all three
# forms), Blackwell tokamax's Mosaic rows and Triton contraction.
DEFAULTS = {
    "sm90": (("jax_mgpu", "jax_mgpu", "jax_mgpu"), "JAX's Hopper kernels, the fastest correct at every measured shape"),
    "sm100": (("tokamax_mosaic", "tokamax_mosaic", "tokamax_triton"), "tokamax's kernels (not measured here)"),
    "sm80": (("tokamax_triton",) * 3, "tokamax's Triton kernels (not measured here)"),
    "sm86": (("tokamax_triton",) * 3, "tokamax's Triton kernels (not measured here)"),
    "sm89": (("tokamax_triton",) * 3, "tokamax's Triton kernels (not measured here)"),
}


@dataclasses.dataclass(frozen=True)
class Row:
  """One measured candidate (module docstring)."""

  generation: str
  dtype: str
  shape_class: str
  d_model: int
  expert_width: int
  experts: int
  rows: int
  form: str
  implementation: str
  tiles: tuple[tuple[str, int], ...]
  tflops: float
  correct: bool
  error: float | None
  date: str
  device: str
  command: str

  @property
  def candidate(self) -> Candidate:
    return Candidate(self.implementation, self.form, self.tiles)

  def describe(self) -> str:
    return (f"measured {self.date} on {self.device}: {self.tflops:.1f} TFLOP/s at {self.shape_class} "
            f"(d_model {self.d_model}, expert width {self.expert_width})")

  def to_json(self) -> dict:
    return dataclasses.asdict(self) | {"tiles": dict(self.tiles)}

  @classmethod
  def from_json(cls, data: dict) -> Row:
    return cls(**(data | {"tiles": tuple(data.get("tiles", {}).items())}))


def generation(compute_capability: str) -> str:
  """"9.0" -> "sm90"."""
  return "sm" + compute_capability.replace(".", "") if compute_capability else ""


def rows_from_measurements(records: list[dict]) -> list[Row]:
  """Table rows from gpu_measure.py's records (measure.jsonl): its grouped-GEMM rows that were timed
  (the ceiling and failures have no candidate row). The same candidate measured again at the same shape
  keeps its newest record."""
  rows: dict[tuple, Row] = {}
  for r in records:
    if r.get("part") != "gemm" or "tflops" not in r or r.get("implementation") == "dense_batched":
      continue
    row = Row(generation(r["compute_capability"]), r.get("dtype", "bfloat16"), r["config"], r["k"], r["n"] // 2,
              r["experts"], r["m"], r["form"], r["implementation"], tuple(r.get("tiles", {}).items()),
              round(r["tflops"], 1), bool(r["correct"]), r.get("error"), r["date"], r["device"],
              r.get("command", ""))
    rows[(row.generation, row.dtype, row.shape_class, row.form, row.candidate.name)] = row
  return sorted(rows.values(), key=lambda r: (r.generation, r.dtype, r.shape_class, FORMS.index(r.form),
                                              -r.tflops, r.implementation))


@functools.cache
def packaged_rows() -> tuple[Row, ...]:
  text = importlib.resources.files("meshmoe.sharding").joinpath("gpu_kernel_table.json").read_text()
  return tuple(Row.from_json(r) for r in json.loads(text)["rows"])


def load_rows(extra_table: str = "") -> tuple[Row, ...]:
  """The packaged table, after the rows of `extra_table` (a gpu_measure.py measure.jsonl), if given."""
  extra: list[Row] = []
  if extra_table:
    path = pathlib.Path(extra_table)
    try:
      records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"parallel.kernel_table={extra_table!r}: not a readable measure.jsonl of "
                       f"experiments/benchmarks/gpu_measure.py ({e})") from e
    extra = rows_from_measurements(records)
    if not extra:
      raise ValueError(f"parallel.kernel_table={extra_table!r} holds no timed grouped-GEMM row")
  return tuple(extra) + packaged_rows()


def _distance(row: Row, d: int, f: int) -> float:
  return abs(math.log(d / row.d_model)) + abs(math.log(f / row.expert_width))


def choose_form(rows: tuple[Row, ...], form: str, compute_capability: str, dtype, d: int,
                f: int) -> tuple[Candidate | None, str]:
  """(the form's candidate by the rule of the module docstring, the row it came from) or (None, why no
  measured row applies)."""
  gen, dtype_name = generation(compute_capability), jnp.dtype(dtype).name
  mine = [r for r in rows if r.generation == gen and r.form == form]
  wrong = {r.candidate.name for r in mine if not r.correct}
  usable = [r for r in mine if r.dtype == dtype_name and r.correct and r.candidate.name not in wrong]
  if not usable:
    return None, f"no measured {form} row for {gen or 'this device'} and {dtype_name}"
  # Rows of the first source (the user's table) before the packaged ones at equal distance.
  order = {id(r): i for i, r in enumerate(rows)}
  by_class: dict[str, list[Row]] = {}
  for r in usable:
    by_class.setdefault(r.shape_class, []).append(r)
  for _, group in sorted(by_class.items(), key=lambda kv: (_distance(kv[1][0], d, f),
                                                             min(order[id(r)] for r in kv[1]))):
    for r in sorted(group, key=lambda r: -r.tflops):
      if all(r.candidate.unsupported(compute_capability, dtype, k, n) is None for k, n in ((d, 2 * f), (f, d))):
        return r.candidate, r.describe()
  return None, f"no measured {form} candidate for {gen} and {dtype_name} takes widths {d} and {f}"


def measured_row(candidate: Candidate, compute_capability: str, dtype, d: int, f: int,
                 extra_table: str = "") -> Row | None:
  """The row that measured `candidate` correct at exactly widths (d, f) on this GPU generation and dtype
  (the fastest, if several), or None: the planner's measured rate for a grouped GEMM
  (meshmoe.analysis.step_time)."""
  gen, dtype_name = generation(compute_capability), jnp.dtype(dtype).name
  rows = [r for r in load_rows(extra_table)
          if (r.generation, r.dtype, r.form, r.candidate.name, r.d_model, r.expert_width) ==
          (gen, dtype_name, candidate.form, candidate.name, d, f) and r.correct]
  return max(rows, key=lambda r: r.tflops, default=None)


def choose(compute_capability: str, dtype, d: int, f: int, num_sms: int = 0, extra_table: str = "",
           overrides: dict[str, str] | None = None) -> tuple[GemmKernels | None, str]:
  """(the kernels of the three forms, "") or (None, why the GPU kernels cannot run: the exact path runs);
  `overrides`: form -> implementation, chosen by the user (parallel.gemm_kernels)."""
  if jnp.dtype(dtype) not in KERNEL_DTYPES:
    return None, (f"the GPU grouped-GEMM kernels take bfloat16/float16 operands, not {jnp.dtype(dtype).name} "
                  "(model.dtype=bfloat16 runs them)")
  rows = load_rows(extra_table)
  chosen, sources = [], []
  gen = generation(compute_capability)
  for i, form in enumerate(FORMS):
    if overrides and form in overrides:
      implementation = overrides[form]
      tiles = JAX_MGPU_TILES if implementation == "jax_mgpu" else ()
      candidate, source = Candidate(implementation, form, tiles), "set by parallel.gemm_kernels"
    else:
      candidate, source = choose_form(rows, form, compute_capability, dtype, d, f)
      if candidate is None and gen in DEFAULTS:
        implementation = DEFAULTS[gen][0][i]
        tiles = JAX_MGPU_TILES if implementation == "jax_mgpu" else ()
        candidate, source = Candidate(implementation, form, tiles), f"{source}: stated default, {DEFAULTS[gen][1]}"
    if candidate is None:
      return None, f"{source}, and no stated default for {gen or 'this device'}"
    if why := next((why for k, n in ((d, 2 * f), (f, d))
                    if (why := candidate.unsupported(compute_capability, dtype, k, n))), None):
      return None, f"{form} {candidate.name} ({source}) cannot run: {why}"
    chosen.append(candidate)
    sources.append(source)
  return GemmKernels(*chosen, sources=tuple(sources), num_sms=num_sms), ""
