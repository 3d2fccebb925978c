#!/usr/bin/env bash
# The sh_test main of the experiment binaries' smoke tests: runs the binary $1 with the other arguments
# in the test's scratch directory; it must exit 0 and write the file named by $EXPECT_OUTPUT, if set.
set -euo pipefail
binary="$PWD/$1"  # relative to the runfiles tree, where Bazel starts the test
shift
# Bazel's test environment has no HOME, and outside TEST_TMPDIR the sandbox is read-only.
export HOME="${HOME:-$TEST_TMPDIR}"
cd "$TEST_TMPDIR"
"$binary" "$@"
if [ -n "${EXPECT_OUTPUT:-}" ] && [ ! -s "$EXPECT_OUTPUT" ]; then
  echo "error: $binary exited 0 but wrote no $EXPECT_OUTPUT" >&2
  exit 1
fi
