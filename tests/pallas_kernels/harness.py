"""What the kernel tests share: rings of simulated CPU devices, the race detector's verdict, deviceless
H100 meshes, and the tolerances of 16-bit kernels.

Every communicating kernel is checked three ways (ARCHITECTURE.md, "Kernels"; PROTOCOL.md): its protocol on
the twin machine in Pallas' TPU interpreter on 2, 4 and 8 CPU devices (`dma_execution_mode="on_wait"`,
race detector on, its verdict checked after every kernel by conftest.py) against the reference; the same
protocol on the GPU machine compiled for 8 H100s without a GPU; and that kernel's compute path (a ring of
one device, which never signals) in the Mosaic GPU interpreter against the reference, with that
interpreter's race detector on too (its verdict also recorded after every kernel).
"""

from __future__ import annotations

import contextlib
import time

import jax
import numpy as np
from jax import lax
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshmoe.pallas_kernels import twin_machine
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.sharding.plan import Hardware
from tests.model_steps import gpu_mesh

# A 16-bit result rounds the float32 sum once: one bfloat16 unit in the last place of the largest entry.
BF16_RTOL = 2.0**-7
# The Mosaic GPU interpreter with its race detector (TMA copies, barriers, WGMMA operands, between the
# warpgroups and blocks of a device). It keeps only the running kernel's verdict, so each is recorded as
# its kernel ends (`_record_gpu_verdicts`).
GPU_INTERPRET = plgpu.InterpretGPUParams(detect_races=True)
gpu_race_verdicts: list[bool] = []
# The twins' tiles for the tests' small shapes (8-row blocks, widths 16 and 24): several tiles per dimension.
TWIN_TILES = Tiles(block_m=4, block_n=8, block_k=8)



def cpu_mesh(shape) -> Mesh:
  return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("a", "b"))


def ring_size(mesh: Mesh, axes) -> int:
  return int(np.prod([mesh.shape[a] for a in axes]))


def per_device(fn, mesh: Mesh, in_specs, out_specs, check_vma: bool = False):
  """fn under jit(shard_map). The Pallas interpreters evaluate a kernel's body with plain primitives, which
  trip shard_map's varying-axis checks (an axis index added to a constant), so tests turn them off;
  compiled kernels (deviceless) are checked with them on."""
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


def most_twin_blocks(mesh: Mesh) -> int:
  """The most simulated blocks per device a twin test runs on `mesh`: 2 on a mesh of 2 devices, else 1.
  The interpreter runs each simulated block of a device as its own XLA:CPU execution, which stays blocked
  in a callback while the block waits, and XLA's CPU executor starts only so many at once: 4 devices x 2
  blocks and 8 x 2 hung in some runs here (blocks waiting at the launch barrier for blocks never
  started); 2 x 2 and 2 x 3 never did in 10 runs each. With one block per device nothing is nested."""
  return 2 if mesh.size == 2 else 1


def take_race_verdicts() -> list[str]:
  """The twin kernels the race detector flagged since the last call, in order (each once), and one entry
  per Mosaic GPU kernel the GPU interpreter's detector flagged, once every kernel dispatched so far has
  finished and recorded its verdict."""
  jax.effects_barrier()
  flagged = [name for name, found in twin_machine.race_verdicts if found]
  flagged += [f"Mosaic GPU kernel #{i} in the interpreter" for i, found in enumerate(gpu_race_verdicts) if found]
  twin_machine.race_verdicts.clear()
  gpu_race_verdicts.clear()
  return list(dict.fromkeys(flagged))


def _record_gpu_verdicts() -> None:
  """Appends each interpreted Mosaic GPU kernel's race verdict to gpu_race_verdicts as the kernel ends:
  the interpreter's clean-up runs last in every kernel, before the next one replaces the detector's state.
  (Its only hook: jax keeps the verdict of the last kernel alone, in a private module.)"""
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

  clean_up = gpu_callbacks._clean_up_shared_memory

  def record_then_clean_up(token):
    gpu_race_verdicts.append(gpu_callbacks.get_races().races_found)
    return clean_up(token)

  gpu_callbacks._clean_up_shared_memory = record_then_clean_up


_record_gpu_verdicts()


@contextlib.contextmanager
def waits_left_out(primitive: str):
  """Twins traced inside leave out one kind of wait (`primitive`, a TwinMachine method): a broken protocol."""
  original = getattr(twin_machine.TwinMachine, primitive)
  setattr(twin_machine.TwinMachine, primitive, lambda self, *args: None)
  try:
    yield
  finally:
    setattr(twin_machine.TwinMachine, primitive, original)


@contextlib.contextmanager
def late_puts(devices, seconds: float = 0.02):
  """Twins traced inside make the given ring positions (of mesh axis "a") sleep before each put, so their
  tiles arrive after the others' and out of the usual order."""
  original = twin_machine.TwinMachine.put
  slow = np.asarray(devices)

  def put(self, *args, **kwargs):
    @pl.when(_is_one_of(lax.axis_index("a"), slow))
    def _():
      io_callback(lambda: time.sleep(seconds), None, ordered=False)
    original(self, *args, **kwargs)

  twin_machine.TwinMachine.put = put
  try:
    yield
  finally:
    twin_machine.TwinMachine.put = original


def _is_one_of(position, values):
  found = position == int(values[0])
  for value in values[1:]:
    found = found | (position == int(value))
  return found


def h100_mesh(n: int = 8) -> Mesh:
  return gpu_mesh((n,), ("x",))


def h100_sms() -> int:
  """The SMs of the deviceless H100 target, as its devices report them (the fused kernels' SM budget)."""
  return Hardware.of(h100_mesh(1).devices.flat[0]).num_sms


def abstract(mesh: Mesh, shape, dtype, spec) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def one_device_ring() -> Mesh:
  """A mesh of one CPU device, for a kernel's compute path in the Mosaic GPU interpreter."""
  return Mesh(np.array(jax.devices()[:1]), ("x",))


SPEC_ALL = P(("a", "b"))
