"""How much of each GPU's memory XLA may use (`train.gpu_memory_fraction`).

JAX's GPU allocator takes a fixed share of each GPU's memory when the backend starts (75% unless
XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise) and XLA's programs must fit in it; the rest is left to the
CUDA context, the cuBLAS/cuDNN workspaces and NCCL's buffers. The share is read once, when the backend
starts, so the runner sets it from the config before anything asks JAX for a device (`set_fraction`) and
states, once the devices exist, what the allocator got (`describe`, read from the device). The planner
and the AOT report judge "fits" against the same share (`usable_bytes`), so a layout they pass is one the
allocator holds.
"""

from __future__ import annotations

import os

import jax

# JAX's variable for the share; read when the GPU backend starts.
FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def set_fraction(fraction: float) -> str | None:
  """Sets the allocator's share for a backend not started yet; returns a note when it replaces a different
  value the environment held (the config is the one place that decides)."""
  before = os.environ.get(FRACTION_VARIABLE)
  os.environ[FRACTION_VARIABLE] = f"{fraction:g}"
  if before is not None and _as_float(before) != fraction:
    return (f"note: train.gpu_memory_fraction={fraction:g} replaces {FRACTION_VARIABLE}={before} from the "
            "environment")
  return None


def usable_bytes(device_bytes: float, fraction: float) -> float:
  """The memory XLA's programs may use on a device of `device_bytes` (the planner's and AOT's capacity)."""
  return device_bytes * fraction


def describe(fraction: float) -> str | None:
  """The start-up line on a GPU: what the allocator holds per device (read from the device) and the share
  asked for; None on other backends or when the device reports no limit."""
  device = jax.local_devices()[0]
  if device.platform != "gpu":
    return None
  stats = device.memory_stats() or {}
  limit = stats.get("bytes_limit")
  if not limit:
    return None
  asked = os.environ.get(FRACTION_VARIABLE)
  if asked is None or _as_float(asked) != fraction:  # the backend started before the runner could set it
    return (f"GPU memory: XLA may use {limit / 1e9:.1f} GB per device (read from the device); "
            f"train.gpu_memory_fraction={fraction:g} was not applied because JAX's backend started first "
            f"({FRACTION_VARIABLE}={asked}): set it before importing jax, or run experiments.train")
  return (f"GPU memory: XLA may use {limit / 1e9:.1f} GB per device (read from the device; "
          f"train.gpu_memory_fraction={fraction:g})")


def _as_float(text: str) -> float | None:
  try:
    return float(text)
  except ValueError:
    return None
