"""Warp-specialised thread blocks for the fused kernels (Tiles.consumers > 1), with each block's protocol
unchanged.

A block runs C + 1 warpgroups (C + 2 with a sender, below). Warpgroup C, the producer, runs every protocol
step that moves data into or out of the block or waits for another block: the puts to peers, the arrival and
notice waits, the notices, and the TMA loads of every GEMM's A and B tiles into a ring of `stages`
shared-memory slots. The C consumers run the WGMMAs, consumer c on columns [c * W, (c + 1) * W) of each
block_m x block_n output tile (W = block_n / C, Tiles.consumer_columns), and store those columns. The B ring
holds each tile as C panels of W columns, one per consumer, each loaded by its own TMA copy. All run the same
protocol program (each op's protocol.py), each with its own view of the primitives, so the block's protocol
is the one the twin executes: the same semaphores, counts, signallers and waits. Only who inside the block
runs each step differs:

- `matmul`: the producer puts the A rows to `copies`, then loads the A and B tiles into the ring, each
  slot once the consumers have released it; the consumers wait for a slot's tiles, run WGMMA, and
  release the slot one step later. `matmul_sum`: the same for each product in turn, the consumers
  accumulating all of them in one accumulator. `matmul_gate_up` (SwiGLU), where Tiles.splits_gate_up (two
  consumers, 128-row tiles): the producer loads W gate columns into panel 0 and W up columns into panel 1,
  and consumer c multiplies its 64 rows of the A tile by both, so it holds two 64 x W accumulators (not
  two 128 x W: those spill), and stores and loads its rows of the step's W-column tiles.
- `put`: the producer, TMA loads and stores through its staging slots, then the signal.
- `put_value`: the consumers store their columns; once all are complete, consumer 0 signals.
- `store`, `zero`, `load`: the consumers, their columns (their rows of a SwiGLU step split by rows),
  through their own output slot (the producer's `load` gives 0).
- `await_arrival`, `await_notice`: the producer waits for the semaphore, then hands off to the consumers,
  who wait for the handoff.
- `notify`: the producer.
- `send_phase` (a phase of puts that waits for nothing), in a kernel launched with a sender: one more
  warpgroup, the sender, runs all its puts, the local copies (offset 0) first, then arrives on
  `sent_locally`; the producer and the consumers wait for that arrival and go on to the GEMMs while the
  sender still puts to the peers. So a block's own outgoing tiles overlap its GEMMs. The sender owns the
  staging buffer: in such a kernel every put is in the send phase (the producer's `put` refuses otherwise).
  Without a sender, the producer runs the send phase's puts.

The producer never holds a tile value (it keeps 40 registers): the arithmetic a protocol does on values
runs on float32 scalars there, and its stores are skipped.

Why this adds no deadlock and no race (PROTOCOL.md has the block-level argument):
- All views run the same item loops in the same order, so inside a block there is one program order,
  and every intra-block wait is for an event earlier in it: a slot's tiles (loaded before they are
  consumed), a slot's release (after its previous use), a handoff (after the semaphore wait), the
  consumers' stores (before the signal).
- Every intra-block barrier is waited once per phase by each of its waiters, in order, and no arriver
  can complete a second phase before the waiters have seen the first: a ring slot is refilled only after
  its release; a handoff is given only after the consumers acknowledged the previous one (they
  pre-acknowledge once at the start); consumer 0 waits for the consumers' stores right after its own.
- Consumers read global memory only through the producer's loads, their own loads after a handoff, or
  kernel inputs; so every read of data from a peer is ordered after the producer's semaphore wait by an
  mbarrier release and acquire inside the block.
- The sender's puts read kernel inputs and write peers' buffers (read there only after their arrival
  waits) or, for offset 0, this block's own buffer, which the producer and the consumers read only after
  they waited for `sent_locally`, arrived once the local copies are complete. The sender waits for
  nothing outside the block, so the send phase always ends, as in the twin, which runs it before what
  follows (one order of the same puts).
- A signal of a put_value follows its consumers' complete stores: each consumer waits until its TMA
  stores are complete before it arrives on `stored`; consumer 0 waits for all arrivals, then signals (a
  system-scope release).

Legend: C consumers, S stages, W consumer columns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from meshmoe.pallas_kernels import gpu_machine, mosaic_tiles
from meshmoe.pallas_kernels.gpu_machine import GpuMachine

WG = "wg"
# Registers per thread the producer keeps (no tile values); the consumers share the rest of the register file.
PRODUCER_REGISTERS = 40
# The sender issues TMA copies and counts loop indices: the least a warpgroup may keep (setmaxnreg's floor).
SENDER_REGISTERS = 24


def consumer_registers(consumers: int, sender: bool = False) -> int:
  """Registers per consumer thread: a block's 64K (512 per thread of a warpgroup) split after the producer's
  and the sender's, at most 256, a multiple of 8."""
  left = 512 - PRODUCER_REGISTERS - (SENDER_REGISTERS if sender else 0)
  return int(min(256, left / consumers) // 8 * 8)


@dataclasses.dataclass(frozen=True)
class Shared:
  """A block's shared-memory buffers and barriers, allocated once for all its warpgroups."""

  a_ring: object  # [S, block_m, block_k]
  b_ring: object  # [S, C, block_k, W] (a panel per consumer), or [S, C, W, block_k] for transposed B
  a_loaded: object  # S barriers: a slot's A tile has landed
  b_loaded: object  # S barriers, C arrivals: a slot's B panels have landed
  released: object  # S barriers, C arrivals: every consumer is done with a slot
  out_slots: object  # [C, block_m, W]: each consumer's output tile
  tile_loaded: object  # C barriers: a consumer's `load` has landed
  staging: object  # the producer's put chunks (Tiles.staging_shape)
  staged: object  # the producer's staging load barrier
  handoff: object  # the producer has waited for a semaphore
  handoff_taken: object  # C arrivals: every consumer has seen the last handoff
  stored: object  # C arrivals: every consumer's put_value stores are complete
  sent_locally: object = None  # the sender's local copies are complete (None: no sender)


def kernel_body(program, machine: GpuMachine, out_type, transpose_b: bool, sender: bool):
  """(body, launch options) of a warp-specialised kernel that runs `program(view, *refs)` (gpu_kernel.launch);
  with `sender`, a sender warpgroup runs the program's send phase (module docstring)."""
  tiles, consumers = machine.tiles, machine.tiles.consumers
  dtypes = {jnp.dtype(t.dtype) for t in jax.tree.leaves(out_type)}
  if len(dtypes) != 1:
    raise ValueError("warp-specialised kernels store every output through one slot dtype, got "
                     f"{sorted(map(str, dtypes))}")
  dtype = dtypes.pop()
  s, bm, bk, w = tiles.stages, tiles.block_m, tiles.block_k, tiles.consumer_columns
  b_shape = (s, consumers, w, bk) if transpose_b else (s, consumers, bk, w)
  scratch = dict(
      a_ring=plgpu.SMEM((s, bm, bk), dtype), b_ring=plgpu.SMEM(b_shape, dtype),
      a_loaded=plgpu.Barrier(num_barriers=s), b_loaded=plgpu.Barrier(num_arrivals=consumers, num_barriers=s),
      released=plgpu.Barrier(num_arrivals=consumers, num_barriers=s),
      out_slots=plgpu.SMEM((consumers, bm, tiles.consumer_columns), dtype),
      tile_loaded=plgpu.Barrier(num_barriers=consumers),
      staging=plgpu.SMEM(tiles.staging_shape(), dtype), staged=plgpu.Barrier(),
      handoff=plgpu.Barrier(), handoff_taken=plgpu.Barrier(num_arrivals=consumers),
      stored=plgpu.Barrier(num_arrivals=consumers))
  if sender:
    scratch["sent_locally"] = plgpu.Barrier()

  def body(*refs):
    def with_shared(**buffers):
      shared = Shared(**buffers)
      wg = lax.axis_index(WG)

      @pl.when(wg == consumers)
      def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
        program(Producer(machine, shared), *refs)
        # Observe the last phase of each barrier the producer waits on: every slot's last release and the
        # consumers' acknowledgement of the last handoff (each barrier's phases are all observed at the end).
        for slot in range(s):
          plgpu.barrier_wait(shared.released.at[slot])
        plgpu.barrier_wait(shared.handoff_taken)

      @pl.when(wg < consumers)
      def _consumers():
        plgpu.set_max_registers(consumer_registers(consumers, sender), action="increase")
        for slot in range(s):  # every slot starts released, and no handoff is outstanding
          plgpu.barrier_arrive(shared.released.at[slot])
        plgpu.barrier_arrive(shared.handoff_taken)
        program(Consumer(machine, shared), *refs)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last stores have read the output slot

      if sender:
        @pl.when(wg == consumers + 1)
        def _sender():
          plgpu.set_max_registers(SENDER_REGISTERS, action="decrease")
          program(Sender(machine, shared), *refs)

    pl.run_scoped(with_shared, **scratch, collective_axes=WG)

  return body, dict(num_threads=consumers + 1 + sender, thread_name=WG)


class _View(GpuMachine):
  """One warpgroup's view of a block's primitives, over the block's shared buffers."""

  def __init__(self, machine: GpuMachine, shared: Shared):
    super().__init__(machine.axes, machine.num_blocks, machine.tiles)
    self.shared = shared


class _WithoutTileValues(_View):
  """A view that holds no tile values (the producer's and the sender's): the tile stores are the consumers'."""

  def load(self, ref) -> jax.Array:
    return _no_value()

  def store(self, value, ref) -> None:
    pass

  def zero(self, ref) -> None:
    pass

  def put_value(self, value, dst_ref, peer=None, arrival=None) -> None:
    pass


class Producer(_WithoutTileValues):
  """The producer warpgroup's view of the primitives (module docstring)."""

  def matmul(self, a_ref, b_ref, copies=(), copy_when=True, transpose_b=False) -> jax.Array:
    """Puts the A rows to each of `copies` (where `copy_when` holds), then loads the GEMM's tiles."""
    if copies:
      @pl.when(copy_when)
      def _():
        for dst_ref, peer, arrival in copies:
          self.put(a_ref, dst_ref, peer, arrival)

    w = self.tiles.consumer_columns

    def panel(c, k_rows):
      panel_columns = pl.ds(c * w, w)
      return b_ref.at[panel_columns, k_rows] if transpose_b else b_ref.at[k_rows, panel_columns]

    self._load_ring(a_ref, [functools.partial(panel, c) for c in range(self.tiles.consumers)])
    return _no_value()

  def _load_ring(self, a_ref, panels) -> None:
    """Per K step: waits for the slot's release, then loads the A tile and the B panels (`panels[c](rows)`:
    panel c's source for those K rows)."""
    shared, bk = self.shared, self.tiles.block_k

    @pl.loop(0, a_ref.shape[1] // bk)
    def _load(k):
      slot, k_rows = lax.rem(k, self.tiles.stages), mosaic_tiles.column_block(k, bk)
      plgpu.barrier_wait(shared.released.at[slot])
      plgpu.copy_gmem_to_smem(a_ref.at[:, k_rows], shared.a_ring.at[slot], shared.a_loaded.at[slot])
      for c, source in enumerate(panels):
        plgpu.copy_gmem_to_smem(source(k_rows), shared.b_ring.at[slot, c], shared.b_loaded.at[slot])

  def matmul_sum(self, pairs, transpose_b=False) -> jax.Array:
    """Loads each product's tiles in turn, as `matmul` does."""
    for a_ref, b_ref in pairs:
      self.matmul(a_ref, b_ref, transpose_b=transpose_b)
    return _no_value()

  def matmul_gate_up(self, a_ref, gate_ref, up_ref) -> tuple[jax.Array, jax.Array]:
    """Loads the A tiles, gate's columns into panel 0 and up's into panel 1 (where the step splits by rows)."""
    if not self.tiles.splits_gate_up:
      return self.matmul(a_ref, gate_ref), self.matmul(a_ref, up_ref)
    self._load_ring(a_ref, [lambda k_rows, w_ref=w_ref: w_ref.at[k_rows, :] for w_ref in (gate_ref, up_ref)])
    return _no_value(), _no_value()

  def put(self, src_ref, dst_ref, peer=None, arrival=None) -> None:
    if self.shared.sent_locally is not None:
      raise ValueError("a kernel with a sender warpgroup puts only in its send phase: the sender owns the "
                       "staging buffer")
    _staged_put(self, src_ref, dst_ref, peer, arrival)

  def send_phase(self, send_to, p: int) -> None:
    """Without a sender, runs the puts; with one, waits until the sender's local copies are complete."""
    if self.shared.sent_locally is None:
      super().send_phase(send_to, p)
    else:
      plgpu.barrier_wait(self.shared.sent_locally)

  def await_arrival(self, arrival, region_ref) -> None:
    self._hand_off(lambda: super(Producer, self).await_arrival(arrival, region_ref))

  def await_notice(self, notices, index) -> None:
    self._hand_off(lambda: super(Producer, self).await_notice(notices, index))

  def _hand_off(self, wait) -> None:
    plgpu.barrier_wait(self.shared.handoff_taken)  # the consumers have seen the previous handoff
    wait()
    plgpu.barrier_arrive(self.shared.handoff)


class Consumer(_View):
  """A consumer warpgroup's view of the primitives (module docstring)."""

  @property
  def consumer(self) -> jax.Array:
    return lax.axis_index(WG)

  def _share(self, ref):
    """(This consumer's share of a tile `ref`, its output slot for it): its W columns of a block_n-wide
    tile, or, for the W-wide tiles of a SwiGLU step split by rows (Tiles.splits_gate_up), its 64 rows."""
    slot, width = self.shared.out_slots.at[self.consumer], self.tiles.consumer_columns
    if self.tiles.splits_gate_up and ref.shape[1] == width:
      rows = ref.shape[0] // self.tiles.consumers
      return ref.at[pl.ds(pl.multiple_of(self.consumer * rows, rows), rows)], slot.at[pl.ds(0, rows)]
    return ref.at[:, pl.ds(pl.multiple_of(self.consumer * width, width), width)], slot

  def matmul(self, a_ref, b_ref, copies=(), copy_when=True, transpose_b=False) -> jax.Array:
    """This consumer's columns of a_ref @ b_ref, from the tiles the producer loads (and the producer makes
    the `copies`)."""
    return self.matmul_sum([(a_ref, b_ref)], transpose_b)

  def matmul_sum(self, pairs, transpose_b=False) -> jax.Array:
    """This consumer's columns of the sum of a_ref @ b_ref over `pairs`, in one accumulator, from the tiles
    the producer loads for each product in turn."""

    def accumulate(acc_ref):
      for a_ref, b_ref in pairs:
        def issue(slot):
          panel = self.shared.b_ring.at[slot, self.consumer]
          plgpu.wgmma(acc_ref, self.shared.a_ring.at[slot], panel.T if transpose_b else panel)

        self._accumulate(a_ref.shape[1] // self.tiles.block_k, issue)
      return acc_ref[...]

    return pl.run_scoped(accumulate, plgpu.ACC((self.tiles.block_m, self.tiles.consumer_columns), jnp.float32))

  def matmul_gate_up(self, a_ref, gate_ref, up_ref) -> tuple[jax.Array, jax.Array]:
    """This consumer's 64 rows of the gate and up products (gate's columns in B panel 0, up's in panel 1),
    where the step splits by rows; else as `matmul`, twice."""
    if not self.tiles.splits_gate_up:
      return self.matmul(a_ref, gate_ref), self.matmul(a_ref, up_ref)
    rows = self.tiles.block_m // self.tiles.consumers

    def accumulate(gate_acc, up_acc):
      def issue(slot):
        my_rows = self.shared.a_ring.at[slot, pl.ds(pl.multiple_of(self.consumer * rows, rows), rows)]
        plgpu.wgmma(gate_acc, my_rows, self.shared.b_ring.at[slot, 0])
        plgpu.wgmma(up_acc, my_rows, self.shared.b_ring.at[slot, 1])

      self._accumulate(a_ref.shape[1] // self.tiles.block_k, issue)
      return gate_acc[...], up_acc[...]

    acc = plgpu.ACC((rows, self.tiles.consumer_columns), jnp.float32)
    return pl.run_scoped(accumulate, acc, acc)

  def _accumulate(self, steps: int, issue) -> None:
    """Runs `steps` K steps from the producer's ring, `issue(slot)` issuing each step's WGMMAs; every slot is
    released when it returns."""
    shared, stages = self.shared, self.tiles.stages

    @pl.loop(0, steps)
    def _step(k):
      slot = lax.rem(k, stages)
      plgpu.barrier_wait(shared.a_loaded.at[slot])
      plgpu.barrier_wait(shared.b_loaded.at[slot])
      issue(slot)
      # The previous step's WGMMAs are complete now (only this step's last is left in flight): release its slot.
      plgpu.wgmma_wait(1)

      @pl.when(k > 0)
      def _():
        plgpu.barrier_arrive(shared.released.at[lax.rem(k + stages - 1, stages)])

    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(shared.released.at[(steps - 1) % stages])

  def _store_share(self, value, ref) -> None:
    """Writes this consumer's share of a tile (`_share`) through its output slot (not waiting for completion)."""
    share, slot = self._share(ref)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the slot's previous store has read it
    slot[...] = value.astype(slot.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(slot, share)

  def load(self, ref) -> jax.Array:
    (share, slot), loaded = self._share(ref), self.shared.tile_loaded.at[self.consumer]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    plgpu.copy_gmem_to_smem(share, slot, loaded)
    plgpu.barrier_wait(loaded)
    return slot[...]

  def store(self, value, ref) -> None:
    self._store_share(value, ref)

  def zero(self, ref) -> None:
    @pl.loop(0, ref.shape[1] // self.tiles.block_n)
    def _zero(c):
      zeros = jnp.zeros((ref.shape[0], self.tiles.consumer_columns), jnp.float32)
      self._store_share(zeros, ref.at[:, mosaic_tiles.column_block(c, self.tiles.block_n)])

  def put(self, src_ref, dst_ref, peer=None, arrival=None) -> None:
    pass

  def send_phase(self, send_to, p: int) -> None:
    """The puts are the producer's or the sender's; with a sender, waits until its local copies are complete
    (what follows may read them)."""
    if self.shared.sent_locally is not None:
      plgpu.barrier_wait(self.shared.sent_locally)

  def put_value(self, value, dst_ref, peer=None, arrival=None) -> None:
    self._store_share(value, gpu_machine.peer_ref(dst_ref, peer))
    if peer is None:
      return
    plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # this consumer's columns are there
    plgpu.barrier_arrive(self.shared.stored)

    @pl.when(self.consumer == 0)
    def _signal():
      plgpu.barrier_wait(self.shared.stored)
      self.signal(arrival, gpu_machine.region_bytes(dst_ref), peer)

  def await_arrival(self, arrival, region_ref) -> None:
    self._take_handoff()

  def await_notice(self, notices, index) -> None:
    self._take_handoff()

  def notify(self, notices, index, owner) -> None:
    pass

  def _take_handoff(self) -> None:
    plgpu.barrier_wait(self.shared.handoff)
    plgpu.barrier_arrive(self.shared.handoff_taken)


class Sender(_WithoutTileValues):
  """The sender warpgroup's view: it runs the puts of the send phase and nothing else (module docstring)."""

  def __init__(self, machine: GpuMachine, shared: Shared):
    super().__init__(machine, shared)
    self._sending = False

  def send_phase(self, send_to, p: int) -> None:
    self._sending = True
    send_to(0)  # local copies: complete when each put returns
    plgpu.barrier_arrive(self.shared.sent_locally)
    for offset in range(1, p):
      send_to(offset)
    self._sending = False

  def put(self, src_ref, dst_ref, peer=None, arrival=None) -> None:
    if self._sending:
      _staged_put(self, src_ref, dst_ref, peer, arrival)

  def matmul(self, a_ref, b_ref, copies=(), copy_when=True, transpose_b=False) -> jax.Array:
    return _no_value()

  def matmul_sum(self, pairs, transpose_b=False) -> jax.Array:
    return _no_value()

  def matmul_gate_up(self, a_ref, gate_ref, up_ref) -> tuple[jax.Array, jax.Array]:
    return _no_value(), _no_value()

  def await_arrival(self, arrival, region_ref) -> None:
    pass

  def await_notice(self, notices, index) -> None:
    pass

  def notify(self, notices, index, owner) -> None:
    pass


def _staged_put(view, src_ref, dst_ref, peer, arrival) -> None:
  """A put through the staging buffer of `view` (the producer or the sender; gpu_machine.copy_through), then
  its signal."""
  gpu_machine.copy_through(view.shared.staging, view.shared.staged, src_ref, gpu_machine.peer_ref(dst_ref, peer))
  if peer is not None:
    view.signal(arrival, gpu_machine.region_bytes(dst_ref), peer)


def _no_value() -> jax.Array:
  """What the producer holds for a tile value: a float32 scalar (module docstring)."""
  return jnp.zeros((), jnp.float32)
