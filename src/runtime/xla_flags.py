"""XLA flag presets for GPU training (`parallel.xla_flags`), applied through the XLA_FLAGS variable.

XLA reads XLA_FLAGS once, when the first backend starts, so a preset must be applied before anything asks
JAX for a device: the runner and the AOT tool call `apply` first thing. Flags a user already put in
XLA_FLAGS win over the preset's value for the same flag. An unknown flag aborts the whole process, and some
documented flags are unknown to current jaxlib (xla_gpu_enable_async_collectives,
xla_gpu_enable_pipelined_collectives and xla_gpu_experimental_enable_nvshmem, seen with jaxlib 0.12.0), so
every flag here is checked against the installed jaxlib by tests/test_xla_flags.py. GPU flags are parsed,
and ignored, on CPU-only machines.

Presets:
- `none`: XLA's defaults.
- `overlap` (the default): XLA's latency-hiding scheduler orders each asynchronous collective's start as
  early and its done as late as the data allow, so independent compute runs between them; reductions
  inside loops (the layer scan, the micro-batch loop) are pipelined across iterations (gradient
  reduce-scatters and all-reduces trail by one layer); small collectives are combined up to 128 MiB (many
  tiny gradient all-reduces cost their latency each); collectives get the highest-priority stream so
  compute kernels do not starve them. All-gathers are not pipelined: to pipeline them across the nested
  micro-batch and layer loops of gradient accumulation, XLA runs the whole forward layer loop twice per
  micro-batch (more FLOPs, more memory and less overlap on Mixtral-8x7B and Qwen3-30B-A3B at 64 H100s),
  and without a micro-batch loop it gains little; the compiled figures are in
  experiments/benchmarks/RESULTS.md, 2026-11-25. A user's `--xla_gpu_pipeline_all_gather=on` in XLA_FLAGS
  turns it on.
- `overlap_double_buffered`: `overlap` plus double-buffered while loops (XLA unrolls each loop by two so a
  pipelined collective has a buffer to land in). It copies loop-carried buffers: compiled for 8 H100s,
  moe_1b's xla-tier step needs 20.7 instead of 14.1 GB under `ep`, 21.8 instead of 14.3 under `tp_sp`,
  19.2 instead of 15.6 under `megascale` (whose collectives overlap less with it: 0.56 against 0.68), and
  Mixtral-8x7B's on 64 H100s 15 GB more. Only pure data parallelism gains from it (overlap 0.62 against
  0.53 at the same memory); experiments/benchmarks/RESULTS.md, 2026-11-25.
- `overlap_windowed_einsum`: `overlap` plus XLA's own collective matmul (windowed einsum) for every
  GSPMD-partitioned einsum whose collective is at least 0 MiB, on multiple streams. The `xla` tier of
  meshmoe's parallel ops decomposes its own matmuls; this preset helps the `reference` tier and the
  einsums outside the parallel ops.
"""

from __future__ import annotations

import os
import re

from absl import logging

from meshmoe.config import ConfigError

_OVERLAP = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_pipeline_all_reduce=on",
    "--xla_gpu_pipeline_reduce_scatter=on",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
)

PRESETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "overlap": _OVERLAP,
    "overlap_double_buffered": _OVERLAP + ("--xla_gpu_enable_while_loop_double_buffering=true",),
    "overlap_windowed_einsum": _OVERLAP + (
        "--xla_gpu_threshold_for_windowed_einsum_mib=0",
        "--xla_gpu_multi_streamed_windowed_einsum=true",
    ),
}


def flags(preset: str) -> tuple[str, ...]:
  if preset not in PRESETS:
    raise ConfigError("parallel.xla_flags", preset, "one of " + ", ".join(repr(p) for p in PRESETS))
  return PRESETS[preset]


def merged(preset: str, existing: str) -> str:
  """`existing` XLA_FLAGS plus the preset's flags that it does not already set."""
  present = set(re.findall(r"--(\w+)", existing))
  added = [f for f in flags(preset) if f[2:].split("=", 1)[0] not in present]
  return " ".join([existing.strip(), *added]).strip()


def apply(preset: str) -> None:
  """Adds the preset's flags to XLA_FLAGS; must run before JAX starts a backend (else a warning)."""
  from jax._src import xla_bridge  # only to tell whether a backend already read XLA_FLAGS

  new = merged(preset, os.environ.get("XLA_FLAGS", ""))
  if new == os.environ.get("XLA_FLAGS", "").strip():
    return
  if xla_bridge.backends_are_initialized():
    logging.warning("XLA flag preset %r not applied: a JAX backend has already started (restart the "
                    "process, or the notebook kernel, to change XLA flags)", preset)
    return
  os.environ["XLA_FLAGS"] = new
