"""Writes the measured GPU kernel table from the committed measurement runs.

  python -m experiments.benchmarks.kernel_table [--runs='experiments/benchmarks/gpu_runs/*.jsonl']
      [--table=sharding/gpu_kernel_table.json]

Each run is a measure.jsonl of experiments/benchmarks/gpu_measure.py, committed under gpu_runs/ with the
date and device in its name. The table (its rows and the rule that reads them: sharding/gpu_kernel_table.py)
decides which kernel runs each grouped-GEMM form; tests/test_kernel_table.py checks it matches the runs.
"""

from __future__ import annotations

import glob
import json
import pathlib
import sys

from absl import app, flags

from meshmoe.sharding import gpu_kernel_table

REPO = pathlib.Path(__file__).resolve().parents[2]
flags.DEFINE_string("runs", str(REPO / "experiments/benchmarks/gpu_runs/*.jsonl"), "measurement runs (a glob)")
flags.DEFINE_string("table", str(REPO / "sharding/gpu_kernel_table.json"), "the table file to write")
FLAGS = flags.FLAGS


def table_text(run_paths: list[str]) -> str:
  """The table file's text for these runs, in run-name order (a later run's record of the same candidate
  and shape replaces an earlier one)."""
  records = [json.loads(line) for path in sorted(run_paths)
             for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
  rows = gpu_kernel_table.rows_from_measurements(records)
  header = ("Written by `python -m experiments.benchmarks.kernel_table` from experiments/benchmarks/gpu_runs/"
            f"({', '.join(pathlib.Path(p).name for p in sorted(run_paths))}); do not edit by hand.")
  return json.dumps({"about": header, "rows": [r.to_json() for r in rows]}, indent=1) + "\n"


def main(argv):
  del argv
  paths = glob.glob(FLAGS.runs)
  if not paths:
    sys.exit(f"error: --runs={FLAGS.runs!r} matches no file")
  pathlib.Path(FLAGS.table).write_text(table_text(paths))
  print(f"wrote {FLAGS.table} from {len(paths)} run(s)")


if __name__ == "__main__":
  app.run(main)
