"""The protocol primitives (PROTOCOL.md) in Pallas' TPU interpreter on CPU devices: the twin that executes
each GPU kernel's protocol where no GPU is.

The interpreter runs `num_blocks` cores per device concurrently, one per thread block of the GPU kernel
(`num_cores_or_threads`), each with its own semaphores. `put` is a remote DMA whose semaphore on the receiver
is the arrival semaphore: it counts the bytes, as the GPU's signal after a complete store does. The DMA's
semaphore lives on the receiver's core with the sender's core index, which is why the protocols make a
transfer's lander the block with the sender block's index. DMAs run only when someone waits on them
("on_wait"), so data read before it is awaited is never there, and the race detector flags every pair of
accesses to one buffer that no wait orders. After each kernel every device records the detector's verdict
(`race_verdicts`), so a test sees every kernel's, not only the last one's.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import io_callback
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshmoe.pallas_kernels import ring
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes

# (kernel name, races found) per device and kernel run, in order; tests clear and check it.
race_verdicts: list[tuple[str, bool]] = []


class TwinMachine:
  """One simulated thread block (an interpreter core) of a twin kernel."""

  def __init__(self, axes: Axes, num_blocks: int, tiles: Tiles):
    self.axes, self.num_blocks, self.tiles = axes, num_blocks, tiles

  @property
  def block(self) -> jax.Array:
    return pl.program_id(0)

  def owner(self, item) -> jax.Array:
    return lax.rem(item, self.num_blocks)

  def items(self, count):
    return pl.loop(self.block, count, step=self.num_blocks)

  def peer(self, offset: int):
    position = ring.shift(self.axes, offset)
    return position, ring.device(self.axes, position)

  def matmul(self, a_ref, b_ref, copies=(), copy_when=True, transpose_b=False) -> jax.Array:
    @pl.when(copy_when)
    def _():
      for dst_ref, peer, arrival in copies:
        self.put(a_ref, dst_ref, peer, arrival)

    def product(a_vmem, b_vmem):
      pltpu.sync_copy(a_ref, a_vmem)
      pltpu.sync_copy(b_ref, b_vmem)
      b = b_vmem[...].T if transpose_b else b_vmem[...]
      return jnp.dot(a_vmem[...], b, preferred_element_type=jnp.float32)

    return pl.run_scoped(product, pltpu.VMEM(a_ref.shape, a_ref.dtype), pltpu.VMEM(b_ref.shape, b_ref.dtype))

  def matmul_gate_up(self, a_ref, gate_ref, up_ref) -> tuple[jax.Array, jax.Array]:
    return self.matmul(a_ref, gate_ref), self.matmul(a_ref, up_ref)

  def matmul_sum(self, pairs, transpose_b=False) -> jax.Array:
    products = [self.matmul(a_ref, b_ref, transpose_b=transpose_b) for a_ref, b_ref in pairs]
    return sum(products[1:], products[0])

  def load(self, ref) -> jax.Array:
    def read(vmem):
      pltpu.sync_copy(ref, vmem)
      return vmem[...]

    return pl.run_scoped(read, pltpu.VMEM(ref.shape, ref.dtype))

  def store(self, value, ref) -> None:
    def write(vmem):
      vmem[...] = value.astype(vmem.dtype)
      pltpu.sync_copy(vmem, ref)

    pl.run_scoped(write, pltpu.VMEM(ref.shape, ref.dtype))

  def zero(self, ref) -> None:
    self.store(jnp.zeros(ref.shape, jnp.float32), ref)

  def put(self, src_ref, dst_ref, peer=None, arrival=None) -> None:
    if peer is None:
      pltpu.sync_copy(src_ref, dst_ref)
      return

    def send(send_sem):
      copy = pltpu.make_async_remote_copy(src_ref, dst_ref, send_sem, arrival, device_id=peer)
      copy.start()
      copy.wait_send()  # the source may be reused once the DMA has read it

    pl.run_scoped(send, pltpu.SemaphoreType.DMA)

  def send_phase(self, send_to, p: int) -> None:
    """The puts of send_to(offset) for offsets 0, ..., p-1, in turn: one order the GPU's sender may run them
    in, alongside what follows (PROTOCOL.md); they wait for nothing, so any order ends."""
    for offset in range(p):
      send_to(offset)

  def put_value(self, value, dst_ref, peer=None, arrival=None) -> None:
    def stage(vmem):
      vmem[...] = value.astype(vmem.dtype)
      self.put(vmem, dst_ref, peer, arrival)

    pl.run_scoped(stage, pltpu.VMEM(dst_ref.shape, dst_ref.dtype))

  def await_arrival(self, arrival, region_ref) -> None:
    pltpu.make_async_copy(region_ref, region_ref, arrival).wait()

  def notify(self, notices, index, owner) -> None:
    pl.semaphore_signal(notices.at[tuple(index)], 1, core_index=owner)

  def await_notice(self, notices, index) -> None:
    pl.semaphore_wait(notices.at[tuple(index)], 1)


def arrival_type(shape):
  return pltpu.SemaphoreType.DMA(tuple(shape))


def notice_type(num_blocks: int, shape):
  del num_blocks  # each simulated block (core) has its own
  return pltpu.SemaphoreType.REGULAR(tuple(shape))


def launch(body, *, name: str, axes: Axes, operands, out_shape, in_specs, scratch_shapes, num_blocks: int,
           params: pltpu.InterpretParams = ring.INTERPRET_PARAMS):
  """Runs `body(*refs)` on `num_blocks` concurrent interpreter cores per device. Every core of every device
  first meets the same core of every other device of the ring (a launch barrier, as the GPU kernel's
  device barrier). One twin kernel runs at a time (`_Gate`), and after it each device records the race
  detector's verdict."""

  def with_barrier(*refs):
    ring.barrier_with_all(axes, core=pl.program_id(0))
    body(*refs)

  kernel = next(_kernel_ids)
  parties = jax.sharding.get_abstract_mesh().size
  entered = io_callback(functools.partial(_GATE.enter, kernel), jax.ShapeDtypeStruct((), jnp.int32), ordered=True)
  first, *rest = operands
  outs = pl.pallas_call(
      with_barrier, out_shape=out_shape, grid=(num_blocks,), in_specs=in_specs,
      out_specs=jax.tree.map(lambda _: pl.BlockSpec(memory_space=pl.ANY), out_shape),
      scratch_shapes=scratch_shapes,
      compiler_params=pltpu.CompilerParams(collective_id=0, dimension_semantics=("parallel",)),
      interpret=dataclasses.replace(params, num_cores_or_threads=num_blocks),
  )(_after(first, entered), *rest)
  leaves = jax.tree.leaves(outs)
  left = io_callback(functools.partial(_GATE.leave, kernel, name, parties), jax.ShapeDtypeStruct((), jnp.int32),
                     leaves[0].reshape(-1)[0], ordered=True)
  return jax.tree.unflatten(jax.tree.structure(outs), [_after(leaves[0], left), *leaves[1:]])


def _after(value: jax.Array, token: jax.Array) -> jax.Array:
  """`value`, made to depend on `token` (so XLA runs it after the callback that made the token)."""
  return value + (token * 0).astype(value.dtype)


class _Gate:
  """Lets one twin kernel run at a time over all devices. XLA may start a device's next kernel while an
  independent one is still running there (nothing orders them but the callbacks' tokens), and the
  interpreter's state is one per process: the next kernel enters once every device has left the last,
  after recording the race detector's verdict on it (which the next kernel resets)."""

  def __init__(self):
    self._condition = threading.Condition()
    self._active = None
    self._left = 0

  def enter(self, kernel: int):
    with self._condition:
      self._condition.wait_for(lambda: self._active in (None, kernel))
      self._active = kernel
    return jnp.int32(0)

  def leave(self, kernel: int, name: str, parties: int, _):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the detector's global state
    races = interpret_pallas_call.races
    with self._condition:
      race_verdicts.append((name, bool(races is not None and races.races_found)))
      self._left += 1
      if self._left == parties:
        self._active, self._left = None, 0
        self._condition.notify_all()
    return jnp.int32(0)


_GATE = _Gate()
_kernel_ids = itertools.count()
