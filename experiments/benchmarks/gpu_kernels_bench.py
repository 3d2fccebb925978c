"""meshmoe's fused Comet kernels and Mosaic GPU tiles against the plan's grouped GEMM kernels, XLA and cuBLAS on
one GPU at an experiment's shapes: time, TFLOP/s, % of peak.

  python -m experiments.benchmarks.gpu_kernels_bench [--config=moe_1b] [--assignments=16384] [--iters=20]
      [--inner=10] [--only=gemm,ffn] [--impls=PREFIX,...] [--json_out=FILE]

Every candidate kernel of the grouped GEMM's three forms (forward, input gradient, weight gradient), checked on
uneven routing and timed form by form, and causal attention are measured by experiments/benchmarks/gpu_measure.py.
This script keeps what only it measures: meshmoe's own Mosaic GPU kernels inside the MoE's dispatch and return
(whose cost includes the ring's send and receive buffers), tile shape by tile shape, and the whole GEMM or
expert FFN, forward and forward + backward, against the plan's kernels and XLA's ops at one experiment's shapes.

Shapes come from experiments/configs/<config>.py (moe_1b: d_model 1024, 32 experts of width 512, top-4), each
overridable by a flag. Everything is bfloat16 with float32 accumulation; routing is balanced (every expert gets
assignments/E rows, in expert order), so the dense loop can use static slices.

Groups (rows of the table):
- `gemm` (forward, and forward + backward: dx and dw), y[M, N] = x[M, K] @ w[expert of the row][K, N] for
  the two GEMM shapes of an expert FFN: gate+up (K = d_model, N = 2 x expert width: one GEMM, as
  sharding/grouped_ffn.py runs it) and down (K = expert width, N = d_model). Implementations:
  - `kernels`: the plan's kernels for this GPU, one per form (sharding/hardware.grouped_gemm_for with
    "kernels": the measured choice of sharding/gpu_kernel_table.py for the config's d_model and expert width),
    as the MoE path calls them (sharding/ragged_gemm.ragged_matmul, whose VJP runs the input- and
    weight-gradient kernels); the row's note names them. Off GPUs, XLA's ragged dot for every form;
  - `mosaic_tiles BMxBNxBKxSTAGES[xCONSUMERS]`: meshmoe's own Mosaic GPU tiles (pallas_kernels/), one row
    per tile shape of --mosaic_tiles (with CONSUMERS, warp-specialised blocks: a producer warpgroup and
    that many consumers): the Comet dispatch + grouped GEMM kernel on a ring of one GPU (its send
    phase is then a local copy of the rows into the receive buffer, part of what it costs); forward +
    backward is its custom VJP (the GEMM + return kernel with the transposed weights, and the grouped
    weight-gradient kernel). Hopper only;
  - `ragged_dot`: jax.lax.ragged_dot (XLA's own lowering);
  - `dense_loop`: a Python loop over experts of dense matmuls on each expert's rows (static slices; cuBLAS
    on GPUs);
  - `dense_batched`: one batched einsum [E, M/E, K] x [E, K, N] (cuBLAS on GPUs), what balanced routing would
    cost as a plain dense GEMM: a ceiling, not a grouped GEMM.
- `ffn`, the whole expert FFN y = down(silu(x @ gate) * (x @ up)) per assignment row, forward and forward +
  backward: meshmoe's two fused Comet kernels on a ring of one GPU (`mosaic_fused`: dispatch + grouped GEMM
  with SwiGLU in its epilogue, then grouped GEMM + return; its backward recomputes gate and up per tile;
  `mosaic_fused_ws`: the same, warp-specialised on Hopper's 128 x 256 tiles) against XLA's unfused ops on the
  same shapes (`xla_unfused`: three jax.lax.ragged_dot and the SwiGLU between them, gate and up in memory).

Timing: one call compiles, --warmup calls warm up, then --iters samples, each --inner calls launched back
to back and waited for once (jax.block_until_ready), so launch overheads overlap the GPU's work; the
median sample / inner is the time per call. Forward + backward calls return the output and the input
and weight gradients (jax.vjp), so nothing is dead code.

FLOPs are useful FLOPs: 2 M K N per grouped GEMM, 6 M D F per expert FFN (not the padding or the dense
over-computation of an implementation), 3 x that forward + backward. % peak is against the device's dense
bf16 peak (meshmoe.training.metrics.peak_flops_per_device: H100 SXM / H200 989, H100 PCIe 756, A100 312
TFLOP/s, from NVIDIA's datasheets; the MFU the trainer logs uses the same table), or --peak_tflops. `err` is
max |out - reference| / max |reference| of the forward output against a float32 computation (the dense loop
in float32).

Without a GPU, --noplatform_check runs every path that has a CPU version (the plan's kernels, which are XLA's
there, and XLA's rows) at whatever shapes the flags give: a check that the script runs, not a benchmark.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import json
import math
import os
import pathlib
import sys
import time
import traceback
from collections.abc import Callable

from absl import app, flags

GROUPS = ("gemm", "ffn")
flags.DEFINE_string("config", "moe_1b", "experiment whose shapes are used: a file name in experiments/configs/")
flags.DEFINE_integer("assignments", 16384, "grouped GEMM rows M (token x top-k assignments)", lower_bound=1)
flags.DEFINE_integer("d_model", 0, "model width (0: the config's)", lower_bound=0)
flags.DEFINE_integer("expert_width", 0, "expert FFN width (0: the config's)", lower_bound=0)
flags.DEFINE_integer("experts", 0, "number of experts (0: the config's)", lower_bound=0)
flags.DEFINE_integer("iters", 20, "timed samples; the median is reported", lower_bound=1)
flags.DEFINE_integer("inner", 10, "calls per sample, launched back to back", lower_bound=1)
flags.DEFINE_integer("warmup", 3, "untimed calls after the compiling one", lower_bound=0)
flags.DEFINE_list("only", list(GROUPS), f"groups to run: {', '.join(GROUPS)}")
flags.DEFINE_list("mosaic_tiles", ["64x128x64x4", "128x128x64x4", "128x256x64x3x2"],
                  "tile shapes BMxBNxBKxSTAGES[xCONSUMERS] of meshmoe's Mosaic GPU grouped GEMM rows, one row "
                  "each (pallas_kernels/mosaic_tiles.py; the first is the kernels' default, the last Hopper's "
                  "warp-specialised layout)")
flags.DEFINE_list("impls", [], "only the implementations whose names start with one of these (e.g. "
                  "mosaic,dense_batched); default: every one")
flags.DEFINE_float("peak_tflops", 0.0, "dense bf16 peak TFLOP/s of the device (0: look up its kind)")
flags.DEFINE_bool("platform_check", True, "require a GPU (--noplatform_check: run the CPU versions)")
flags.DEFINE_string("json_out", None, "also write the rows as JSON lines to this file")
FLAGS = flags.FLAGS
CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"


@dataclasses.dataclass
class Row:
  group: str
  name: str
  shape: str
  mode: str  # "fwd", "fwd+bwd"
  flops: float
  seconds: float | None = None
  err: float | None = None
  note: str = ""


def time_call(fn: Callable, args: tuple, iters: int, inner: int, warmup: int) -> float:
  """Median seconds per call of the jitted `fn` (module docstring, "Timing")."""
  import jax
  import numpy as np

  jax.block_until_ready(fn(*args))  # compiles
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    start = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - start) / inner)
  return float(np.median(samples))


def relative_error(actual, expected) -> float:
  import numpy as np

  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  return float(np.max(np.abs(actual - expected)) / max(float(np.max(np.abs(expected))), 1e-30))


def run_row(row: Row, build: Callable[[], tuple[Callable, tuple]], check: Callable | None = None) -> Row:
  """Times what `build()` returns ((jitted fn, args)); `check(output)` gives the row's err. A failure
  (an unsupported shape, a kernel that does not compile) is the row's note, not the end of the run. Each
  row is printed as it finishes, so a run cut short by a time limit keeps what it measured."""
  if not wanted(row.name):
    return row
  try:
    fn, args = build()
    if check is not None:
      row.err = check(fn(*args))
    row.seconds = time_call(fn, args, FLAGS.iters, FLAGS.inner, FLAGS.warmup)
  except Exception as e:  # noqa: BLE001: one implementation's failure must not hide the others' numbers
    row.note = f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    traceback.print_exc(file=sys.stderr)
  measured = (f"{row.seconds * 1e3:.3f} ms, {row.flops / row.seconds / 1e12:.1f} TFLOP/s" if row.seconds
              else row.note)
  print(f"  {row.group} {row.name} {row.mode} {row.shape}: {measured}", flush=True)
  return row


def wanted(name: str) -> bool:
  """Whether --impls lets the implementation `name` run."""
  return not FLAGS.impls or any(name.startswith(prefix) for prefix in FLAGS.impls)


def skipped(row: Row, why: str) -> Row:
  row.note = f"not run: {why}"
  return row


# Grouped GEMM ------------------------------------------------------------------------------------------------


def gemm_rows(m: int, e: int, d: int, f: int, device, on_gpu: bool) -> list[Row]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from meshmoe.pallas_kernels import moe_routing
  from meshmoe.sharding.hardware import Hardware, grouped_gemm_for
  from meshmoe.sharding.ragged_gemm import ragged_matmul

  hardware = Hardware.of(device)
  # Chosen once, for the FFN's widths, as the plan chooses them: the same kernels run both GEMM shapes.
  _, kernels, why_no_kernels = grouped_gemm_for("kernels", hardware, jnp.bfloat16, d, f)
  shapes = {"gate_up": (d, 2 * f), "down": (f, d)}
  hopper = on_gpu and hardware.compute_capability.startswith("9.")
  num_sms = hardware.num_sms or None  # None: read from the device
  sizes_np = np.full((e,), m // e, np.int64)
  sizes_np[: m % e] += 1  # balanced; the first m % e experts take one row more
  offsets = np.concatenate([[0], np.cumsum(sizes_np)])
  sizes = jnp.asarray(sizes_np, jnp.int32)
  experts_A = jnp.asarray(np.repeat(np.arange(e), sizes_np), jnp.int32)  # assignment order = expert order
  mesh = Mesh(np.array([device]), ("x",))
  on_ring = lambda fn, n_in, n_out: jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * n_in,
                                                          out_specs=P() if n_out == 1 else (P(),) * n_out,
                                                          check_vma=False))
  tile_sweep = [parse_tiles(text) for text in FLAGS.mosaic_tiles]
  tile_plans = {tiles.block_m: on_ring(lambda ids, tm=tiles.block_m: moe_routing.make_tile_plan(ids, ("x",), e, tm),
                                       1, 1)(experts_A) for tiles in tile_sweep} if hopper else {}
  rows = []
  for shape_name, (k, n) in shapes.items():
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
    reference = jax.jit(lambda x, w: jnp.concatenate(
        [x[offsets[i]:offsets[i + 1]].astype(jnp.float32) @ w[i].astype(jnp.float32) for i in range(e)]))(x, w)
    check = lambda y: relative_error(y, reference)
    label = f"{shape_name}: M={m} K={k} N={n} E={e}"
    flops = 2.0 * m * k * n

    forward = {
        "kernels": (lambda x, w: ragged_matmul(x, w, sizes, kernels)) if kernels else None,
        "ragged_dot": lambda x, w: jax.lax.ragged_dot(x, w, sizes),
        "dense_loop": lambda x, w: jnp.concatenate([x[offsets[i]:offsets[i + 1]] @ w[i] for i in range(e)]),
        "dense_batched": (lambda x, w: jnp.einsum("egk,ekn->egn", x.reshape(e, m // e, k), w).reshape(m, n))
                         if m % e == 0 else None,
    }
    for mode in ("fwd", "fwd+bwd"):
      for name, fn in forward.items():
        row = Row("gemm", name, label, mode, flops if mode == "fwd" else 3 * flops)
        if fn is None:
          rows.append(skipped(row, why_no_kernels if name == "kernels" else "rows not divisible by experts"))
          continue
        if name == "kernels":
          row.note = kernels.describe()  # which kernels these numbers are of: the measured table changes
        if mode == "fwd":
          rows.append(run_row(row, lambda fn=fn: (jax.jit(fn), (x, w)), check))
        else:
          def fwd_bwd(x, w, dy, fn=fn):
            y, pullback = jax.vjp(fn, x, w)
            return y, pullback(dy)
          rows.append(run_row(row, lambda f=fwd_bwd: (jax.jit(f), (x, w, dy))))

      for tiles in tile_sweep:
        rows.append(mosaic_gemm_row(Row("gemm", f"mosaic_tiles {tile_name(tiles)}", label, mode,
                                        flops if mode == "fwd" else 3 * flops),
                                    tiles, x, w, dy, tile_plans.get(tiles.block_m), mesh, num_sms,
                                    reference if all(s % tiles.block_m == 0 for s in sizes_np) else None,
                                    None if hopper else "meshmoe's Mosaic GPU kernels need a Hopper GPU"))
  return rows


def parse_tiles(text: str):
  """`BMxBNxBKxSTAGES[xCONSUMERS]` (e.g. 128x128x64x4, or 128x256x64x3x2 warp-specialised) as
  mosaic_tiles.Tiles."""
  from meshmoe.pallas_kernels.mosaic_tiles import Tiles

  parts = text.split("x")
  if len(parts) not in (4, 5) or not all(p.isdigit() and int(p) > 0 for p in parts):
    raise ValueError(f"--mosaic_tiles entry {text!r}: BMxBNxBKxSTAGES[xCONSUMERS], four or five positive "
                     "integers (e.g. 64x128x64x4 or 128x256x64x3x2)")
  return Tiles(*map(int, parts))


def tile_name(tiles) -> str:
  consumers = f"x{tiles.consumers}" if tiles.consumers > 1 else ""
  return f"{tiles.block_m}x{tiles.block_n}x{tiles.block_k}x{tiles.stages}{consumers}"


def mosaic_gemm_row(row: Row, tiles, x, w, dy, tile_plan, mesh, num_sms, reference, not_here) -> Row:
  """meshmoe's own Mosaic GPU tiles: the Comet dispatch + grouped GEMM kernel on a ring of one GPU, with
  `tiles` (its tile plan's rows are tiles.block_m). `reference` (the float32 product) where every expert's
  rows are whole tiles, so the receive buffer's first M rows are x's rows in order."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P

  from meshmoe.pallas_kernels import moe_routing, sm_budget
  from meshmoe.pallas_kernels.moe_dispatch_gemm import api as dispatch_api
  from meshmoe.pallas_kernels.moe_dispatch_gemm import mosaic_gpu as dispatch_mosaic

  m, k, n = x.shape[0], x.shape[1], w.shape[2]
  why = not_here or dispatch_api.unsupported(k, [n], jnp.bfloat16, tiles)
  if why:
    return skipped(row, why)
  tm = tiles.block_m
  if row.mode == "fwd":
    num_blocks = sm_budget.kernel_blocks("mosaic_gpu", num_sms)
    xs = jax.jit(jax.shard_map(lambda x, plan: moe_routing.send_buffer(x, plan, tm, plan.send_dst.shape[0]),
                               mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))(x, tile_plan)
    kernel = jax.jit(jax.shard_map(
        lambda xs, w, plan: dispatch_mosaic.dispatch_gemm(xs, (w,), plan, ("x",), num_blocks=num_blocks,
                                                          tiles=tiles)[1],
        mesh=mesh, in_specs=(P(), P("x"), P()), out_specs=P("x"), check_vma=True))
    check = (lambda y: relative_error(y[:m], reference)) if reference is not None else None
    return run_row(row, lambda: (kernel, (xs, w, tile_plan)), check)

  def per_device(x, w, dy, plan):
    fn = lambda x, w: dispatch_api.dispatch_gemm(x, (w,), plan, ("x",), tile_rows=tm, backend="mosaic_gpu",
                                                 tiles=tiles, num_sms=num_sms)[0]
    y, pullback = jax.vjp(fn, x, w)
    dy_R = jnp.zeros(y.shape, y.dtype).at[:m].set(dy)  # receive-buffer layout: rows past M are padding
    return y, pullback(dy_R)
  kernel = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(P("x"), P("x"), P("x"), P()),
                                 out_specs=(P("x"), (P("x"), P("x"))), check_vma=True))
  return run_row(row, lambda: (kernel, (x, w, dy, tile_plan)))


# The expert FFN ----------------------------------------------------------------------------------------------


def ffn_rows(m: int, e: int, d: int, f: int, device, on_gpu: bool) -> list[Row]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  from meshmoe.pallas_kernels import moe_routing, mosaic_tiles
  from meshmoe.pallas_kernels.moe_dispatch_gemm import api as dispatch_api
  from meshmoe.pallas_kernels.moe_gemm_return import api as return_api
  from meshmoe.sharding.grouped_ffn import swiglu_hidden
  from meshmoe.sharding.plan import Hardware

  hardware = Hardware.of(device)
  hopper = on_gpu and hardware.compute_capability.startswith("9.")
  sizes_np = np.full((e,), m // e, np.int64)
  sizes_np[: m % e] += 1  # balanced, in expert order, as in gemm_rows
  offsets = np.concatenate([[0], np.cumsum(sizes_np)])
  sizes = jnp.asarray(sizes_np, jnp.int32)
  experts_A1 = jnp.asarray(np.repeat(np.arange(e), sizes_np), jnp.int32)[:, None]  # one choice per row
  keys = jax.random.split(jax.random.key(1), 5)
  x, dy = (jax.random.normal(k, (m, d), jnp.float32).astype(jnp.bfloat16) for k in keys[:2])
  gate, up = ((jax.random.normal(k, (e, d, f), jnp.float32) / math.sqrt(d)).astype(jnp.bfloat16) for k in keys[2:4])
  down = (jax.random.normal(keys[4], (e, f, d), jnp.float32) / math.sqrt(f)).astype(jnp.bfloat16)
  as_f32 = lambda a: a.astype(jnp.float32)
  reference = jax.jit(lambda x, gate, up, down: jnp.concatenate([
      (jax.nn.silu(as_f32(x[a:b]) @ as_f32(gate[i])) * (as_f32(x[a:b]) @ as_f32(up[i]))) @ as_f32(down[i])
      for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]))(x, gate, up, down)
  check = lambda y: relative_error(y, reference)

  def unfused(x, gate, up, down, experts):
    del experts  # the rows are in expert order: `sizes` says where each expert's start
    hidden = swiglu_hidden(jax.lax.ragged_dot(x, gate, sizes), jax.lax.ragged_dot(x, up, sizes))
    return jax.lax.ragged_dot(hidden, down, sizes)

  mesh = Mesh(np.array([device]), ("x",))
  num_sms = hardware.num_sms or None

  def fused(x, gate, up, down, experts, tiles):  # per device of a ring of one
    plan = moe_routing.make_tile_plan(experts.reshape(-1), ("x",), e, tiles.block_m)
    options = dict(backend="mosaic_gpu", num_sms=num_sms, tiles=tiles)
    hidden = dispatch_api.dispatch_swiglu(x, gate, up, plan, ("x",), tile_rows=tiles.block_m, **options)
    return return_api.gemm_return((hidden,), (down,), plan, ("x",), **options)

  # The fused kernels with one warpgroup per block (the default) and warp-specialised (Hopper's layout).
  layouts = {"mosaic_fused": mosaic_tiles.DEFAULT_TILES, "mosaic_fused_ws": mosaic_tiles.HOPPER_TILES}
  why_not_fused = {name: (None if hopper else "meshmoe's Mosaic GPU kernels need a Hopper GPU")
                   or dispatch_api.unsupported(d, [f, f], jnp.bfloat16, tiles) for name, tiles in layouts.items()}
  label = f"M={m} D={d} F={f} E={e}"
  rows = []
  for mode in ("fwd", "fwd+bwd"):
    ffns = [(name, functools.partial(fused, tiles=tiles)) for name, tiles in layouts.items()]
    for name, ffn in ffns + [("xla_unfused", unfused)]:
      row = Row("ffn", name, label, mode, 6.0 * m * d * f * (1 if mode == "fwd" else 3))
      if why_not_fused.get(name):
        rows.append(skipped(row, why_not_fused[name]))
        continue
      if mode == "fwd":
        call = lambda x, gate, up, down, experts, dy, ffn=ffn: ffn(x, gate, up, down, experts)
      else:
        def call(x, gate, up, down, experts, dy, ffn=ffn):
          y, pullback = jax.vjp(lambda *params: ffn(*params, experts), x, gate, up, down)
          return y, pullback(dy)
      if name in layouts:
        out_specs = P("x") if mode == "fwd" else (P("x"), (P("x"),) * 4)
        call = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=(P("x"),) * 6, out_specs=out_specs, check_vma=True))
      else:
        call = jax.jit(call)
      rows.append(run_row(row, lambda call=call: (call, (x, gate, up, down, experts_A1, dy)),
                          check if mode == "fwd" else None))
  return rows


# Report ------------------------------------------------------------------------------------------------------


def table(rows: list[Row], peak: float | None) -> str:
  header = ["group", "implementation", "pass", "shape", "ms", "TFLOP/s", "% peak", "err", "note"]
  lines = []
  for r in rows:
    tflops = r.flops / r.seconds / 1e12 if r.seconds else None
    lines.append([r.group, r.name, r.mode, r.shape, f"{r.seconds * 1e3:.3f}" if r.seconds else "-",
                  f"{tflops:.1f}" if tflops is not None else "-",
                  f"{100 * tflops * 1e12 / peak:.1f}" if tflops is not None and peak else "-",
                  f"{r.err:.1e}" if r.err is not None else "-", r.note])
  widths = [max(len(str(c)) for c in col) for col in zip(header, *lines)]
  fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def main(argv):
  del argv
  unknown = set(FLAGS.only) - set(GROUPS)
  if unknown:
    sys.exit(f"error: --only takes {', '.join(GROUPS)}; unknown: {', '.join(sorted(unknown))}")
  try:
    [parse_tiles(text) for text in FLAGS.mosaic_tiles]
  except ValueError as e:
    sys.exit(f"error: {e}")
  if FLAGS.config.startswith("_") or not (CONFIGS / f"{FLAGS.config}.py").is_file():
    sys.exit(f"error: --config={FLAGS.config!r} is not a file in experiments/configs/")
  import jax

  from meshmoe.training import metrics

  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  if FLAGS.platform_check and not on_gpu:
    sys.exit(f"error: JAX's first device is {device.platform}, not a GPU "
             f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}); "
             "--noplatform_check runs the CPU versions, only to check that this script runs")
  model = importlib.import_module(f"experiments.configs.{FLAGS.config}").get_config().model
  d = FLAGS.d_model or model.embed_dim
  f = FLAGS.expert_width or model.moe.expert_mlp_dim
  e = FLAGS.experts or model.moe.num_experts
  m = FLAGS.assignments
  peak = FLAGS.peak_tflops * 1e12 or metrics.peak_flops_per_device(device.device_kind, device.platform)

  versions = {name: getattr(importlib.import_module(name), "__version__", "?") for name in ("jax", "jaxlib")}
  try:  # only the plan's kernels on GPUs may need it: missing, it fails their row, not the run
    versions["tokamax"] = importlib.metadata.version("tokamax")
  except importlib.metadata.PackageNotFoundError:
    versions["tokamax"] = "not installed"
  print(f"device: {device.device_kind} ({device.platform}"
        + (f", compute capability {getattr(device, 'compute_capability', '?')}, "
           f"{getattr(device, 'core_count', '?')} SMs" if on_gpu else "") + ")")
  print("peak dense bf16: " + (f"{peak / 1e12:.1f} TFLOP/s" + (" (--peak_tflops)" if FLAGS.peak_tflops else
                                                                " (meshmoe.training.metrics, NVIDIA datasheets)")
                               if peak else "unknown (% peak left out; --peak_tflops sets it)"))
  print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
  print(f"shapes ({FLAGS.config}): d_model {d}, expert width {f}, {e} experts (top-{model.moe.top_k}), "
        f"{m} assignments ({m / max(model.moe.top_k, 1):.0f} tokens x top-{model.moe.top_k}), "
        f"{m // e} rows per expert")
  print(f"timing: median of {FLAGS.iters} samples of {FLAGS.inner} back-to-back calls, after {FLAGS.warmup} "
        "warm-up calls; bfloat16, balanced routing", flush=True)

  rows: list[Row] = []
  groups = {"gemm": lambda: gemm_rows(m, e, d, f, device, on_gpu),
            "ffn": lambda: ffn_rows(m, e, d, f, device, on_gpu)}
  names: set[str] = set()  # of every implementation the groups have, run or not
  for group in GROUPS:
    if group in FLAGS.only:
      group_rows = groups[group]()
      names.update(row.name for row in group_rows)
      rows += [row for row in group_rows if wanted(row.name)]
      print(f"\n{group} done:\n" + table([r for r in rows if r.group == group], peak), flush=True)
  print("\nall rows:")
  print(table(rows, peak))
  if FLAGS.json_out:
    with open(FLAGS.json_out, "w") as out:
      for r in rows:
        out.write(json.dumps(dataclasses.asdict(r) | {"device": device.device_kind, "peak_flops": peak}) + "\n")
    print(f"rows written to {FLAGS.json_out}")
  unmatched = [prefix for prefix in FLAGS.impls if not any(name.startswith(prefix) for name in names)]
  if unmatched:
    sys.exit(f"error: --impls {', '.join(map(repr, unmatched))} matched no implementation of the groups run; "
             f"they have: {', '.join(sorted(names))}")
  failed = [r for r in rows if r.note.startswith("error")]
  if failed:
    print(f"{len(failed)} row(s) failed (tracebacks above, on stderr): "
          + ", ".join(f"{r.group}/{r.name}/{r.mode}" for r in failed))
    sys.exit(1)


if __name__ == "__main__":
  app.run(main)
