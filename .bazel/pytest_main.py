"""The main of every Bazel test in tests/: runs pytest on the file (and -m marks) given as arguments.

  pytest_main.py tests/test_x.py -m EXPR [--split]

Two checks keep the Bazel targets honest:
- Every test runs in some target. A file's tests are split over two targets by their marks (-m 'not slow'
  and -m slow, with --split) only where tests/BUILD says so; elsewhere a test that -m leaves out fails
  the target, naming the entry of tests/BUILD to change. A split target that selects nothing fails too.
- Bazel starts this file in the test's runfiles tree, where meshmoe's files sit at their import path
  (.bazel/meshmoe_library.bzl). The venv also holds an editable install mapping `meshmoe` to a checkout,
  from which a file missing from the BUILD targets would be imported without a sound; so every loaded
  meshmoe, experiments and tests module must come from the runfiles tree.
"""

import os
import sys

import pytest

CHECKED_PACKAGES = ("meshmoe", "experiments", "tests")
SPLIT_FLAG = "--split"


class Deselected:
  """A pytest plugin that records the tests -m leaves out."""

  def __init__(self):
    self.ids: list[str] = []

  def pytest_deselected(self, items):
    self.ids += [item.nodeid for item in items]


def runfiles_root() -> str:
  """The test's runfiles tree: this file runs from inside it (.../<target>.runfiles/<workspace>/.bazel)."""
  here = os.path.abspath(__file__)
  return here[:here.rindex(".runfiles" + os.sep) + len(".runfiles")]


def modules_outside(root: str) -> list[str]:
  """Loaded modules of CHECKED_PACKAGES whose file is not under `root`, as 'name: file' lines."""
  outside = []
  for name, module in sorted(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if name.split(".")[0] in CHECKED_PACKAGES and path and not os.path.abspath(path).startswith(root + os.sep):
      outside.append(f"{name}: {path}")
  return outside


def main(argv: list[str]) -> int:
  root = runfiles_root()
  # Bazel's test environment has no HOME, and outside TEST_TMPDIR the sandbox is read-only; matplotlib
  # and Jupyter keep caches and runtime files under HOME.
  if "TEST_TMPDIR" in os.environ:
    os.environ.setdefault("HOME", os.environ["TEST_TMPDIR"])
  split = SPLIT_FLAG in argv
  args = [a for a in argv if a != SPLIT_FLAG] + ["-p", "no:cacheprovider"]  # no cache in the runfiles tree
  if "XML_OUTPUT_FILE" in os.environ:
    args.append(f"--junitxml={os.environ['XML_OUTPUT_FILE']}")  # per-test results in Bazel's test.xml
  deselected = Deselected()
  status = int(pytest.main(args, plugins=[deselected]))
  sys.stdout.flush()

  errors = []
  if deselected.ids and not split:
    errors.append(f"{len(deselected.ids)} tests were left out by -m and no other target runs them (first: "
                  f"{deselected.ids[0]}); in SLOW in tests/BUILD, make the file \"split\" (or \"all\")")
  if status == pytest.ExitCode.NO_TESTS_COLLECTED and split:
    errors.append("no test matches -m here; if the file no longer has both slow and other tests, change "
                  "its entry in SLOW in tests/BUILD")
  outside = modules_outside(root)
  if outside:
    errors.append("these modules were not imported from the Bazel runfiles tree; is a file missing from a "
                  "BUILD target's srcs?\n  " + "\n  ".join(outside))
  for error in errors:
    print(f"error: {error}", file=sys.stderr)
  return status or (1 if errors else 0)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
