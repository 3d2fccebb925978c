"""The blocked grouped expert FFN (the CPU path): a loop over tiles of rows grouped by expert.

The rows, in sorted order (by expert), are cut into tiles of `rows` rows: each expert's rows fill whole
tiles and at most one partial tile. Tile t gathers its rows from the input (the sorted order is a list
of row indices: the rows never move as a whole), multiplies them by its expert's weights and scatters
the outputs to the rows' places. A partial tile also reads the rows after its expert's (the next
expert's, or none): their outputs are written as zeros, and the tiles that own those rows come later
and overwrite them. The loop carries the current expert's weights and reloads them only when the
expert changes (no per-tile copy of the weights). The table has the static worst case of tiles
(`grouped_ffn.blocked_tiles`); tiles past the used ones are skipped, so a mostly empty buffer (expert
parallelism's worst-case receive buffer) costs only its routed rows plus at most rows - 1 per expert.

Gradients are a custom VJP over the same tiles: the forward keeps gate and up of every routed row (in
sorted order) for the backward, which masks each tile's output cotangent to the tile's own rows, adds
its input gradient into the rows' places and its weight gradients into its expert's (in float32).
Autodiff of the loop would keep every iteration's weight operand. Products with a transposed weight are
written weight-first, transposing the small operand instead: XLA:CPU multiplies a tile by a transposed
weight several times slower (an optimization barrier keeps it from folding the transpose back).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshmoe.sharding import parallel


class Tiles(NamedTuple):
  """Per tile: its expert, its first sorted row and its expert's end; `used` tiles run. `source_P`: the
  input row of each sorted row, then `rows` out-of-range indices (read past the last group)."""
  expert_M: jax.Array
  start_M: jax.Array
  end_M: jax.Array
  used: jax.Array
  source_P: jax.Array


def tile_table(order_R: jax.Array, sizes_E: jax.Array, num_tiles: int, rows: int) -> Tiles:
  """Tiles of `rows` rows over the groups of sizes_E consecutive rows of the sorted order order_R."""
  num_experts = sizes_E.shape[0]
  tiles_E = (sizes_E + rows - 1) // rows
  last_tile_E = jnp.cumsum(tiles_E)
  first_row_E = jnp.cumsum(sizes_E) - sizes_E
  tile_M = jnp.arange(num_tiles)
  # Tiles past the used ones get the last expert; they never run.
  expert_M = jnp.minimum(jnp.searchsorted(last_tile_E, tile_M, side="right"), num_experts - 1)
  start_M = first_row_E[expert_M] + (tile_M - (last_tile_E - tiles_E)[expert_M]) * rows
  end_M = first_row_E[expert_M] + sizes_E[expert_M]
  source_P = jnp.concatenate([order_R, jnp.full((rows,), order_R.shape[0], order_R.dtype)])
  return Tiles(*(a.astype(jnp.int32) for a in (expert_M, start_M, end_M, last_tile_E[-1], source_P)))


def tiled_ffn(x_RD: jax.Array, tiles: Tiles, gate_EDF: jax.Array, up_EDF: jax.Array, down_EFD: jax.Array,
              rows: int, activation: Callable) -> jax.Array:
  """y_RD: down(activation(x @ gate, x @ up)) of every row in a tile, with its tile's expert's weights;
  zeros for the rows in no group."""
  operands = (x_RD, gate_EDF, up_EDF, down_EFD)
  # Inside shard_map, the loop's carries must vary over every mesh axis an operand does.
  axes = tuple(sorted(set().union(*(parallel.varying_axes(a) for a in operands))))
  if axes:
    operands = tuple(parallel.vary_over(a, axes) for a in operands)
  return _tiled(operands[0], tiles, *operands[1:], rows, activation)


def _loop(tiles: Tiles, weights: tuple, rows: int, tile: Callable, carry):
  """carry = tile(expert, start, source, mine, its weights, carry) for the used tiles in order: `source`
  the tile's input rows, `mine` which of them are its expert's. The trip count is the static number of tiles
  (HLO accounting multiplies the body by it); the rest are skipped."""
  load = lambda e: tuple(w[e] for w in weights)

  def step(t, state):
    current, w, carry = state
    e, start = tiles.expert_M[t], tiles.start_M[t]
    w = jax.lax.cond(e != current, lambda: load(e), lambda: w)
    source = jax.lax.dynamic_slice_in_dim(tiles.source_P, start, rows)
    mine = (start + jnp.arange(rows) < tiles.end_M[t])[:, None]
    return e, w, tile(e, start, source, mine, w, carry)

  skip = lambda t, state: jax.lax.cond(t < tiles.used, functools.partial(step, t), lambda s: s, state)
  first = tiles.expert_M[0]
  return jax.lax.fori_loop(0, tiles.expert_M.shape[0], skip, (first, load(first), carry))[2]


def _rows_of(a: jax.Array, source: jax.Array) -> jax.Array:
  return jnp.take(a, source, axis=0, mode="clip")  # out-of-range sources are never a tile's own rows


def _forward(x_RD, tiles: Tiles, gate_EDF, up_EDF, down_EFD, rows: int, activation, keep: bool):
  """The tile loop: y_RD, and (keep) gate and up of the rows in sorted order (else empty)."""
  p, width = tiles.source_P.shape[0], gate_EDF.shape[-1]

  def tile(e, start, source, mine, w, carry):
    y_RD, gate_PF, up_PF = carry
    wg, wu, wd = w
    x = _rows_of(x_RD, source)
    gate, up = x @ wg, x @ wu
    y_RD = y_RD.at[source].set(jnp.where(mine, activation(gate, up) @ wd, 0), mode="drop")
    if keep:
      gate_PF = jax.lax.dynamic_update_slice_in_dim(gate_PF, gate, start, 0)
      up_PF = jax.lax.dynamic_update_slice_in_dim(up_PF, up, start, 0)
    return y_RD, gate_PF, up_PF

  kept = jnp.zeros_like(x_RD, shape=(p if keep else 0, width))
  return _loop(tiles, (gate_EDF, up_EDF, down_EFD), rows, tile, (jnp.zeros_like(x_RD), kept, kept))


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _tiled(x_RD, tiles, gate_EDF, up_EDF, down_EFD, rows, activation):
  return _forward(x_RD, tiles, gate_EDF, up_EDF, down_EFD, rows, activation, keep=False)[0]


def _tiled_fwd(x_RD, tiles, gate_EDF, up_EDF, down_EFD, rows, activation):
  y_RD, gate_PF, up_PF = _forward(x_RD, tiles, gate_EDF, up_EDF, down_EFD, rows, activation, keep=True)
  return y_RD, (x_RD, tiles, gate_EDF, up_EDF, down_EFD, gate_PF, up_PF)


def _tiled_bwd(rows, activation, residuals, dy_RD):
  x_RD, tiles, gate_EDF, up_EDF, down_EFD, gate_PF, up_PF = residuals
  f32 = jnp.float32

  def tile(e, start, source, mine, w, carry):
    dx_RD, dgate_EDF, dup_EDF, ddown_EFD = carry
    wg, wu, wd = w
    part = lambda a: jax.lax.dynamic_slice_in_dim(a, start, rows)
    x, dy = _rows_of(x_RD, source), jnp.where(mine, _rows_of(dy_RD, source), 0)  # other rows: other tiles'
    hidden, activation_vjp = jax.vjp(activation, part(gate_PF), part(up_PF))
    dgate, dup = activation_vjp(jax.lax.optimization_barrier(jnp.einsum("fd,pd->fp", wd, dy)).T)
    ddown_EFD = ddown_EFD.at[e].add(jnp.einsum("pf,pd->fd", hidden, dy, preferred_element_type=f32))
    dgate_EDF = dgate_EDF.at[e].add(jnp.einsum("pd,pf->df", x, dgate, preferred_element_type=f32))
    dup_EDF = dup_EDF.at[e].add(jnp.einsum("pd,pf->df", x, dup, preferred_element_type=f32))
    dx = jax.lax.optimization_barrier(jnp.einsum("df,pf->dp", wg, dgate) + jnp.einsum("df,pf->dp", wu, dup)).T
    dx_RD = dx_RD.at[source].add(dx, mode="drop")  # zero on the rows not mine
    return dx_RD, dgate_EDF, dup_EDF, ddown_EFD

  zeros = lambda a: jnp.zeros_like(a, f32)
  dx_RD, dgate_EDF, dup_EDF, ddown_EFD = _loop(
      tiles, (gate_EDF, up_EDF, down_EFD), rows, tile,
      (jnp.zeros_like(x_RD), zeros(gate_EDF), zeros(up_EDF), zeros(down_EFD)))
  return (dx_RD, None, dgate_EDF.astype(gate_EDF.dtype), dup_EDF.astype(up_EDF.dtype),
          ddown_EFD.astype(down_EFD.dtype))


_tiled.defvjp(_tiled_fwd, _tiled_bwd)
