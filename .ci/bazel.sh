#!/usr/bin/env bash
# CI, Bazel part: build every Bazel target and run the smoke tests (each experiment binary once), offline,
# with the venv that `bash experiments/run.sh test` created (.ci/run runs that first, and with it every
# pytest test). Installs Debian's Bazel 4.2.3
# (bazel-bootstrap) when no bazel is on PATH. README.md, "Bazel".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

venv="${MESHMOE_VENV:-.venv-test}"
if [ ! -x "$venv/bin/python" ]; then
  echo "error: no venv at $venv; run 'bash experiments/run.sh test --collect-only -q' first" >&2
  exit 2
fi
if ! command -v bazel >/dev/null; then
  echo "bazel: installing bazel-bootstrap with apt" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap >/dev/null
fi

# --batch: no Bazel server outlives this script. The whole graph is built (libraries, binaries, every
# test target); only the smoke tests run (.bazelrc, config ci).
bazel --batch test --config=ci //...
