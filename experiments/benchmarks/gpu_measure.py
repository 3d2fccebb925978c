"""Everything meshmoe measures on one GPU, in one command that fits a short lease: correctness, speed, training.

  python -m experiments.benchmarks.gpu_measure --out=DIR [--budget_s=480] [--parts=gemm,train,attention]
      [--shapes=moe_1b,mixtral_8x7b,qwen3_30b_a3b,deepseek_v3] [--shape=E,M,D,F] [--implementations=PREFIX,...]
      [--train_runs=moe_1b,qwen3_30b_a3b_proxy]
  (experiments/benchmarks/gpu_measure.sh installs carried wheels first and runs this.)

Parts, each in its own process (a part's GPU memory is free for the next; a part cut off by its time share
loses only the rows it had not finished), in the order given:
- `gemm`: every candidate implementation of the grouped GEMM's three forms (sharding/grouped_gemm_kernels.py:
  forward, input gradient, weight gradient) at each shipped config's expert shape. Each candidate is compiled
  once, then (a) checked on uneven routing (an empty group, a one-row group, the rest drawn from a skewed
  Dirichlet) against a float32 reference that multiplies each group's rows as a padded dense batch (no
  ragged kernel), per group: relative Frobenius error <= GEMM_TOLERANCE, every value finite, empty groups'
  weight gradients exactly 0; then (b) timed on balanced routing: TFLOP/s of useful FLOPs (2 M K N);
- `attention`: causal GQA attention forward and backward, tokamax's flash kernels and jax.nn's cuDNN and
  XLA versions, checked against float32 attention (output and the three gradients) and timed; tokamax's
  kernels also within packed documents (data.document_mask: each query's key range), against float32
  attention within the same documents;
- `train`: experiments.train on the one GPU, moe_1b and a one-GPU proxy of Qwen3-30B-A3B (its real widths,
  128 experts top-8, PROXY_LAYERS layers): tokens/s and MFU over the logged steps after the first (no
  checkpoint is written); `moe_1b_before` runs moe_1b with the kernels of before the table (tokamax's
  Mosaic rows, meshmoe's weight gradient), when --train_runs names it;
- `tests` (only when named): the tests marked `gpu` (pytest -m gpu tests/), pass or fail per test.

Your own shapes (the opt-in tuning): --shape=E,M,D,F measures E experts, M rows, d_model D, expert width F
as the shape class "custom"; give the resulting measure.jsonl to `parallel.kernel_table`.

Every row is appended to DIR/measure.jsonl as it finishes and printed; DIR/measure.md is the tables,
rewritten after each part. Nothing autotunes: tokamax runs its tuned table or its heuristics.

Shapes (`SHAPES`): the gate+up GEMM (K = d_model, N = 2 x expert width) of one device's micro-batch, with
the experts that device holds under the config's layout.

--dry_run runs the same code on CPU at tiny shapes (the XLA candidates, tiny_moe's training): a check
that the script works, not a measurement.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import time
import traceback

from absl import app, flags

from experiments.benchmarks.gemm_cases import (GEMM_TOLERANCE, SHAPES, DRY_RUN_SHAPES, GemmShape, group_sizes,
                                                padded_reference, per_group_error)

PARTS = ("gemm", "train", "attention", "tests")  # the default order (without tests): the least measured first
DEFAULT_PARTS = PARTS[:3]
ATTENTION_TOLERANCE = 2e-2  # bf16 probabilities and score gradients are rounded before their products
PROXY_LAYERS = 4


# Candidates per form: (implementation, tiles); jax_mgpu once per --mgpu_tiles entry (its keyword arguments).
CANDIDATES = {
    "forward": ["tokamax_mosaic", "tokamax_triton", "jax_mgpu", "xla_cudnn", "xla"],
    "input_gradient": ["tokamax_mosaic", "tokamax_triton", "jax_mgpu", "xla_cudnn", "xla"],
    "weight_gradient": ["meshmoe_mosaic", "tokamax_triton", "jax_mgpu", "tokamax_mosaic", "xla"],
}
MGPU_TILE_NAMES = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
# XLA's ragged_dot computes every group densely (E x the useful FLOPs): not timed where that is more than this.
XLA_DENSE_MAX_FLOPS = 5e12

flags.DEFINE_string("out", None, "folder for measure.jsonl, measure.md and the training runs", required=True)
flags.DEFINE_float("budget_s", 480.0, "wall-clock seconds for all parts together")
flags.DEFINE_list("parts", list(DEFAULT_PARTS), f"parts in the order to run: {', '.join(PARTS)}")
flags.DEFINE_list("shapes", list(SHAPES), f"configs whose shapes are measured: {', '.join(SHAPES)}")
flags.DEFINE_string("shape", None, "E,M,D,F: also measure E experts, M rows, d_model D, expert width F ('custom')")
flags.DEFINE_list("train_runs", ["moe_1b", "qwen3_30b_a3b_proxy"], "training runs (moe_1b, qwen3_30b_a3b_proxy, "
                  "moe_1b_before)")
flags.DEFINE_list("implementations", [], "only candidates whose names start with one of these (default: all)")
flags.DEFINE_list("mgpu_tiles", ["128x128x64x4x1"], "tiles of JAX's Hopper kernels to measure, each "
                  "BLOCK_MxBLOCK_NxBLOCK_KxSTAGESxGRID_BLOCK_N (a sweep: several)")
flags.DEFINE_integer("iters", 10, "timed samples per row (median reported)", lower_bound=1)
flags.DEFINE_integer("inner", 5, "calls per timed sample, launched back to back", lower_bound=1)
flags.DEFINE_integer("train_steps", 30, "training steps per run", lower_bound=2)
flags.DEFINE_string("train_root", "/tmp/meshmoe_measure_runs", "where the training runs' workdirs go")
flags.DEFINE_bool("dry_run", False, "CPU, tiny shapes: check the script, measure nothing")
flags.DEFINE_string("part", None, "internal: run one part in this process")
flags.DEFINE_float("deadline", 0.0, "internal: time.time() by which the part must end")
FLAGS = flags.FLAGS

# Shares of the budget per part (the rest of a part's share passes to the next).
_SHARES = {"gemm": 0.55, "train": 0.3, "attention": 0.15, "tests": 0.3}


# Shared -------------------------------------------------------------------------------------------------------

COMMAND_VARIABLE = "MESHMOE_MEASURE_COMMAND"  # the command line the rows record (gpu_measure.sh sets it)


def emit(row: dict) -> None:
  """Appends one row to measure.jsonl and prints it."""
  with open(pathlib.Path(FLAGS.out) / "measure.jsonl", "a") as out:
    out.write(json.dumps(row) + "\n")
  shown = {k: v for k, v in row.items() if k not in ("device", "date")}
  print("  " + json.dumps(shown), flush=True)


def device_info() -> dict:
  import jax

  d = jax.devices()[0]
  return {"device": d.device_kind, "platform": d.platform,
          "compute_capability": str(getattr(d, "compute_capability", "") or ""),
          "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "dtype": "bfloat16",
          "command": os.environ.get(COMMAND_VARIABLE, "")}


def time_call(fn, args) -> float:
  """Median seconds per call of a compiled `fn` (FLAGS.iters samples of FLAGS.inner back-to-back calls)."""
  import jax
  import numpy as np

  for _ in range(2):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(FLAGS.iters):
    start = time.perf_counter()
    for _ in range(FLAGS.inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / FLAGS.inner)
  return float(np.median(samples))


def wanted(name: str) -> bool:
  return not FLAGS.implementations or any(name.startswith(p) for p in FLAGS.implementations)


def out_of_time(margin_s: float = 0.0) -> bool:
  return time.time() + margin_s > FLAGS.deadline


def error_note(e: BaseException) -> str:
  text = str(e).strip().splitlines()
  return f"error: {type(e).__name__}: {text[0][:200] if text else ''}"


# Grouped GEMM -------------------------------------------------------------------------------------------------


def mgpu_tiles() -> list[tuple[tuple[str, int], ...]]:
  """--mgpu_tiles as Candidate tiles."""
  tiles = []
  for text in FLAGS.mgpu_tiles:
    parts = text.split("x")
    if len(parts) != len(MGPU_TILE_NAMES) or not all(p.isdigit() and int(p) > 0 for p in parts):
      raise ValueError(f"--mgpu_tiles entry {text!r}: BLOCK_MxBLOCK_NxBLOCK_KxSTAGESxGRID_BLOCK_N, five positive "
                       "integers (e.g. 128x128x64x4x1)")
    tiles.append(tuple(zip(MGPU_TILE_NAMES, map(int, parts))))
  return tiles


def custom_shape(text: str) -> GemmShape:
  parts = text.split(",")
  if len(parts) != 4 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"--shape={text!r}: E,M,D,F, four positive integers (experts, rows, d_model, expert width)")
  e, m, d, f = map(int, parts)
  return GemmShape(e, m, d, f, "--shape")


def gemm_part(info: dict) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from meshmoe.sharding.grouped_gemm_kernels import Candidate

  shapes = DRY_RUN_SHAPES if FLAGS.dry_run else {name: SHAPES[name] for name in FLAGS.shapes}
  if FLAGS.shape:
    shapes["custom"] = custom_shape(FLAGS.shape)
  for config, shape in shapes.items():
    m, k, n, e = shape.rows, shape.k, shape.n, shape.experts
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
    operands = {"forward": (x, w), "input_gradient": (dy, w), "weight_gradient": (x, dy)}
    uneven, balanced = group_sizes(e, m, True), group_sizes(e, m, False)
    for form, implementations in CANDIDATES.items():
      a, b = operands[form]
      reference = None
      candidates = [(i, t) for i in implementations for t in (mgpu_tiles() if i == "jax_mgpu" else [()])]
      for implementation, tiles in candidates:
        if FLAGS.dry_run and implementation != "xla":  # the others need a GPU
          continue
        candidate = Candidate(implementation, form, tiles)
        if not wanted(candidate.name):
          continue
        row = info | {"part": "gemm", "config": config, "form": form, "candidate": candidate.name,
                      "implementation": implementation, "tiles": dict(tiles), "m": m, "k": k, "n": n, "experts": e,
                      "flops": 2.0 * m * k * n}
        if implementation == "xla" and row["flops"] * e > XLA_DENSE_MAX_FLOPS:
          emit(row | {"note": f"not run: XLA's ragged_dot is dense over all {e} groups"})
          continue
        if not FLAGS.dry_run and (why := candidate.unsupported(info["compute_capability"], jnp.bfloat16, k, n)):
          emit(row | {"note": f"not run: {why}"})
          continue
        if out_of_time(margin_s=15):
          emit(row | {"note": "not run: out of time"})
          continue
        try:
          if reference is None:
            reference = padded_reference(form, a, b, uneven)
          compiled = jax.jit(candidate.fn()).lower(a, b, jnp.asarray(uneven, jnp.int32)).compile(
              candidate.compiler_options or None)
          err, why = per_group_error(form, compiled(a, b, jnp.asarray(uneven, jnp.int32)), reference, uneven)
          row |= {"error": err, "correct": bool(not why and err <= GEMM_TOLERANCE), "why": why}
          seconds = time_call(compiled, (a, b, jnp.asarray(balanced, jnp.int32)))
          row |= {"seconds": seconds, "tflops": row["flops"] / seconds / 1e12}
        except Exception as e_:  # noqa: BLE001: one candidate's failure is its row, not the end of the part
          row["note"] = error_note(e_)
          traceback.print_exc(file=sys.stderr)
        emit(row)
    if not FLAGS.dry_run and wanted("dense_batched") and not out_of_time(15):
      # The ceiling: the same FLOPs as one batched dense GEMM (cuBLAS), no raggedness.
      row = info | {"part": "gemm", "config": config, "form": "forward", "candidate": "dense_batched (ceiling)",
                    "implementation": "dense_batched", "m": m, "k": k, "n": n, "experts": e, "flops": 2.0 * m * k * n}
      try:
        fn = jax.jit(lambda x, w: jnp.einsum("egk,ekn->egn", x.reshape(e, m // e, k), w).reshape(m, n))
        seconds = time_call(fn, (x, w))
        row |= {"seconds": seconds, "tflops": row["flops"] / seconds / 1e12}
      except Exception as e_:  # noqa: BLE001
        row["note"] = error_note(e_)
      emit(row)
    del x, w, dy, operands


# Attention ----------------------------------------------------------------------------------------------------

ATTENTION_SHAPES = {  # (batch, seq, query heads, kv heads, head dim)
    "moe_1b": (4, 2048, 16, 4, 64),
    "qwen3_30b_a3b": (2, 4096, 32, 4, 128),
    "mixtral_8x7b": (2, 4096, 32, 8, 128),
}


def attention_part(info: dict) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from meshmoe.sharding import attention_kernels
  from meshmoe.sharding import context_parallel as cp

  shapes = {"tiny": (1, 64, 4, 2, 16)} if FLAGS.dry_run else {c: ATTENTION_SHAPES[c] for c in FLAGS.shapes
                                                              if c in ATTENTION_SHAPES}
  # name -> (attention of q, k, v given each token's document start or None, whether packed documents)
  impls = {"tokamax_mosaic": (lambda q, k, v, _: attention_kernels.causal(q, k, v, "mosaic"), False),
           "tokamax_triton": (lambda q, k, v, _: attention_kernels.causal(q, k, v, "triton"), False),
           "cudnn": (lambda q, k, v, _: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                      implementation="cudnn"), False),
           "xla": (lambda q, k, v, _: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                    implementation="xla"), False),
           # data.document_mask: the same kernels with each query's key range
           "tokamax_mosaic_documents": (lambda q, k, v, st: attention_kernels.causal(q, k, v, "mosaic", st), True),
           "tokamax_triton_documents": (lambda q, k, v, st: attention_kernels.causal(q, k, v, "triton", st), True)}
  if FLAGS.dry_run:
    impls = {"tokamax_xla": (lambda q, k, v, _: attention_kernels.causal(q, k, v, "xla"), False),
             "tokamax_xla_documents": (lambda q, k, v, st: attention_kernels.causal(q, k, v, "xla", st), True),
             "xla": impls["xla"]}
  for config, (bsz, s, nh, g, h) in shapes.items():
    keys = jax.random.split(jax.random.key(2), 4)
    q, k, v, ct = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                   for key, shape in zip(keys, ((bsz, s, nh, h), (bsz, s, g, h), (bsz, s, g, h), (bsz, s, nh, h))))
    pos = jnp.broadcast_to(jnp.arange(s), (bsz, s))
    # Packed documents of an eighth, three eighths and two quarters of the row.
    lengths = [s // 8, 3 * s // 8, s // 4, s - s // 8 - 3 * s // 8 - s // 4]
    starts = jnp.broadcast_to(jnp.asarray(np.repeat(np.cumsum([0] + lengths[:-1]), lengths), jnp.int32), (bsz, s))
    f32 = lambda t: t.astype(jnp.float32)

    def reference(q, k, v, ct, starts):
      with jax.default_matmul_precision("highest"):
        out, pullback = jax.vjp(lambda q, k, v: cp.causal_attention(q, k, v, pos, pos, starts), f32(q), f32(k),
                                f32(v))
        return (out, *pullback(f32(ct)))
    refs = {False: jax.jit(reference)(q, k, v, ct, None), True: jax.jit(reference)(q, k, v, ct, starts)}
    for name, (attend, documents) in impls.items():
      if not wanted(name):
        continue
      spans = lengths if documents else [s]
      flops = 4.0 * bsz * nh * h * sum(n * (n + 1) / 2 for n in spans)
      fn = functools.partial(lambda q, k, v, attend, st: attend(q, k, v, st), attend=attend,
                             st=starts if documents else None)
      ref = refs[documents]
      row = info | {"part": "attention", "config": config, "candidate": name, "implementation": name,
                    "shape": [bsz, s, nh, g, h], "flops_forward": flops, "documents": lengths if documents else None}
      if out_of_time(margin_s=10):
        emit(row | {"note": "not run: out of time"})
        continue
      try:
        def fwd_bwd(q, k, v, ct, fn=fn):
          out, pullback = jax.vjp(fn, q, k, v)
          return (out, *pullback(ct))
        fwd_bwd = jax.jit(fwd_bwd)
        got = fwd_bwd(q, k, v, ct)
        errors = {label: float(np.linalg.norm(np.asarray(o, np.float64) - np.asarray(r, np.float64))
                               / max(np.linalg.norm(np.asarray(r, np.float64)), 1e-30))
                  for label, o, r in zip(("out", "dq", "dk", "dv"), got, ref)}
        finite = all(bool(jnp.all(jnp.isfinite(o))) for o in got)
        row |= {"errors": errors, "correct": finite and max(errors.values()) <= ATTENTION_TOLERANCE}
        forward = jax.jit(fn)
        row["seconds_forward"] = time_call(forward, (q, k, v))
        row["seconds_forward_backward"] = time_call(fwd_bwd, (q, k, v, ct))
        row["tflops_forward"] = flops / row["seconds_forward"] / 1e12
        row["tflops_forward_backward"] = 3 * flops / row["seconds_forward_backward"] / 1e12  # backward = 2 fwd
      except Exception as e_:  # noqa: BLE001
        row["note"] = error_note(e_)
        traceback.print_exc(file=sys.stderr)
      emit(row)


# Training -----------------------------------------------------------------------------------------------------


def train_runs() -> dict[str, list[str]]:
  """Training runs: name -> experiments.train flags (beyond --workdir)."""
  one_device = ["--config.mesh.data=1", "--config.mesh.expert=1", "--config.mesh.tensor=1",
                "--config.mesh.sequence=1", f"--config.train.steps={FLAGS.train_steps}", "--config.train.log_every=5",
                "--config.train.eval_every=0", "--config.train.eval_batches=1", "--config.checkpoint.every_steps=-1",
                "--config.sample.max_new_tokens=0"]
  if FLAGS.dry_run:
    return {"tiny_moe": ["--config=experiments/configs/tiny_moe.py", *one_device]}
  # 4 micro-batches of 16 x 2048 tokens (32K tokens, 131K top-4 rows per GEMM), 131K tokens per step.
  moe_1b = ["--config=experiments/configs/moe_1b.py", *one_device, "--config.train.global_batch_size=64",
            "--config.train.grad_accum_steps=4"]
  runs = {
      "moe_1b": moe_1b,
      "moe_1b_before": moe_1b + ["--config.parallel.gemm_kernels=forward=tokamax_mosaic,"
                                 "input_gradient=tokamax_mosaic,weight_gradient=meshmoe_mosaic"],
      # Qwen3-30B-A3B's widths on one GPU: PROXY_LAYERS layers, 4 sequences of 4096 per micro-batch.
      "qwen3_30b_a3b_proxy": ["--config=experiments/configs/qwen3_30b_a3b.py", *one_device,
                              f"--config.model.num_layers={PROXY_LAYERS}", "--config.parallel.impl=xla",
                              "--config.train.global_batch_size=8", "--config.train.grad_accum_steps=2"],
  }
  unknown = [name for name in FLAGS.train_runs if name not in runs]
  if unknown:
    raise ValueError(f"--train_runs {', '.join(unknown)}: known runs are {', '.join(runs)}")
  return {name: runs[name] for name in FLAGS.train_runs}


def train_part(info: dict) -> None:
  import statistics

  runs = train_runs()
  for name, run_flags in runs.items():
    row = info | {"part": "train", "run": name, "flags": run_flags}
    remaining = FLAGS.deadline - time.time()
    if remaining < 60 and not FLAGS.dry_run:
      emit(row | {"note": "not run: out of time"})
      continue
    workdir = pathlib.Path(FLAGS.train_root) / name
    subprocess.run(["rm", "-rf", str(workdir)], check=False)  # a fresh run, not a resumed one
    command = [sys.executable, "-m", "experiments.train", f"--workdir={workdir}", *run_flags]
    # Later runs get what is left; the first may not take all of it.
    share = remaining if name == list(runs)[-1] else remaining * 0.55
    started = time.time()
    # One device: the tests' 8 simulated CPU devices (a dry run inside them) would not match the mesh.
    env = os.environ | {"XLA_FLAGS": " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                                              if not f.startswith("--xla_force_host_platform_device_count"))}
    try:
      done = subprocess.run(command, timeout=share, capture_output=True, text=True, env=env)
      row["returncode"] = done.returncode
      tail = (done.stdout + done.stderr).strip().splitlines()[-8:]
    except subprocess.TimeoutExpired as e_:
      row["note"] = f"stopped after {share:.0f} s"
      tail = ((e_.stdout or b"").decode(errors="replace") + (e_.stderr or b"").decode(errors="replace")
              ).strip().splitlines()[-8:]
    row["wall_s"] = time.time() - started
    metrics = workdir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    train = [r for r in records if r.get("kind") == "train" and isinstance(r.get("tokens_per_s"), (int, float))]
    timed = train[1:]  # the first logged interval includes compilation
    if timed:
      row |= {"logged_intervals": len(timed), "steps": [timed[0]["step"], timed[-1]["step"]],
              "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
              "step_time_s": statistics.median(r["step_time_s"] for r in timed),
              "loss": [train[0]["loss"], train[-1]["loss"]]}
      mfus = [r["mfu"] for r in timed if isinstance(r.get("mfu"), (int, float))]
      if mfus:
        row["mfu"] = statistics.median(mfus)
    else:
      row["output_tail"] = tail
    plan = workdir / "plan.json"
    if plan.exists():
      row["plan_moe"] = json.loads(plan.read_text()).get("ops", {}).get("moe")
    emit(row)
    checkpoints = workdir / "checkpoints"
    if checkpoints.exists():
      subprocess.run(["rm", "-rf", str(checkpoints)], check=False)


# Tests ----------------------------------------------------------------------------------------------------------


def tests_part(info: dict) -> None:
  """The tests marked `gpu`, one row per test (pass, fail or skip), from pytest's JUnit XML."""
  import xml.etree.ElementTree as ElementTree

  report_path = pathlib.Path(FLAGS.out) / "gpu_tests.xml"
  command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/", "-q", "-p", "no:cacheprovider",
             f"--junitxml={report_path}"]
  try:
    subprocess.run(command, timeout=max(FLAGS.deadline - time.time(), 1), env=os.environ | {"JAX_PLATFORMS": "cpu" if FLAGS.dry_run else "cuda"})
  except subprocess.TimeoutExpired:
    emit(info | {"part": "tests", "note": "stopped at its time share; the tests finished before it are below"})
  if not report_path.exists():
    return
  for case in ElementTree.parse(report_path).getroot().iter("testcase"):
    outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    emit(info | {"part": "tests", "test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome})


# Report -------------------------------------------------------------------------------------------------------


def report(rows: list[dict]) -> str:
  """Markdown tables of the rows (measure.md)."""
  lines = []
  head = next((r for r in rows if "device" in r), {})
  lines.append(f"# meshmoe GPU measurement: {head.get('device', '?')}, {head.get('date', '?')}, "
               f"jax {head.get('jax', '?')} (measured)\n")
  gemm = [r for r in rows if r.get("part") == "gemm"]
  if gemm:
    lines += ["## Grouped GEMM (gate+up shape; TFLOP/s on balanced routing; error on uneven routing)\n",
              "| config | form | candidate | TFLOP/s | error | correct | note |", "|---|---|---|---|---|---|---|"]
    for r in gemm:
      tf = f"{r['tflops']:.1f}" if "tflops" in r else "-"
      err = f"{r['error']:.1e}" if isinstance(r.get("error"), float) and math.isfinite(r["error"]) else (
          "inf" if "error" in r else "-")
      lines.append(f"| {r['config']} (M={r['m']} K={r['k']} N={r['n']} E={r['experts']}) | {r['form']} | "
                   f"{r['candidate']} | {tf} | {err} | {r.get('correct', '-')} | {r.get('why') or r.get('note', '')} |")
  attention = [r for r in rows if r.get("part") == "attention"]
  if attention:
    lines += ["\n## Causal attention (forward; forward + backward)\n",
              "| config | candidate | fwd TFLOP/s | fwd+bwd TFLOP/s | worst error | correct | note |",
              "|---|---|---|---|---|---|---|"]
    for r in attention:
      f = lambda key: f"{r[key]:.1f}" if key in r else "-"
      worst = f"{max(r['errors'].values()):.1e}" if "errors" in r else "-"
      lines.append(f"| {r['config']} {r['shape']} | {r['candidate']} | {f('tflops_forward')} | "
                   f"{f('tflops_forward_backward')} | {worst} | {r.get('correct', '-')} | {r.get('note', '')} |")
  train = [r for r in rows if r.get("part") == "train"]
  if train:
    lines += ["\n## Training on one device\n", "| run | tokens/s | step s | MFU | loss | note |",
              "|---|---|---|---|---|---|"]
    for r in train:
      mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "-"
      tps = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-"
      step = f"{r['step_time_s']:.3f}" if "step_time_s" in r else "-"
      loss = " -> ".join(f"{v:.3f}" for v in r.get("loss", []))
      failed = f"exit {r['returncode']}: {r['output_tail'][-1][:150]}" if r.get("returncode") and r.get(
          "output_tail") else ""
      lines.append(f"| {r['run']} | {tps} | {step} | {mfu} | {loss} | {r.get('note', '') or failed} |")
  tests = [r for r in rows if r.get("part") == "tests" and "test" in r]
  if tests:
    lines += ["\n## Tests marked gpu\n", "| test | outcome |", "|---|---|"]
    lines += [f"| {r['test']} | {r['outcome']} |" for r in tests]
  return "\n".join(lines) + "\n"


def read_rows() -> list[dict]:
  path = pathlib.Path(FLAGS.out) / "measure.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def drive() -> int:
  """Runs each part in its own process within its share of the budget; writes measure.md after each."""
  out = pathlib.Path(FLAGS.out)
  start = time.time()
  end = start + FLAGS.budget_s
  parts = [p for p in FLAGS.parts]
  weights = sum(_SHARES[p] for p in parts)
  failed = []
  for i, part in enumerate(parts):
    now = time.time()
    share = (end - now) * _SHARES[part] / sum(_SHARES[p] for p in parts[i:]) if i < len(parts) - 1 else end - now
    print(f"\n===== {part} ({time.strftime('%H:%M:%S')}, {share:.0f} s of {end - now:.0f} s left) =====",
          flush=True)
    argv = [sys.executable, "-m", "experiments.benchmarks.gpu_measure", f"--part={part}",
            f"--deadline={now + share}"] + [a for a in sys.argv[1:] if not a.startswith(("--part=", "--deadline="))]
    try:
      code = subprocess.run(argv, timeout=share + 20).returncode
    except subprocess.TimeoutExpired:
      code = "timeout"
    if code != 0:
      failed.append(f"{part} ({code})")
    (out / "measure.md").write_text(report(read_rows()))
  del weights
  rows = read_rows()
  print("\n" + report(rows))
  wrong = [r for r in rows if r.get("correct") is False]
  print(f"{len(rows)} rows in {out / 'measure.jsonl'}; {len(wrong)} incorrect; "
        f"{time.time() - start:.0f} s" + (f"; parts that failed: {', '.join(failed)}" if failed else ""))
  return 1 if failed else 0


def main(argv):
  del argv
  unknown = (set(FLAGS.parts) - set(PARTS)) | (set(FLAGS.shapes) - set(SHAPES))
  if unknown:
    sys.exit(f"error: unknown --parts/--shapes {', '.join(sorted(unknown))}; parts: {', '.join(PARTS)}; "
             f"shapes: {', '.join(SHAPES)}")
  try:
    mgpu_tiles()
    if FLAGS.shape:
      custom_shape(FLAGS.shape)
  except ValueError as e:
    sys.exit(f"error: {e}")
  os.environ.setdefault(COMMAND_VARIABLE, "python -m experiments.benchmarks.gpu_measure " + " ".join(
      a for a in sys.argv[1:] if not a.startswith(("--part=", "--deadline="))))
  pathlib.Path(FLAGS.out).mkdir(parents=True, exist_ok=True)
  if FLAGS.part is None:
    sys.exit(drive())
  if FLAGS.dry_run:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if FLAGS.part in ("train", "tests"):
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process only reads the device's name
  import jax

  info = device_info()
  if not FLAGS.dry_run and info["platform"] != "gpu":
    sys.exit(f"error: JAX's first device is {info['platform']}, not a GPU; --dry_run checks the script on CPU")
  print(f"{FLAGS.part}: {info}", flush=True)
  {"gemm": gemm_part, "attention": attention_part, "train": train_part, "tests": tests_part}[FLAGS.part](info)
  del jax


if __name__ == "__main__":
  app.run(main)
