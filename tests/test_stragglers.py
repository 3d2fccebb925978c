"""Straggler detection: the comparison rule, and a 2-process run with one process slowed on purpose."""

import json
import re

import pytest

from meshmoe.runtime.stragglers import find_stragglers
from tests import runs


def test_a_process_slower_than_the_median_by_the_factor_is_named():
  own, step = [0.02, 0.03, 0.25, 0.02], [0.4, 0.4, 0.4, 0.4]
  comparison = find_stragglers(own, step, factor=1.5)
  assert comparison.stragglers == [2] and comparison.median_own_time_s == 0.02
  assert find_stragglers([0.02, 0.35], [0.5, 0.5], 1.5).stragglers == [1]  # two processes: the faster is the median


def test_noise_is_not_a_straggler():
  # 3x the median, but 10 ms of a 1 s step: under 10% of the step, the job would not be much faster.
  assert find_stragglers([0.005, 0.005, 0.015], [1.0, 1.0, 1.0], 1.5).stragglers == []
  assert find_stragglers([0.2, 0.25, 0.28], [1.0, 1.0, 1.0], 1.5).stragglers == []  # within the factor
  assert find_stragglers([0.1, 0.1], [0.5, 0.5], 1.5).stragglers == []


@pytest.mark.slow
def test_a_slowed_process_is_named_in_the_logs_and_metrics(tmp_path):
  workdir = tmp_path / "run"
  flags = [*runs.SMALL_FLAGS, "--config.train.steps=8", "--config.checkpoint.every_steps=100",
           "--config.resilience.straggler_every_steps=4", "--debug_straggler=1:0.5"]
  runs.run(runs.launch_command(workdir, *flags))
  output = (workdir / "logs" / "process_0.log").read_text()
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  compared = [r for r in records if r["kind"] == "processes"]
  assert [r["step"] for r in compared] == [4, 8]
  for record in compared:
    assert record["stragglers"] == [1], record
    assert record["own_time_s"][1] > 0.5 > record["own_time_s"][0]
  pattern = (r"warning: step 4: straggler: process 1 on \S+ \([\d.]+ s, [\d.]+x\) spends more time per step on "
             r"its own work than the median process \([\d.]+ s; resilience.straggler_factor=1.5\)")
  assert re.search(pattern, output), output[-3000:]
  assert re.search(pattern, (workdir / "logs" / "process_1.log").read_text())  # named in every process's log
