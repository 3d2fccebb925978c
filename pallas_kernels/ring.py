"""What the communicating kernels share: positions on a ring of devices, and how the kernels are run.

A ring is one or several mesh axes (`axes`), called from inside `jax.shard_map`. Device i of the ring is
the linear index over those axes, row-major in the order given: the order of
`jax.lax.all_gather(..., axes, tiled=True)`, `jax.lax.axis_index(axes)` and `ppermute`'s pairs, so a
kernel and its plain-collective version (the op's reference.py) agree on who holds which block.

Backends of every op (`api.py` picks one):
- "collectives": plain jax.lax collectives and jnp GEMMs (reference.py), autodiff as usual;
- "tpu_interpret": the twin (tpu.py): the op's protocol (protocol.py) on twin_machine.py, run by Pallas'
  TPU interpreter on CPU devices with DMAs executed only when waited on and the race detector on
  (INTERPRET_PARAMS): it checks the protocol the GPU runs;
- "mosaic_gpu": the same protocol on gpu_machine.py (mosaic_gpu.py), for Hopper GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

Axes = tuple[str, ...]
BACKENDS = ("collectives", "tpu_interpret", "mosaic_gpu")

# "on_wait" delays every DMA until someone waits on its semaphore, which exposes a buffer reused before
# its data arrived; "eager" would hide it. The race detector flags unordered accesses to one buffer.
INTERPRET_PARAMS = pltpu.InterpretParams(dma_execution_mode="on_wait", detect_races=True)


def size(axes: Axes) -> int:
  """Devices on the ring (inside shard_map)."""
  return math.prod(lax.axis_size(a) for a in axes)


def index(axes: Axes) -> jax.Array:
  """This device's position on the ring. Axes of size 1 contribute nothing and are not asked: inside a
  Mosaic GPU kernel an axis index is NVSHMEM's PE number, which a ring of one must not need."""
  position = 0
  for a in axes:
    if lax.axis_size(a) > 1:
      position = position * lax.axis_size(a) + lax.axis_index(a)
  return position


def device(axes: Axes, position) -> dict[str, jax.Array]:
  """The mesh coordinates (over `axes`) of ring position `position`; the other mesh axes are this
  device's own (Pallas fills them in for a device id given as a dict)."""
  coordinates = {}
  for a in reversed(axes):
    n = lax.axis_size(a)
    coordinates[a] = lax.rem(position, n)
    position = position // n
  return dict(reversed(coordinates.items()))


def shift(axes: Axes, offset: int) -> jax.Array:
  """The ring position `offset` steps away from this device (positive: clockwise)."""
  t = size(axes)
  return lax.rem(index(axes) + offset % t, t)


def out_type(shape: Sequence[int], dtype, *operands: jax.Array, axes: Axes = ()) -> jax.ShapeDtypeStruct:
  """A kernel output's type inside shard_map: varying over the mesh axes that any operand varies over,
  and over the ring's own axes (every device of the ring computes something different)."""
  varying = set(axes)
  for operand in operands:
    varying |= set(jax.typeof(operand).manual_axis_type.varying)
  return jax.ShapeDtypeStruct(tuple(shape), dtype,
                              manual_axis_type=jax.sharding.ManualAxisType(varying=frozenset(varying)))


def varying_like(value: jax.Array, *operands: jax.Array, axes: Axes = ()) -> jax.Array:
  """`value` typed as out_type says. Mosaic GPU kernels return outputs typed as the same on every device
  whatever their out_type says; this corrects the type (a no-op at run time). Only for kernel outputs,
  whose gradients are custom rules, so the psum that pcast's transpose would add never runs."""
  wanted = set(out_type(value.shape, value.dtype, *operands, axes=axes).manual_axis_type.varying)
  missing = tuple(sorted(wanted - set(jax.typeof(value).manual_axis_type.varying)))
  return lax.pcast(value, missing, to="varying") if missing else value


def barrier_with_all(axes: Axes, core=None) -> None:
  """Twin kernels: each device (each simulated block `core`) enters only once the same block of every other
  device of the ring has, as the GPU kernels' launch barrier: nobody writes into a peer that has not started."""
  p = size(axes)
  if p > 1:
    barrier = pltpu.get_barrier_semaphore()
    for offset in range(1, p):
      pl.semaphore_signal(barrier, 1, device_id=device(axes, shift(axes, offset)), core_index=core)
    pl.semaphore_wait(barrier, p - 1)


def check_backend(backend: str) -> None:
  if backend not in BACKENDS:
    raise ValueError(f"unknown kernel backend {backend!r}; known: {', '.join(BACKENDS)}")


def normalize_axes(axes: str | Sequence[str]) -> Axes:
  return (axes,) if isinstance(axes, str) else tuple(axes)
