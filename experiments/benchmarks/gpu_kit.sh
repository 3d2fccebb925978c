#!/usr/bin/env bash
# meshmoe GPU kit: what can only be checked and measured on a real GPU, on one GPU, in one go.
#
#   bash experiments/benchmarks/gpu_kit.sh            # from anywhere; runs from the repository root
#
# 1. the tests marked `gpu` (tests/test_gpu_kernels.py: tokamax's grouped GEMM and flash attention, the MoE
#    FFN, attention and a model's train steps on the real device, meshmoe's Mosaic GPU kernels), against
#    their references: `python -m pytest -m gpu tests/` with JAX_PLATFORMS=cuda;
# 2. experiments/benchmarks/gpu_kernels_bench.py: grouped GEMM (tokamax, meshmoe's Mosaic tiles,
#    lax.ragged_dot, a dense per-expert loop), the whole expert FFN (meshmoe's fused Comet kernels against
#    XLA's unfused ops) and causal attention (the plan's flash kernel, einsum, jax.nn xla/cudnn) at
#    moe_1b's shapes, in TFLOP/s and % of the device's dense bf16 peak;
# 3. moe_1b trained for 100 steps on the one GPU (python -m experiments.train): tokens/s and MFU, the
#    median over the logged steps after the first (which includes compilation), from metrics.jsonl.
#
# Each part runs even when an earlier one failed; the exit status is 1 if any failed. Everything printed
# also goes to $OUT_DIR/gpu_kit.log.
#
# Environment:
#   PYTHON           interpreter with meshmoe, jax[cuda12], tokamax and the test extra (default: the repo's
#                    .venv, else .venv-test, else python3). To make one:
#                    MESHMOE_EXTRAS=test,cuda12 bash experiments/run.sh setup   (creates .venv)
#   OUT_DIR          where the log, bench rows and the training workdir go (default /tmp/meshmoe_gpu_kit_<time>)
#   KIT_PARTS        which parts to run (default "tests bench train")
#   PYTEST_ARGS      extra pytest arguments (e.g. "-x" or "-k attention")
#   BENCH_ARGS       extra gpu_kernels_bench flags (e.g. "--iters=50 --only=gemm"; in a short GPU slot, the fused
#                    kernels' two layouts against cuBLAS and XLA at Mixtral's shapes, without tokamax's tuning:
#                    "--config=mixtral_8x7b --only=gemm,ffn --impls=mosaic,dense_batched,xla_unfused")
#   MOE1B_STEPS      training steps (default 100)
#   MOE1B_BATCH      sequences of 2048 tokens per step (default 64, the config's)
#   MOE1B_ACCUM      micro-batches per step (default 4: 16 sequences, 32K tokens, per micro-batch, which
#                    fits an 80 GB H100 beside the 15 GB of parameters, gradients and Adam moments)
#   MOE1B_FLAGS      extra experiments.train flags (e.g. "--config.parallel.grouped_gemm=blocked")
#   MOE1B_CONFIG     the trained config file (default experiments/configs/moe_1b.py)
#   KEEP_CHECKPOINT  1 keeps the final checkpoint of the training run (about 15 GB); default: deleted
#   KIT_PLATFORM     JAX_PLATFORMS for every part (default cuda). "cpu" is a dry run of the kit itself on a
#                    machine without a GPU (the gpu tests skip; give BENCH_ARGS="--noplatform_check <tiny
#                    shapes>" and MOE1B_CONFIG=experiments/configs/tiny_moe.py): no measurement
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"

out_dir="${OUT_DIR:-/tmp/meshmoe_gpu_kit_$(date +%Y%m%d_%H%M%S)}"
mkdir -p "$out_dir"
out_dir="$(cd "$out_dir" && pwd)"
log="$out_dir/gpu_kit.log"
exec > >(tee -a "$log") 2>&1

if [ -n "${PYTHON:-}" ]; then
  py="$PYTHON"
elif [ -x "$repo/.venv/bin/python" ]; then
  py="$repo/.venv/bin/python"
elif [ -x "$repo/.venv-test/bin/python" ]; then
  py="$repo/.venv-test/bin/python"
else
  py="$(command -v python3)"
fi
parts="${KIT_PARTS:-tests bench train}"
platform="${KIT_PLATFORM:-cuda}"
train_config="${MOE1B_CONFIG:-experiments/configs/moe_1b.py}"
steps="${MOE1B_STEPS:-100}"
batch="${MOE1B_BATCH:-64}"
accum="${MOE1B_ACCUM:-4}"

section() { printf '\n===== %s (%s) =====\n' "$1" "$(date '+%H:%M:%S')"; }
failures=()

section "meshmoe GPU kit"
echo "date:     $(date -Iseconds)"
echo "host:     $(hostname)"
if command -v git >/dev/null 2>&1 && git -C "$repo" rev-parse --short HEAD >/dev/null 2>&1; then
  echo "repo:     $repo ($(git -C "$repo" rev-parse --short HEAD)$(git -C "$repo" diff --quiet HEAD || echo ', with local changes'))"
else
  echo "repo:     $repo"
fi
echo "python:   $py ($("$py" --version 2>&1))"
echo "log:      $log"
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
else
  echo "nvidia-smi: not found"
fi

# JAX must see a GPU; tokamax must import. Nothing else makes sense without them.
export JAX_PLATFORMS="$platform"
if ! "$py" - <<'PY'
import importlib.metadata, os
import jax
devices = jax.devices()
d = devices[0]
if os.environ["JAX_PLATFORMS"] != "cpu":
  assert d.platform == "gpu", f"JAX's first device is {d.platform}, not a GPU"
else:
  print("KIT_PLATFORM=cpu: a dry run of the kit on CPU, no measurement")
import tokamax  # noqa: F401
print(f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, "
      f"tokamax {importlib.metadata.version('tokamax')}")
print(f"devices: {len(devices)} x {d.device_kind} (compute capability {getattr(d, 'compute_capability', '?')}, "
      f"{getattr(d, 'core_count', '?')} SMs); the kit uses the first")
PY
then
  echo "error: no GPU visible to JAX with $py (or tokamax missing). Use an environment with jax[cuda12]:" >&2
  echo "  MESHMOE_EXTRAS=test,cuda12 bash experiments/run.sh setup   # then PYTHON=.venv/bin/python" >&2
  exit 2
fi

# 1. Tests marked `gpu`. JAX_PLATFORMS (exported above) overrides tests/conftest.py's default (cpu); its XLA flags
#    (8 simulated host devices, deviceless CUB mode, LLVM at -O0) leave GPU results alone.
if [[ " $parts " == *" tests "* ]]; then
  section "tests marked gpu"
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  if ! "$py" -m pytest -m gpu tests/ -rs -v -p no:cacheprovider \
      --junitxml="$out_dir/gpu_tests.xml" ${PYTEST_ARGS:-}; then
    failures+=("gpu tests")
  fi
fi

# 2. Kernel benchmark.
if [[ " $parts " == *" bench "* ]]; then
  section "kernel benchmark (moe_1b shapes)"
  # shellcheck disable=SC2086
  if ! "$py" -m experiments.benchmarks.gpu_kernels_bench --config=moe_1b \
      --json_out="$out_dir/gpu_kernels_bench.jsonl" ${BENCH_ARGS:-}; then
    failures+=("kernel benchmark")
  fi
fi

# 3. moe_1b for $steps steps on one GPU. A fresh workdir (an existing one would be resumed).
if [[ " $parts " == *" train "* ]]; then
  section "$(basename "$train_config" .py): $steps steps on one device, $batch sequences per step in $accum micro-batches"
  workdir="$out_dir/$(basename "$train_config" .py)_train"
  rm -rf "$workdir"
  # shellcheck disable=SC2086
  if "$py" -m experiments.train --config="$train_config" --workdir="$workdir" \
      --config.mesh.data=1 --config.mesh.expert=1 --config.mesh.tensor=1 --config.mesh.sequence=1 \
      --config.train.steps="$steps" --config.train.global_batch_size="$batch" \
      --config.train.grad_accum_steps="$accum" --config.train.log_every=10 --config.train.eval_every=0 \
      --config.train.eval_batches=1 --config.checkpoint.every_steps=0 --config.sample.max_new_tokens=0 \
      ${MOE1B_FLAGS:-}; then
    train_ok=1
  else
    train_ok=0
    failures+=("training")
  fi
  if [ -f "$workdir/metrics.jsonl" ]; then
    "$py" - "$workdir" <<'PY' || failures+=("training summary")
import json, pathlib, statistics, sys
workdir = pathlib.Path(sys.argv[1])
records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
train = [r for r in records if r.get("kind") == "train" and isinstance(r.get("tokens_per_s"), (int, float))]
if not train:
  sys.exit("no train records in metrics.jsonl")
timed = train[1:] or train  # the first logged interval includes compilation
mfu = [r["mfu"] for r in timed if isinstance(r.get("mfu"), (int, float))]
print(f"{workdir.name} on one device: {len(timed)} logged intervals after the first (steps {timed[0]['step']}..{timed[-1]['step']})")
print(f"  tokens/s        median {statistics.median(r['tokens_per_s'] for r in timed):,.0f}  "
      f"(min {min(r['tokens_per_s'] for r in timed):,.0f}, max {max(r['tokens_per_s'] for r in timed):,.0f})")
print(f"  step time       median {statistics.median(r['step_time_s'] for r in timed):.3f} s")
print("  MFU             " + (f"median {100 * statistics.median(mfu):.1f}%  (useful FLOPs: meshmoe.analysis.cost_model."
                              f"train_step_flops; peak: meshmoe.training.metrics)" if mfu else
                              "unknown (device kind not in meshmoe.training.metrics' peak table)"))
print(f"  loss            {train[0]['loss']:.3f} at step {train[0]['step']} -> {train[-1]['loss']:.3f} at step {train[-1]['step']}")
plan = workdir / "plan.json"
if plan.is_file():
  ops = json.loads(plan.read_text()).get("ops", {})
  for name in ("attention", "moe"):
    op = ops.get(name)
    if isinstance(op, dict):
      print(f"  plan: {name:9s} " + ", ".join(f"{k}={v}" for k, v in op.items()
                                              if k in ("implementation", "kernel_backend", "grouped_gemm", "gemm_kernels", "fallback") and v))
PY
  fi
  if [ "${KEEP_CHECKPOINT:-0}" != 1 ] && [ -d "$workdir/checkpoints" ]; then
    rm -rf "$workdir/checkpoints"
    echo "(deleted the run's checkpoint; KEEP_CHECKPOINT=1 keeps it)"
  fi
  [ "$train_ok" = 1 ] || echo "training failed; its output is above and in $workdir/logs/"
fi

section "summary"
echo "everything printed above is in $log"
echo "outputs: $out_dir"
if [ ${#failures[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failures[@]}"
  exit 1
fi
echo "all parts passed"
