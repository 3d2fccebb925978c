"""The protocol primitives (PROTOCOL.md) on a Hopper GPU: Mosaic GPU thread blocks, TMA copies, semaphores in
global memory.

A kernel is `num_blocks` persistent thread blocks (one per SM of the budget, `sm_budget.py`); block b runs
items b, b + B, b + 2B, ... of each item loop. `put` is a TMA store (a peer's memory through a remote
reference) followed by a wait until the store is complete, then one signal that adds the bytes moved to
the receiver's arrival semaphore: the signal is ordered after the data, so a block that has counted the
bytes may read them. Notices are semaphores with a leading block dimension (`notices.at[owner, ...]`),
so each is waited on by the one block that owns it, as in the twin, where semaphores belong to a core.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.pallas_kernels import mosaic_tiles, ring
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes

AXIS = "sm"
# Column tiles of a `put` in flight at once (each a block_m x block_n shared-memory slot: 16 KB in bf16).
PUT_SLOTS = 4


class GpuMachine:
  """One thread block's view of a Mosaic GPU kernel (see the module docstring)."""

  def __init__(self, axes: Axes, num_blocks: int, tiles: Tiles):
    self.axes, self.num_blocks, self.tiles = axes, num_blocks, tiles

  @property
  def block(self) -> jax.Array:
    return lax.axis_index(AXIS)

  def owner(self, item) -> jax.Array:
    """The block that runs `item` of an item loop (and owns its semaphores)."""
    return lax.rem(item, self.num_blocks)

  def items(self, count):
    """Decorator: the body runs for this block's items of range(count)."""
    return pl.loop(self.block, count, step=self.num_blocks)

  def peer(self, offset: int):
    """(ring position, device id) of the device `offset` steps clockwise. Static: a TMA descriptor for a
    peer's memory is built at launch, so the peer must follow from the device's own position."""
    position = ring.shift(self.axes, offset)
    return position, ring.device(self.axes, position)

  def matmul(self, a_ref, b_ref, copies=(), copy_when=True, transpose_b=False) -> jax.Array:
    """a_ref [block_m, K] @ b_ref [K, N] (b_ref [N, K] transposed, with `transpose_b`) in float32.
    `copies`: (dst_ref [block_m, K], peer device or None, arrival semaphore or None), made where
    `copy_when` holds: each A tile is also stored there as it streams through shared memory, and once all
    are complete each remote copy's arrival counts its bytes."""

    def forward(k_index, a_smem):
      columns = pl.ds(k_index * self.tiles.block_k, self.tiles.block_k)

      @pl.when(copy_when)
      def _():
        for dst_ref, peer, _ in copies:
          plgpu.copy_smem_to_gmem(a_smem, peer_ref(dst_ref, peer).at[:, columns])

    acc = mosaic_tiles.matmul_tile(a_ref, b_ref, self.tiles, on_a_tile=forward if copies else None,
                                   transpose_b=transpose_b)
    if copies:
      @pl.when(copy_when)
      def _():
        plgpu.wait_smem_to_gmem(0, wait_read_only=False)
        for dst_ref, peer, arrival in copies:
          if peer is not None:
            self.signal(arrival, region_bytes(dst_ref), peer)
    return acc

  def matmul_gate_up(self, a_ref, gate_ref, up_ref) -> tuple[jax.Array, jax.Array]:
    """(a_ref @ gate_ref, a_ref @ up_ref) in float32, for `tiles.gate_up_columns` columns of each weight:
    one pipeline that loads each A tile once for both, where its buffers fit (else two GEMMs)."""
    if not self.tiles.gate_up_pipeline_fits(jnp.dtype(a_ref.dtype).itemsize):
      return self.matmul(a_ref, gate_ref), self.matmul(a_ref, up_ref)
    return mosaic_tiles.matmul_gate_up(a_ref, gate_ref, up_ref, self.tiles)

  def matmul_sum(self, pairs, transpose_b=False) -> jax.Array:
    """The sum of a_ref @ b_ref over `pairs` (each as `matmul`'s, no copies) in float32, accumulated in one
    accumulator (one tile of registers however many products)."""
    return mosaic_tiles.matmul_sum(pairs, self.tiles, transpose_b)

  def load(self, ref) -> jax.Array:
    return mosaic_tiles.load_tile(ref)

  def store(self, value, ref) -> None:
    """Stores a tile of a kernel output. Nothing in the kernel reads an output back, so this waits only
    until the store has read its shared memory; its write to global memory overlaps what comes next."""
    mosaic_tiles.store_tile(value, ref, wait_complete=False)

  def zero(self, ref) -> None:
    """Zeros a [rows, width] region, one column tile at a time."""
    mosaic_tiles.zero_row_block(ref, ref.shape[1] // self.tiles.block_n, self.tiles.block_n)

  def put(self, src_ref, dst_ref, peer=None, arrival=None) -> None:
    """Copies a [rows, width] region into `dst_ref` (on `peer`; local when None), column tile by column
    tile, and adds its bytes to `arrival` on the peer once it is complete. Each column tile is loaded into
    one of PUT_SLOTS shared-memory slots by TMA and stored from there by TMA (no trip through registers),
    with up to PUT_SLOTS stores in flight; all are complete before the signal (and before a local copy
    is read, by this block, in the same kernel)."""
    staging = plgpu.SMEM((PUT_SLOTS, src_ref.shape[0], self.tiles.block_n), src_ref.dtype)
    pl.run_scoped(lambda slots, loaded: copy_through(slots, loaded, src_ref, peer_ref(dst_ref, peer)),
                  staging, plgpu.Barrier())
    if peer is not None:
      self.signal(arrival, region_bytes(dst_ref), peer)

  def send_phase(self, send_to, p: int) -> None:
    """Runs send_to(offset) for offsets 0, ..., p-1 (the device `offset` steps clockwise; 0 is this one): a
    phase of puts that waits for nothing. The local copies (offset 0) are complete when it returns; a
    warp-specialised block with a sender overlaps the other offsets with what follows
    (gpu_warp_specialized.py), and here one warpgroup runs them in turn."""
    for offset in range(p):
      send_to(offset)

  def put_value(self, value, dst_ref, peer=None, arrival=None) -> None:
    """Stores a tile value into `dst_ref` (on `peer`) and, once complete, adds its bytes to `arrival`."""
    mosaic_tiles.store_tile(value, peer_ref(dst_ref, peer))
    if peer is not None:
      self.signal(arrival, region_bytes(dst_ref), peer)

  def signal(self, arrival, count: int, peer) -> None:
    """Adds `count` to `peer`'s `arrival` semaphore (after the data it counts is complete)."""
    pl.semaphore_signal(arrival, count, device_id=peer)

  def await_arrival(self, arrival, region_ref) -> None:
    """Waits until `region_ref`'s bytes have arrived, and takes them off the count."""
    pl.semaphore_wait(arrival, region_bytes(region_ref))

  def notify(self, notices, index, owner) -> None:
    pl.semaphore_signal(notices.at[(owner, *index)], 1)

  def await_notice(self, notices, index) -> None:
    pl.semaphore_wait(notices.at[(self.block, *index)], 1)


def arrival_type(shape):
  return plgpu.SemaphoreType.REGULAR(tuple(shape))


def notice_type(num_blocks: int, shape):
  return plgpu.SemaphoreType.REGULAR((num_blocks, *shape))


def copy_through(staging, loaded, src_ref, dst_ref) -> None:
  """Copies src_ref to dst_ref (any global refs, a peer's too) in chunks of staging's [rows, columns]: each
  chunk is loaded into a staging slot by TMA and stored from there by TMA, with up to `slots` stores in
  flight, and returns once every store is complete. A loop in the kernel: unrolled, wide rows overflow
  Mosaic GPU's layout inference."""
  slots, rows, width = staging.shape
  row_chunks, column_chunks = src_ref.shape[0] // rows, src_ref.shape[1] // width

  @pl.loop(0, row_chunks * column_chunks)
  def _copy(i):
    chunk = (pl.ds(pl.multiple_of(i // column_chunks * rows, rows), rows),
             mosaic_tiles.column_block(lax.rem(i, column_chunks), width))
    slot = lax.rem(i, slots)
    plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)  # the slot's last store has read it
    plgpu.copy_gmem_to_smem(src_ref.at[chunk], staging.at[slot], loaded)
    plgpu.barrier_wait(loaded)
    plgpu.copy_smem_to_gmem(staging.at[slot], dst_ref.at[chunk])

  plgpu.wait_smem_to_gmem(0, wait_read_only=False)


def peer_ref(ref, peer):
  """`ref` on `peer` (a remote reference), or `ref` itself for a local copy (peer None)."""
  return ref if peer is None else plgpu.remote_ref(ref, peer)


def region_bytes(ref) -> int:
  """Bytes of a [rows, width] region: what an arrival semaphore counts for it."""
  return int(jnp.dtype(ref.dtype).itemsize) * int(ref.shape[0]) * int(ref.shape[1])
