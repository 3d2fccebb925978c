"""What the parallel ops share: mesh-axis arithmetic on PartitionSpecs, shard_map, varying-axis types.

A parallel op (tensor_parallel, context_parallel, expert_parallel) is called by model code on global
arrays. With no plan active (one device, a notebook) it runs its per-device body directly. Inside
`use_plan` it wraps that body in `jax.shard_map` with in/out specs read from the plan's rules, so the
communication is the op's own explicit collectives, never whatever GSPMD infers for a global-view sort
or gather. Weights enter an op with their `embed` dimension whole: under FSDP that makes XLA all-gather
them at the op (and reduce-scatter their gradients), which is FSDP. Which implementation an op runs is
the plan's choice (plan.py); nothing here decides.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from meshmoe.sharding.shardings import per_device

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


def without(axes: Axes, removed: Axes) -> Axes:
  return tuple(a for a in axes if a not in removed)


def split_suffix(axes: Axes, wanted: Axes, what: str) -> Axes:
  """The axes of `wanted` that also split `axes`; they must be the innermost (last) ones of `axes`, so that
  gathering over them joins neighbouring blocks. Returns them in `axes` order."""
  shared = tuple(a for a in axes if a in wanted)
  if shared and axes[len(axes) - len(shared):] != shared:
    raise ValueError(f"{what}: mesh axes {shared} must be the innermost axes of {axes} in the rules table")
  return shared


def shard_map(plan, body: Callable, in_specs, out_specs, check_vma: bool = True) -> Callable:
  """jax.shard_map over the plan's mesh; the body is traced with the plan off (it sees shards).
  `check_vma=False` for bodies that call kernels which cannot take operands that vary over mesh axes
  (Mosaic GPU kernels with warp-specialised bodies); autodiff then psums the cotangents of inputs over the
  mesh axes their specs leave out (and divides those of outputs), which is the same gradient."""

  def per_device_body(*args):
    with per_device():
      return body(*args)

  return jax.shard_map(per_device_body, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=check_vma)


def varying_axes(a: jax.Array) -> Axes:
  """The mesh axes `a` varies over (inside shard_map), sorted."""
  return tuple(sorted(jax.typeof(a).manual_axis_type.varying))


def vary_over(a: jax.Array, axes: Axes) -> jax.Array:
  """`a` marked as varying over all of `axes`: its gradient is then summed over the added axes in the
  backward pass, as autodiff does where an invariant operand meets a varying one."""
  missing = without(axes, varying_axes(a))
  return jax.lax.pcast(a, missing, to="varying") if missing else a


def typed_like(grad: jax.Array, primal: jax.Array, operands) -> jax.Array:
  """The cotangent of `primal`, computed (by a custom VJP) from `operands`, typed over exactly the primal's
  mesh axes. It varies where its operands do (whatever type a kernel gave it: a Mosaic GPU kernel's result
  carries none); over the axes where the primal does not (an invariant weight's gradient from varying
  rows) it is summed, as autodiff sums it."""
  varying = tuple(sorted(set().union(*(varying_axes(a) for a in operands))))
  grad = vary_over(grad, varying)
  extra = without(varying, varying_axes(primal))
  if extra:
    grad = jax.lax.psum(grad, extra)
  return vary_over(grad, varying_axes(primal))
