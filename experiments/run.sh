#!/usr/bin/env bash
# meshmoe bootstrap: finds Python >= 3.12, creates .venv with the pinned dependencies if anything is
# missing or changed, then runs one task.
#
#   bash experiments/run.sh train [flags]   train the default experiment (tiny_moe); flags go to experiments.train
#   bash experiments/run.sh test  [pytest args]   run the full test suite on 8 simulated CPU devices
#   bash experiments/run.sh bench [flags]   step time and compiled/model FLOP ratio of the default config
#   bash experiments/run.sh convert --to={orbax|hf} --hf=FOLDER --workdir=DIR
#                                           Hugging Face checkpoints in and out (experiments/convert.py)
#   bash experiments/run.sh launch --processes=P --devices_per_process=D -- [train flags]
#                                           a P-process job on this machine (experiments/launch.py)
#   bash experiments/run.sh setup           only create or update the virtual environment
#
# Environment: MESHMOE_PYTHON=/path/to/python3.12 picks the interpreter; MESHMOE_VENV moves the venv
# (default: .venv, and .venv-test for the tests); MESHMOE_EXTRAS sets the pip extras (default "test", and
# "test,deviceless" for the tests). The tests get their own venv because the deviceless extra (the CUDA
# PJRT plugin, to compile for GPUs without one) logs CUDA-driver warnings on every start of a CPU run.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
if [ "${1:-}" = test ]; then
  venv="${MESHMOE_VENV:-$repo/.venv-test}"
  extras="${MESHMOE_EXTRAS:-test,deviceless}"
else
  venv="${MESHMOE_VENV:-$repo/.venv}"
  extras="${MESHMOE_EXTRAS:-test}"
fi

python_ok() { "$1" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; }

find_python() {
  local candidates=()
  [ -n "${MESHMOE_PYTHON:-}" ] && candidates+=("$MESHMOE_PYTHON")
  candidates+=(python3.12 python3.13 python3 python)
  # pyenv and uv keep interpreters outside PATH; look there too (3.12 first: the GPU image runs 3.12).
  local root
  for root in "${PYENV_ROOT:-$HOME/.pyenv}/versions" "$HOME/.local/share/uv/python"; do
    [ -d "$root" ] && candidates+=($(ls -d "$root"/*3.1[2-9]* 2>/dev/null | sort -V | sed 's|$|/bin/python3|'))
  done
  candidates+=(/usr/bin/python3.12 /usr/bin/python3.13 /usr/local/bin/python3.12 /usr/local/bin/python3.13)
  local c path
  for c in "${candidates[@]}"; do
    path="$(command -v "$c" 2>/dev/null || true)"
    if [ -n "$path" ] && python_ok "$path"; then echo "$path"; return 0; fi
  done
  return 1
}

ensure_venv() {
  if [ ! -x "$venv/bin/python" ] || ! python_ok "$venv/bin/python"; then
    local py
    if ! py="$(find_python)"; then
      cat >&2 <<MSG
meshmoe needs Python >= 3.12 (JAX >= 0.11 does), and none was found on PATH, in pyenv or in uv.
Install one, e.g. 'apt-get install python3.12 python3.12-venv', 'pyenv install 3.12' or 'uv python install 3.12',
or point MESHMOE_PYTHON at an existing interpreter: MESHMOE_PYTHON=/path/to/python3.12 bash experiments/run.sh ...
MSG
      exit 2
    fi
    echo "meshmoe: creating $venv with $py ($("$py" --version 2>&1))" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
  fi
  # Reinstall only when the pins, the package metadata or the extras changed.
  local stamp="$venv/.meshmoe-install-stamp"
  local want
  want="$(cat pyproject.toml requirements/constraints.txt | sha256sum | cut -d' ' -f1) extras=$extras"
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # pip's own output (and the build backend's notices about editable installs) goes to a log, shown
    # only when the install fails: a first run prints meshmoe's lines, not pages of packaging chatter.
    local log="$venv/pip-install.log"
    echo "meshmoe: installing pinned dependencies into $venv (extras: $extras; a few minutes the first time)" >&2
    if ! { "$venv/bin/python" -m pip install --disable-pip-version-check --upgrade pip &&
           "$venv/bin/python" -m pip install --disable-pip-version-check \
             -c requirements/constraints.txt -e ".[$extras]"; } >"$log" 2>&1; then
      tail -n 40 "$log" >&2
      echo "meshmoe: installing the dependencies failed; the whole pip output is in $log" >&2
      exit 1
    fi
    echo "$want" > "$stamp"
  fi
}

task="${1:-}"
[ $# -gt 0 ] && shift
case "$task" in
  train)
    ensure_venv
    # Without an accelerator, simulate MESHMOE_CPU_DEVICES (default 8) devices so the mesh has every axis.
    export XLA_FLAGS="--xla_force_host_platform_device_count=${MESHMOE_CPU_DEVICES:-8} ${XLA_FLAGS:-}"
    exec "$venv/bin/python" -m experiments.train "$@" ;;
  test)
    ensure_venv
    # The suite runs on 8 simulated CPU devices; tests/conftest.py sets the same flag for direct pytest use.
    export XLA_FLAGS="--xla_force_host_platform_device_count=8 ${XLA_FLAGS:-}"
    export JAX_PLATFORMS=cpu
    # pytest runs tests/ (pyproject.toml's testpaths) unless given paths. pytest-xdist workers, one per
    # core up to 4: XLA compiles on one thread, so a second worker keeps a second core busy; each worker
    # holds its own 8 devices (a few GiB). MESHMOE_TEST_WORKERS=0: no workers.
    cores="$(nproc)"
    workers="${MESHMOE_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
    exec "$venv/bin/python" -m pytest -n "$workers" --dist worksteal --durations=20 "$@" ;;
  bench) ensure_venv; exec "$venv/bin/python" -m experiments.bench "$@" ;;
  convert) ensure_venv; exec "$venv/bin/python" -m experiments.convert "$@" ;;
  launch) ensure_venv; exec "$venv/bin/python" -m experiments.launch "$@" ;;
  setup) ensure_venv ;;
  *)
    echo "usage: bash experiments/run.sh {train|test|bench|convert|launch|setup} [args...]" >&2
    exit 2 ;;
esac
