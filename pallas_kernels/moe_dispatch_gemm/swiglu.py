"""SwiGLU fused into the MoE kernels, so no [R, F] gate or up buffer exists.

Forward: the dispatch kernel multiplies a received tile by its expert's gate and up columns (two float32
products of one column step from one A tile, `machine.matmul_gate_up`; a warp-specialised block splits
the step by rows between its consumers) and stores the hidden units silu(gate) * up (`hidden`), rounded once; the
return kernel reads those. The gradient needs gate and up again, in one of two ways (`MODES`, the config's
`parallel.moe_swiglu_gradient`):
- "recompute": `gradient_kernel` recomputes gate and up per tile from the received rows (kept from the
  forward) and writes their gradients (`gradients`) straight away: the cotangents the return kernel and
  the weight gradients need anyway. Two tile GEMMs per tile and column, local (no communication), in
  exchange for no [R, F] gate or up buffer at all (R is the dropless worst-case receive buffer, P times a
  device's share of the rows).
- "keep": the dispatch kernel also stores gate and up, and the backward's elementwise gradient reads them.

One definition of the arithmetic, for the kernels on both machines and the op's reference.py.
Legend as in ../moe_routing.py: R receive rows, D model width, F expert width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from meshmoe.config import SWIGLU_GRADIENTS


MODES = SWIGLU_GRADIENTS  # the config's `parallel.moe_swiglu_gradient` choices


def epilogue(mode: str):
  """The dispatch kernel's outputs from a column tile's float32 gate and up products, for `mode`."""
  if mode not in MODES:
    raise ValueError(f"SwiGLU gradient mode {mode!r}: one of {', '.join(map(repr, MODES))}")
  return (lambda gate, up: (hidden(gate, up), gate, up)) if mode == "keep" else (lambda gate, up: (hidden(gate, up),))


def num_outputs(mode: str) -> int:
  return 3 if mode == "keep" else 1


def hidden(gate: jax.Array, up: jax.Array) -> jax.Array:
  """silu(gate) * up, in float32."""
  return gate * jax.nn.sigmoid(gate) * up


def gradients(gate: jax.Array, up: jax.Array, dhidden: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(dgate, dup) of `hidden` for the hidden units' gradient, in float32."""
  sigmoid = jax.nn.sigmoid(gate)
  return dhidden * up * sigmoid * (1 + gate * (1 - sigmoid)), dhidden * gate * sigmoid


def gradient_kernel(machine, recv_expert, num_recv, xr_ref, dh_ref, gate_ref, up_ref, dgate_ref, dup_ref) -> None:
  """Block b runs receive tiles b, b + B, ...: used tiles get dgate, dup from their recomputed gate and up
  and the hidden units' gradient dh; unused tiles (past num_recv) get zeros. Each tile is read and written
  by its own block only: nothing to synchronise."""
  tiles = machine.tiles
  tile = lambda t: pl.ds(t * tiles.block_m, tiles.block_m)

  @machine.items(xr_ref.shape[0] // tiles.block_m)
  def _tile(m):
    @pl.when(m >= num_recv[0])
    def _():
      machine.zero(dgate_ref.at[tile(m)])
      machine.zero(dup_ref.at[tile(m)])

    @pl.when(m < num_recv[0])
    def _():
      width = tiles.gate_up_columns

      @pl.loop(0, dh_ref.shape[1] // width)
      def _column(ni):
        columns = pl.ds(ni * width, width)
        gate, up = machine.matmul_gate_up(xr_ref.at[tile(m)], gate_ref.at[recv_expert[m], :, columns],
                                          up_ref.at[recv_expert[m], :, columns])
        dh = machine.load(dh_ref.at[tile(m), columns]).astype(jnp.float32)
        dgate, dup = gradients(gate, up, dh)
        machine.store(dgate, dgate_ref.at[tile(m), columns])
        machine.store(dup, dup_ref.at[tile(m), columns])
