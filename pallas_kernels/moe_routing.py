"""The tile plan of the fused MoE kernels: where every assignment's row travels, in whole tiles.

Expert parallelism over a ring of P devices, E_l experts on each (global expert x lives on device
x // E_l as its local expert x % E_l). Rows move in tiles of TM rows, and a tile only ever holds rows of
one (sender, receiver, local expert) group, padded with zero rows, so every transfer and every GEMM tile
has a static shape and one expert, and no two groups share a tile:

- send buffer of a device, S_tiles tiles: its groups ordered by (destination, local expert), each
  starting on a tile boundary. Assignment a's row sits at `send_slot_A[a]`.
- receive buffer of a device, R_tiles tiles: groups ordered by (local expert, sender), each on a tile
  boundary, so each expert's rows are contiguous (for its GEMM and its weight gradient) and tile j of a
  sender's group lands in tile j of the matching receiver group.
Used tiles are a prefix of each buffer (`num_send`, `num_recv`); the rest is padding the kernels zero.
Static sizes are the dropless worst case: S_tiles = ceil(A / TM) + P * E_l (every group may end in a
partial tile), R_tiles = P * (ceil(A / TM) + E_l) (every sender may send all of its A rows here).

The group sizes are exchanged first (an all_gather of [P, E_l] int32 counts per device), so every device
can compute where its tiles land in every peer's buffer and where every peer's tiles come from.

Legend: A assignments of this device, E_l local experts, P ring positions, TM rows per tile.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from meshmoe.pallas_kernels import ring
from meshmoe.pallas_kernels.ring import Axes


class TilePlan(NamedTuple):
  send_slot_A: jax.Array  # row of each assignment in my send buffer; S_tiles * TM for dropped ones
  send_dst: jax.Array  # [S_tiles] ring position each send tile goes to
  send_dst_tile: jax.Array  # [S_tiles] its tile in that device's receive buffer
  num_send: jax.Array  # [1] send tiles in use
  recv_expert: jax.Array  # [R_tiles] local expert of each receive tile
  recv_src: jax.Array  # [R_tiles] ring position it comes from (and its result returns to)
  recv_src_tile: jax.Array  # [R_tiles] its tile in that device's send buffer
  num_recv: jax.Array  # [1] receive tiles in use
  expert_rows: jax.Array  # [E_l] receive-buffer rows of each local expert (padding rows included)


def sizes(num_assignments: int, p: int, num_local_experts: int, tile_rows: int) -> tuple[int, int]:
  """(S_tiles, R_tiles): the static tile counts of the send and receive buffers."""
  send = -(-num_assignments // tile_rows) + p * num_local_experts
  return send, p * (-(-num_assignments // tile_rows) + num_local_experts)


def expected_rows(num_assignments: int, p: int, num_local_experts: int, tile_rows: int) -> tuple[float, float]:
  """(rows a device computes, rows it sends to other devices) per call under balanced routing: its share
  of all assignments plus half a tile of padding per group (P senders x E_l experts), the remote part
  (P - 1) / P of what it sends. The kernels' own accounting (the cost model and the AOT report use it)."""
  padding = p * num_local_experts * tile_rows / 2
  return num_assignments + padding, (p - 1) / p * (num_assignments + padding)


def make_tile_plan(experts_A: jax.Array, axes: Axes, num_local_experts: int, tile_rows: int) -> TilePlan:
  """The plan for this device's assignments (global expert ids; id P * E_l marks a dropped one), inside
  jax.shard_map over the ring `axes`. Exchanges the group sizes (one small all_gather)."""
  p, e_l, tm = ring.size(axes), num_local_experts, tile_rows
  me = ring.index(axes)
  num_assignments = experts_A.shape[0]
  s_tiles, r_tiles = sizes(num_assignments, p, e_l, tm)
  counts_PE = jnp.bincount(experts_A, length=p * e_l).astype(jnp.int32).reshape(p, e_l)  # ids P*E_l: none
  counts_SPE = lax.all_gather(counts_PE, axes)  # [sender, receiver, local expert]
  tiles_SPE = -(-counts_SPE // tm)
  # Tile offsets of every group in its sender's send buffer (receiver-major) and its receiver's receive
  # buffer (expert-major, then sender).
  send_start_SPE = _exclusive_cumsum(tiles_SPE.reshape(p, -1)).reshape(p, p, e_l)
  recv_tiles_PES = tiles_SPE.transpose(1, 2, 0)  # [receiver, local expert, sender]
  recv_start_PES = _exclusive_cumsum(recv_tiles_PES.reshape(p, -1)).reshape(p, e_l, p)

  my_send_tiles = tiles_SPE[me].reshape(-1)  # groups (receiver, expert)
  group, j = _tile_groups(my_send_tiles, s_tiles)
  dst, expert = group // e_l, group % e_l
  send_dst_tile = recv_start_PES[dst, expert, me] + j

  my_recv_tiles = recv_tiles_PES[me].reshape(-1)  # groups (expert, sender)
  group, j = _tile_groups(my_recv_tiles, r_tiles)
  recv_expert, src = group // p, group % p
  recv_src_tile = send_start_SPE[src, me, recv_expert] + j

  # Each assignment's slot: its group's first row in my send buffer plus its rank inside the group.
  order = jnp.argsort(experts_A, stable=True)
  sorted_experts = experts_A[order]
  first_sorted = _exclusive_cumsum(counts_PE.reshape(-1))
  valid = sorted_experts < p * e_l
  x = jnp.minimum(sorted_experts, p * e_l - 1)
  slot = send_start_SPE[me].reshape(-1)[x] * tm + jnp.arange(num_assignments) - first_sorted[x]
  slot = jnp.where(valid, slot, s_tiles * tm)
  send_slot_A = jnp.zeros_like(slot).at[order].set(slot, unique_indices=True)
  return TilePlan(send_slot_A.astype(jnp.int32), dst.astype(jnp.int32), send_dst_tile.astype(jnp.int32),
              jnp.sum(my_send_tiles, keepdims=True).astype(jnp.int32), recv_expert.astype(jnp.int32),
              src.astype(jnp.int32), recv_src_tile.astype(jnp.int32),
              jnp.sum(my_recv_tiles, keepdims=True).astype(jnp.int32),
              (tm * jnp.sum(recv_tiles_PES[me], axis=1)).astype(jnp.int32))


def send_buffer(rows_AD: jax.Array, plan: TilePlan, tile_rows: int, num_send_tiles: int) -> jax.Array:
  """[S_tiles * TM, D]: each assignment's row at its slot, zeros elsewhere (a gather, so its transpose is
  a gather-sum)."""
  num_rows = num_send_tiles * tile_rows
  source = jnp.full((num_rows,), rows_AD.shape[0], jnp.int32).at[plan.send_slot_A].set(
      jnp.arange(rows_AD.shape[0], dtype=jnp.int32), mode="drop")
  return jnp.take(rows_AD, source, axis=0, mode="fill", fill_value=0)


def returned_rows(ret_SD: jax.Array, plan: TilePlan) -> jax.Array:
  """[A, D]: each assignment's row of the returned buffer; zeros for dropped assignments."""
  return jnp.take(ret_SD, plan.send_slot_A, axis=0, mode="fill", fill_value=0)


def _exclusive_cumsum(x: jax.Array) -> jax.Array:
  return jnp.cumsum(x, axis=-1) - x


def _tile_groups(tiles_per_group: jax.Array, num_tiles: int) -> tuple[jax.Array, jax.Array]:
  """For each tile index of a buffer whose groups hold `tiles_per_group` tiles, in order: its group and
  its index inside the group (tiles past the used ones get the last group and a meaningless index)."""
  ends = jnp.cumsum(tiles_per_group)
  tile = jnp.arange(num_tiles)
  group = jnp.minimum(jnp.searchsorted(ends, tile, side="right"), tiles_per_group.shape[0] - 1)
  return group, tile - (ends - tiles_per_group)[group]


def weight_columns(w_ref, expert, columns, transposed: bool):
  """The kernels' B operand for output `columns` of a local expert's GEMM: w_ref[expert][:, columns] of
  weights stored [E_l, K, N], or with `transposed` w_ref[expert][columns, :] of weights stored [E_l, N, K]
  (to be multiplied transposed: each backward GEMM reads the forward's weights as stored, where a
  swapaxes would make XLA transpose every layer's float32 weight stack in memory)."""
  return w_ref.at[expert, columns, :] if transposed else w_ref.at[expert, :, columns]
