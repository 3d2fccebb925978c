"""tests/BUILD's SLOW table matches the tests' `slow` marks.

Bazel runs each test file as one target (-m 'slow' for files whose tests are all slow, two targets for
files that mix them); .bazel/pytest_main.py fails a target whose -m leaves a test out. CI runs the suite
with pytest, not those targets, so a test added without its file's mark would break only `bazel test`
(this happened once: test_model_sharded's sharded-initialiser test). This check runs in the pytest suite.
"""

import ast
import collections
import json
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

# pytest's own collection, in a process of its own, so that marks from decorators, pytest.param and
# pytestmark all count as pytest applies them.
_COLLECT = """
import json, sys, pytest
class Marks:
  def pytest_collection_modifyitems(self, items):
    with open(sys.argv[1], "w") as f:
      json.dump({item.nodeid: item.get_closest_marker("slow") is not None for item in items}, f)
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[Marks()]))
"""


def _slow_table() -> dict[str, str]:
  text = (REPO / "tests" / "BUILD").read_text()
  literal = re.search(r"^SLOW = (\{.*?^\})", text, re.MULTILINE | re.DOTALL).group(1)
  return ast.literal_eval(literal)  # a Starlark dict of strings is a Python literal


def test_the_slow_table_says_which_files_hold_slow_tests(tmp_path):
  out = tmp_path / "marks.json"
  result = subprocess.run([sys.executable, "-c", _COLLECT, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  by_file = collections.defaultdict(set)
  for nodeid, slow in json.loads(out.read_text()).items():
    by_file[nodeid.split("::")[0].removeprefix("tests/")].add(slow)
  expected = {name: ("all" if marks == {True} else "split") for name, marks in by_file.items() if True in marks}
  table = _slow_table()
  wrong = {name: (table.get(name), want) for name, want in expected.items() if table.get(name) != want}
  wrong |= {name: (kind, None) for name, kind in table.items() if name not in expected}
  assert not wrong, f"tests/BUILD SLOW entries (in the table, what the marks say): {wrong}"
