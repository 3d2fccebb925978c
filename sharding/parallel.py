"""What the parallel ops share: PartitionSpecs from the active rules, mesh-axis arithmetic, shard_map.

A parallel op (tensor_parallel, context_parallel, expert_parallel) is called by model code on global
arrays. With no rules active (one device, a notebook) it runs its per-device body directly. Inside
`use_rules` it wraps that body in `jax.shard_map` with in/out specs read from the rules table, so the
communication is the op's own explicit collectives, never whatever GSPMD infers for a global-view sort
or gather. Weights enter an op with their `embed` dimension whole: under FSDP that makes XLA all-gather
them at the op (and reduce-scatter their gradients), which is FSDP.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
from absl import logging
from jax.sharding import PartitionSpec

from meshmoe.sharding.rules import logical_to_spec
from meshmoe.sharding.shardings import ShardingContext, per_device

Axes = tuple[str, ...]


def dim_axes(spec: PartitionSpec, dim: int) -> Axes:
  """The mesh axes that split dimension `dim` of a tensor with `spec`, as a tuple (maybe empty)."""
  entry = spec[dim] if dim < len(spec) else None
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def spec_of(*dims: Axes) -> PartitionSpec:
  return PartitionSpec(*(None if not axes else axes[0] if len(axes) == 1 else axes for axes in dims))


def all_axes(spec: PartitionSpec) -> Axes:
  return tuple(a for dim in range(len(spec)) for a in dim_axes(spec, dim))


def axis_size(ctx: ShardingContext, axes: Axes) -> int:
  return math.prod(ctx.mesh.shape[a] for a in axes)


def activation_spec(ctx: ShardingContext, logical: Sequence[str | None]) -> PartitionSpec:
  return logical_to_spec(logical, ctx.preset.activations)


def weight_spec(ctx: ShardingContext, logical: Sequence[str | None]) -> PartitionSpec:
  """A weight's spec inside an op: as the rules place it, except `embed`, which FSDP splits for storage
  only (the op needs it whole)."""
  return logical_to_spec([None if name == "embed" else name for name in logical], ctx.preset.params)


def without(axes: Axes, removed: Axes) -> Axes:
  return tuple(a for a in axes if a not in removed)


def split_suffix(axes: Axes, wanted: Axes, what: str) -> Axes:
  """The axes of `wanted` that also split `axes`; they must be the innermost (last) ones of `axes`, so that
  gathering over them joins neighbouring blocks. Returns them in `axes` order."""
  shared = tuple(a for a in axes if a in wanted)
  if shared and axes[len(axes) - len(shared):] != shared:
    raise ValueError(f"{what}: mesh axes {shared} must be the innermost axes of {axes} in the rules table")
  return shared


def shard_map(ctx: ShardingContext, body: Callable, in_specs, out_specs) -> Callable:
  """jax.shard_map over the context's mesh; the body is traced with the rules off (it sees shards)."""

  def per_device_body(*args):
    with per_device():
      return body(*args)

  return jax.shard_map(per_device_body, mesh=ctx.mesh, in_specs=in_specs, out_specs=out_specs)


def fused_kernel_backend(ctx: ShardingContext, op: str, unsupported: str | None = None) -> str | None:
  """The backend of the `pallas` tier's fused kernel for `op` on this mesh: "mosaic_gpu" on GPUs when the
  kernel takes the shapes (`unsupported` is None), else None, and the op runs its `xla` tier (said once
  per reason in the log). `parallel.kernel_backend="reference"` picks the kernels' plain-collective
  references instead, on any platform and shape."""
  if ctx.parallel.impl != "pallas":
    return None
  if ctx.parallel.kernel_backend == "reference":
    return "reference"
  device = ctx.mesh.devices.flat[0]
  capability = str(getattr(device, "compute_capability", ""))
  if device.platform != "gpu":
    reason = f"no fused kernels on {device.platform} (Mosaic GPU needs GPUs)"
  elif not capability.startswith("9."):  # WGMMA and TMA as these kernels use them: Hopper
    reason = f"the kernels are written for Hopper (compute capability 9.x), not {capability or 'unknown'}"
  else:
    reason = unsupported
  if reason is None:
    return "mosaic_gpu"
  if (op, reason) not in _FALLBACKS_LOGGED:
    _FALLBACKS_LOGGED.add((op, reason))
    logging.warning("parallel.impl='pallas': %s runs its xla tier: %s", op, reason)
  return None


def num_sms(ctx: ShardingContext) -> int:
  """Streaming multiprocessors of the mesh's GPUs (the fused kernels launch one thread block on each)."""
  return int(getattr(ctx.mesh.devices.flat[0], "core_count", 132))


_FALLBACKS_LOGGED: set[tuple[str, str]] = set()


def varying_axes(a: jax.Array) -> Axes:
  """The mesh axes `a` varies over (inside shard_map), sorted."""
  return tuple(sorted(jax.typeof(a).manual_axis_type.varying))


def vary_over(a: jax.Array, axes: Axes) -> jax.Array:
  """`a` marked as varying over all of `axes`: its gradient is then summed over the added axes in the
  backward pass, as autodiff does where an invariant operand meets a varying one."""
  missing = without(axes, varying_axes(a))
  return jax.lax.pcast(a, missing, to="varying") if missing else a
