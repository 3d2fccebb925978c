"""The blocked grouped expert FFN (the CPU path): dense capacity blocks, then a loop over the overflow.

Shape suffixes: R rows of the dispatch buffer, D model width, F expert width, E experts, C block rows per
expert, T rows per overflow tile, P = R + T sorted positions (the rows, then one tile of slack).

The rows are sorted by expert (`order_R`, a list of row indices: rows never move as a whole). Each
expert's first C rows fill its block of a dense [E, C, D] buffer, and three batched GEMMs multiply every
block by its expert's weights at once: the GEMM shape a CPU runs fastest, and under balanced routing all
of the work (C = `capacity_rows`, the rows an expert gets when routing is balanced). The rows past an
expert's block (its overflow: none when routing is balanced, R - C when every row picks one expert) are
cut into tiles of T rows of one expert each, and a loop runs the used tiles one after another (its trip
count is the routing's, not the worst case), each multiplying its rows by its expert's weights, sliced in
place. Nothing is dropped and every row is computed once: a mostly empty buffer (expert parallelism's
worst-case receive buffer) costs its routed rows, plus the empty slots of underfull blocks and at most
T - 1 padding rows per overflowing expert.

Gradients are one custom VJP over both parts. The forward keeps gate and up of every row by sorted
position ([P, F] each) for the backward, which rebuilds the hidden units from them; the weight gradients
are summed in float32. Autodiff of the loop would keep every iteration's operands. Tiles write only their
own rows (a partial tile's other rows are the next expert's block or overflow, or no expert's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshmoe.sharding import parallel

DEFAULT_TILE_ROWS = 16  # overflow tiles: few rows each; a tile's GEMMs are small whatever its height


def capacity_rows(routed_rows: int, num_experts: int) -> int:
  """Block rows per expert: an equal share of the rows routing sends to these experts."""
  return max(1, math.ceil(routed_rows / num_experts))


def overflow_tiles(num_rows: int, capacity: int, num_experts: int, rows: int) -> int:
  """Most overflow tiles of `rows` rows routing can need: R - C rows past one expert's block (every row
  routed to it), or the overflow of several experts, each ending in a partial tile."""
  overflow = max(num_rows - capacity, 0)
  return min(overflow, (overflow + num_experts * (rows - 1)) // rows)


def computed_rows(routed_rows: int, buffer_rows: int, num_experts: int, tile_rows: int = 0,
                  worst_case: bool = False) -> int:
  """Rows the GEMMs compute for a buffer of `buffer_rows` rows of which routing that balances the experts
  sends `routed_rows`: every block slot (all the routed rows, none overflowing), or with `worst_case` also
  every overflow tile the buffer can need. The compiled program shows the blocks and one overflow tile
  (XLA counts a loop of unknown trip count once)."""
  capacity = capacity_rows(routed_rows, num_experts)
  tile_rows = tile_rows or DEFAULT_TILE_ROWS
  overflow = overflow_tiles(buffer_rows, capacity, num_experts, tile_rows) * tile_rows if worst_case else 0
  return num_experts * capacity + overflow


class Tiles(NamedTuple):
  """Per overflow tile m: its expert, its first sorted position and its expert's end; `used` tiles run."""
  expert_M: jax.Array
  start_M: jax.Array
  end_M: jax.Array
  used: jax.Array


class Layout(NamedTuple):
  """Where each sorted row is computed: block slot (e, c) holds input row source_EC[e, c] (R: an empty slot,
  reading zeros, writing nowhere) at sorted position position_EC[e, c] (P when empty); overflow rows are in
  `tiles`; source_P maps sorted positions to input rows (the T slack positions to R)."""
  source_EC: jax.Array
  position_EC: jax.Array
  source_P: jax.Array
  tiles: Tiles


def layout(order_R: jax.Array, sizes_E: jax.Array, capacity: int, tile_rows: int) -> Layout:
  """The layout of the rows order_R (sorted by expert; sizes_E[e] rows of expert e, then rows of no
  expert) in blocks of `capacity` rows and overflow tiles of `tile_rows`."""
  num_rows, num_experts = order_R.shape[0], sizes_E.shape[0]
  num_positions = num_rows + tile_rows
  first_E = jnp.cumsum(sizes_E) - sizes_E
  slot_C = jnp.arange(capacity)
  in_block_EC = slot_C[None, :] < sizes_E[:, None]
  position_EC = jnp.where(in_block_EC, first_E[:, None] + slot_C[None, :], num_positions)
  source_P = jnp.concatenate([order_R, jnp.full((tile_rows,), num_rows, order_R.dtype)])
  source_EC = jnp.where(in_block_EC, source_P[jnp.minimum(position_EC, num_positions - 1)], num_rows)
  overflow_E = jnp.maximum(sizes_E - capacity, 0)
  num_tiles = overflow_tiles(num_rows, capacity, num_experts, tile_rows)
  tiles = _tile_table(first_E + capacity, overflow_E, num_tiles, tile_rows, num_rows)
  return Layout(*(a.astype(jnp.int32) for a in (source_EC, position_EC, source_P)), tiles)


def _tile_table(start_E, size_E, num_tiles: int, rows: int, num_rows: int) -> Tiles:
  """Tiles of `rows` rows over expert e's size_E[e] sorted positions from start_E[e], in expert order."""
  tiles_E = (size_E + rows - 1) // rows
  last_tile_E = jnp.cumsum(tiles_E)
  tile_M = jnp.arange(num_tiles)
  used = last_tile_E[-1]
  expert_M = jnp.minimum(jnp.searchsorted(last_tile_E, tile_M, side="right"), size_E.shape[0] - 1)
  start_M = start_E[expert_M] + (tile_M - (last_tile_E - tiles_E)[expert_M]) * rows
  end_M = start_E[expert_M] + size_E[expert_M]
  return Tiles(*(a.astype(jnp.int32) for a in (expert_M, start_M, end_M, used)))


def blocked_ffn(x_RD: jax.Array, lay: Layout, gate_EDF: jax.Array, up_EDF: jax.Array, down_EFD: jax.Array,
                activation: Callable) -> jax.Array:
  """y_RD: down(activation(x @ gate, x @ up)) of every row with its expert's weights; zeros for the rows
  of no expert."""
  # Inside shard_map, the loop's carries vary over every mesh axis an operand does: the rows are marked
  # so, the weights are left as they are (marked, they would be new values, which a layer scan keeps per
  # layer for the backward pass instead of reading the stacked parameters).
  operands = (x_RD, gate_EDF, up_EDF, down_EFD, lay.source_P)
  axes = tuple(sorted(set().union(*(parallel.varying_axes(a) for a in operands))))
  return _blocked(parallel.vary_over(x_RD, axes), lay, gate_EDF, up_EDF, down_EFD, activation)


class _Tile(NamedTuple):
  """What one iteration of the overflow loop works on."""
  expert: jax.Array
  start: jax.Array  # its first sorted position
  source_T: jax.Array  # the input row of each of its rows
  mine_T1: jax.Array  # which of its rows are its expert's overflow


def _overflow_loop(lay: Layout, rows: int, step: Callable, carry):
  """carry = step(tile, carry) for each used overflow tile, in order."""
  tiles, num_rows = lay.tiles, lay.source_P.shape[0] - rows

  def body(m, carry):
    start = tiles.start_M[m]
    source_T = jax.lax.dynamic_slice_in_dim(lay.source_P, start, rows)
    mine_T1 = (start + jnp.arange(rows) < tiles.end_M[m])[:, None]
    return step(_Tile(tiles.expert_M[m], start, jnp.where(mine_T1[:, 0], source_T, num_rows), mine_T1), carry)

  return jax.lax.fori_loop(0, tiles.used, body, carry) if tiles.expert_M.shape[0] else carry


def _rows(a: jax.Array, index: jax.Array) -> jax.Array:
  """a[index] along the rows, zeros where the index is past them (an empty slot, a tile row not its own)."""
  return jnp.take(a, index, axis=0, mode="fill", fill_value=0)


def _times_transposed(a_TK: jax.Array, w_NK: jax.Array) -> jax.Array:
  """a @ w.T for a tile of a few rows: computed as (w @ a.T).T. XLA:CPU multiplies by a transposed weight
  several times slower (it repacks the whole weight for each tile); the optimization barrier keeps it from
  folding the transposes back."""
  return jax.lax.optimization_barrier(jnp.einsum("nk,tk->nt", w_NK, a_TK)).T


def _forward(x_RD, lay: Layout, gate_EDF, up_EDF, down_EFD, activation):
  """y_RD and gate, up of every row by sorted position ([P, F] each)."""
  num_positions, width = lay.source_P.shape[0], gate_EDF.shape[-1]
  rows = num_positions - x_RD.shape[0]
  x_ECD = _rows(x_RD, lay.source_EC)
  gate_ECF = jnp.einsum("ecd,edf->ecf", x_ECD, gate_EDF)
  up_ECF = jnp.einsum("ecd,edf->ecf", x_ECD, up_EDF)
  y_ECD = jnp.einsum("ecf,efd->ecd", activation(gate_ECF, up_ECF), down_EFD)
  y_RD = jnp.zeros_like(x_RD).at[lay.source_EC].set(y_ECD, mode="drop")
  kept = jnp.zeros_like(x_RD, shape=(num_positions, width))
  gate_PF, up_PF = (kept.at[lay.position_EC].set(a, mode="drop") for a in (gate_ECF, up_ECF))

  def step(tile: _Tile, carry):
    y_RD, gate_PF, up_PF = carry
    x_TD = _rows(x_RD, tile.source_T)
    gate_TF, up_TF = x_TD @ gate_EDF[tile.expert], x_TD @ up_EDF[tile.expert]
    y_RD = y_RD.at[tile.source_T].set(activation(gate_TF, up_TF) @ down_EFD[tile.expert], mode="drop")
    position_T = jnp.where(tile.mine_T1[:, 0], tile.start + jnp.arange(rows), num_positions)
    return y_RD, gate_PF.at[position_T].set(gate_TF, mode="drop"), up_PF.at[position_T].set(up_TF, mode="drop")

  return _overflow_loop(lay, rows, step, (y_RD, gate_PF, up_PF))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _blocked(x_RD, lay, gate_EDF, up_EDF, down_EFD, activation):
  return _forward(x_RD, lay, gate_EDF, up_EDF, down_EFD, activation)[0]


def _blocked_fwd(x_RD, lay, gate_EDF, up_EDF, down_EFD, activation):
  y_RD, gate_PF, up_PF = _forward(x_RD, lay, gate_EDF, up_EDF, down_EFD, activation)
  return y_RD, (x_RD, lay, gate_EDF, up_EDF, down_EFD, gate_PF, up_PF)


def _blocked_bwd(activation, residuals, dy_RD):
  x_RD, lay, gate_EDF, up_EDF, down_EFD, gate_PF, up_PF = residuals
  f32 = jnp.float32
  rows = lay.source_P.shape[0] - x_RD.shape[0]
  # Blocks: empty slots read zero rows and zero cotangents, so they add nothing.
  x_ECD, dy_ECD = _rows(x_RD, lay.source_EC), _rows(dy_RD, lay.source_EC)
  position_EC = jnp.minimum(lay.position_EC, gate_PF.shape[0] - 1)
  hidden_ECF, activation_vjp = jax.vjp(activation, gate_PF[position_EC], up_PF[position_EC])
  dgate_ECF, dup_ECF = activation_vjp(jnp.einsum("ecd,efd->ecf", dy_ECD, down_EFD))
  dx_ECD = jnp.einsum("ecf,edf->ecd", dgate_ECF, gate_EDF) + jnp.einsum("ecf,edf->ecd", dup_ECF, up_EDF)
  dx_RD = jnp.zeros_like(x_RD).at[lay.source_EC].set(dx_ECD, mode="drop")
  dgate_EDF = jnp.einsum("ecd,ecf->edf", x_ECD, dgate_ECF, preferred_element_type=f32)
  dup_EDF = jnp.einsum("ecd,ecf->edf", x_ECD, dup_ECF, preferred_element_type=f32)
  ddown_EFD = jnp.einsum("ecf,ecd->efd", hidden_ECF, dy_ECD, preferred_element_type=f32)

  def step(tile: _Tile, carry):
    dx_RD, dgate_EDF, dup_EDF, ddown_EFD = carry
    e = tile.expert
    part = lambda a_PF: jax.lax.dynamic_slice_in_dim(a_PF, tile.start, rows)
    x_TD, dy_TD = _rows(x_RD, tile.source_T), _rows(dy_RD, tile.source_T)  # other tiles' rows: zeros
    hidden_TF, tile_vjp = jax.vjp(activation, part(gate_PF), part(up_PF))
    dgate_TF, dup_TF = tile_vjp(_times_transposed(dy_TD, down_EFD[e]))
    dx_RD = dx_RD.at[tile.source_T].add(_times_transposed(dgate_TF, gate_EDF[e]) + _times_transposed(dup_TF, up_EDF[e]),
                                        mode="drop")
    # A slice added in place: as a scatter-add (`.at[e].add`) XLA:CPU rewrites the whole [E, ...] buffer.
    add_to = lambda sums, part: jax.lax.dynamic_update_index_in_dim(
        sums, jax.lax.dynamic_index_in_dim(sums, e, keepdims=False) + part, e, 0)
    return (dx_RD, add_to(dgate_EDF, jnp.einsum("td,tf->df", x_TD, dgate_TF, preferred_element_type=f32)),
            add_to(dup_EDF, jnp.einsum("td,tf->df", x_TD, dup_TF, preferred_element_type=f32)),
            add_to(ddown_EFD, jnp.einsum("tf,td->fd", hidden_TF, dy_TD, preferred_element_type=f32)))

  dx_RD, *dweights = _overflow_loop(lay, rows, step, (dx_RD, dgate_EDF, dup_EDF, ddown_EFD))
  weights = (gate_EDF, up_EDF, down_EFD)
  return (dx_RD, None, *(parallel.typed_like(dw.astype(w.dtype), w, (x_RD,)) for dw, w in zip(dweights, weights)))


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
