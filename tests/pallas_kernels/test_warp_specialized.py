"""Warp-specialised thread blocks (pallas_kernels/gpu_warp_specialized.py): the synchronisation inside a block.

The Mosaic GPU interpreter has no semaphores, so a ring of one never runs a kernel's waits and signals. Here
a small program makes every step that hands data between the producer and the consumers happen many times
in one block: the producer's put (then its signal), an arrival wait handed off to the consumers, the
consumers reading what the producer put (their own load and the producer's GEMM loads), and a put_value
whose signal follows every consumer's stores. The semaphore operations themselves are made no-ops and the
peer the local device; what is checked is the block's own protocol: the interpreter checks every barrier's
phases (a phase waited twice, or completed and never observed, fails the kernel) and its race detector
(conftest.py) checks that every read of shared and global memory is ordered after the write it needs. The
same program without its arrival wait, whose consumers then read what the producer is still putting, is
flagged. The result must equal x @ w + x.

A kernel with a sender warpgroup runs its send phase there, alongside the GEMMs: the program below copies
x locally and "to two peers" in its send phase, then multiplies the local copy. The sender's local
copies must be complete before the producer's loads and the consumers' read them, which the race detector
checks; a sender that announces its local copies before making them is flagged.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

from meshmoe.pallas_kernels import gpu_kernel, gpu_machine, gpu_warp_specialized
from meshmoe.pallas_kernels.gpu_machine import GpuMachine
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from tests.pallas_kernels import harness
from tests.tolerances import assert_close

TILES = Tiles(64, 128, 64, 2, consumers=2)
PEER = 0  # any device: peer_ref is the local ref here


def _program(machine, x_ref, w_ref, out_ref, copy_ref, awaits: bool = True):
  """Per row tile m: put x's tile into `copy`, await it, read it back and multiply it, return the sum."""
  tiles = machine.tiles
  tile = lambda t: pl.ds(t * tiles.block_m, tiles.block_m)

  @machine.items(x_ref.shape[0] // tiles.block_m)
  def _item(m):
    machine.put(x_ref.at[tile(m)], copy_ref.at[tile(m)], PEER, None)
    if awaits:
      machine.await_arrival(None, copy_ref.at[tile(m)])
    landed = machine.load(copy_ref.at[tile(m)]).astype(jnp.float32)
    acc = machine.matmul(copy_ref.at[tile(m)], w_ref) + landed
    machine.put_value(acc, out_ref.at[tile(m)], PEER, None)


PEERS = 2  # the send phase's "peers" (all the local device here)


def _send_then_compute(machine, x_ref, w_ref, out_ref, local_ref, sent_ref):
  """The send phase copies x into `local` and into `sent` once per peer; then, per row tile m, the local
  copy's tile is read back and multiplied: out = local @ w + local."""
  tiles = machine.tiles
  tile = lambda t: pl.ds(t * tiles.block_m, tiles.block_m)
  row_tiles = x_ref.shape[0] // tiles.block_m

  def send_to(offset):
    @machine.items(row_tiles)
    def _send(m):
      if offset == 0:
        machine.put(x_ref.at[tile(m)], local_ref.at[tile(m)])
      else:
        machine.put(x_ref.at[tile(m)], sent_ref.at[tile((offset - 1) * row_tiles + m)], PEER, None)

  machine.send_phase(send_to, 1 + PEERS)

  @machine.items(row_tiles)
  def _compute(m):
    landed = machine.load(local_ref.at[tile(m)]).astype(jnp.float32)
    machine.store(machine.matmul(local_ref.at[tile(m)], w_ref) + landed, out_ref.at[tile(m)])


def _run(x, w, num_blocks: int, program=_program, sender: bool = False):
  machine = GpuMachine((), num_blocks, TILES)
  out_type = [jax.ShapeDtypeStruct(x.shape, x.dtype)] * 2
  if sender:
    out_type.append(jax.ShapeDtypeStruct((PEERS * x.shape[0], x.shape[1]), x.dtype))
  kernel = gpu_kernel.launch(program, machine, out_type=out_type, scratch_types=[], interpret=harness.GPU_INTERPRET,
                             sender=sender)
  return harness.per_device(lambda x, w: tuple(kernel(x, w)), harness.one_device_ring(), (P(), P()),
                            (P(),) * len(out_type))(x, w)


@pytest.fixture
def no_semaphores(monkeypatch):
  """The block's semaphore operations as no-ops, and peers local (see the module docstring)."""
  signals = []
  monkeypatch.setattr(GpuMachine, "signal", lambda self, arrival, count, peer: signals.append(count))
  monkeypatch.setattr(GpuMachine, "await_arrival", lambda self, arrival, region: None)
  monkeypatch.setattr(gpu_machine, "peer_ref", lambda ref, peer: ref)
  return signals


def _operands():
  keys = jax.random.split(jax.random.key(8), 2)
  rows, width = 6 * TILES.block_m, TILES.block_n  # 6 row tiles; K = N = one output tile's width
  x = jax.random.normal(keys[0], (rows, width), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[1], (width, width), jnp.float32) / np.sqrt(width)).astype(jnp.bfloat16)
  return x, w


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_handoffs_inside_a_block_pair_up_without_races(no_semaphores, num_blocks):
  x, w = _operands()
  width = x.shape[1]
  out, copy = _run(x, w, num_blocks)
  assert harness.take_race_verdicts() == []
  np.testing.assert_array_equal(np.asarray(copy), np.asarray(x))
  f32 = lambda a: np.asarray(a, np.float32)
  assert_close(f32(out), f32(x) @ f32(w) + f32(x), harness.BF16_RTOL, "x @ w + x")
  # Traced once per view: the producer's put and consumer 0's put_value each signal.
  assert sorted(no_semaphores) == sorted([x.dtype.itemsize * TILES.block_m * width] * 2)


def test_the_race_detector_catches_consumers_reading_before_the_handoff(no_semaphores):
  _run(*_operands(), num_blocks=1, program=functools.partial(_program, awaits=False))
  assert harness.take_race_verdicts() == ["Mosaic GPU kernel #0 in the interpreter"]


@pytest.mark.parametrize("num_blocks", [1, 2])
def test_a_sender_overlaps_its_puts_with_the_gemms_without_races(no_semaphores, num_blocks):
  x, w = _operands()
  out, local, sent = _run(x, w, num_blocks, program=_send_then_compute, sender=True)
  assert harness.take_race_verdicts() == []
  np.testing.assert_array_equal(np.asarray(local), np.asarray(x))
  np.testing.assert_array_equal(np.asarray(sent), np.tile(np.asarray(x), (PEERS, 1)))
  f32 = lambda a: np.asarray(a, np.float32)
  assert_close(f32(out), f32(x) @ f32(w) + f32(x), harness.BF16_RTOL, "local @ w + local")
  # Only the sender signals: one signal per put to a peer, each tile's bytes (traced once).
  assert no_semaphores == [x.dtype.itemsize * TILES.block_m * x.shape[1]] * PEERS


def test_the_race_detector_catches_a_sender_announcing_its_local_copies_too_early(no_semaphores, monkeypatch):
  def announce_first(self, send_to, p):
    plgpu.barrier_arrive(self.shared.sent_locally)
    self._sending = True
    for offset in range(p):
      send_to(offset)
    self._sending = False

  monkeypatch.setattr(gpu_warp_specialized.Sender, "send_phase", announce_first)
  _run(*_operands(), num_blocks=1, program=_send_then_compute, sender=True)
  assert harness.take_race_verdicts() == ["Mosaic GPU kernel #0 in the interpreter"]


def test_a_kernel_with_a_sender_refuses_a_put_outside_its_send_phase():
  with pytest.raises(ValueError, match="puts only in its send phase"):
    _run(*_operands(), num_blocks=1, sender=True)
