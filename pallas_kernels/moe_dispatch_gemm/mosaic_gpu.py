"""MoE dispatch + grouped GEMM as one Mosaic GPU kernel (Hopper): protocol.py on gpu_machine.py.

Tile plan and legend: moe_routing.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax

from meshmoe.pallas_kernels import gpu_kernel, gpu_machine, mosaic_tiles, ring
from meshmoe.pallas_kernels.moe_dispatch_gemm import protocol, swiglu as swiglu_epilogue
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes

SCALARS = ("send_dst", "send_dst_tile", "num_send", "recv_expert", "recv_src", "recv_src_tile", "num_recv")


def unsupported(d: int, widths: Sequence[int], dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why this kernel cannot take rows of width `d` and weights of these widths (None when it can)."""
  shapes = {"D": (d, tiles.block_k), "D (copied in chunks)": (d, tiles.block_n)}
  shapes |= {f"F{i}": (f, tiles.block_n) for i, f in enumerate(widths)}
  return mosaic_tiles.unsupported(dtype, shapes, tiles)


def dispatch_gemm(xs_SD: jax.Array, weights: Sequence[jax.Array], plan: TilePlan, axes: Axes, *,
                  num_blocks: int, tiles: Tiles = mosaic_tiles.DEFAULT_TILES, swiglu: str | None = None,
                  transposed: bool = False, interpret=None) -> tuple[jax.Array, ...]:
  """(xr_RD, *products), as reference.dispatch_gemm (with `swiglu`, a swiglu.MODES mode, weights (gate,
  up) and the products silu(gate) * up, and for "keep" gate and up; with `transposed`, weights stored
  [E_l, F_i, D] and multiplied transposed); the plan's tile rows must be tiles.block_m.
  `interpret`: the Mosaic GPU interpreter, which has no semaphores: a ring of one device only."""
  p = ring.size(axes)
  s_tiles, r_tiles = plan.send_dst.shape[0], plan.recv_expert.shape[0]
  tm, d = tiles.block_m, xs_SD.shape[1]
  if xs_SD.shape[0] != s_tiles * tm:
    raise ValueError(f"send buffer of {xs_SD.shape[0]} rows is not {s_tiles} tiles of block_m={tm} rows")
  widths = [w.shape[1 if transposed else 2] for w in weights]
  reason = unsupported(d, widths, xs_SD.dtype, tiles)
  if reason:
    raise ValueError(f"MoE dispatch GEMM kernel: {reason}")
  machine = gpu_machine.GpuMachine(axes, num_blocks, tiles)
  out_type = [ring.out_type((r_tiles * tm, d), xs_SD.dtype, xs_SD, *weights, axes=axes)]
  out_type += [ring.out_type((r_tiles * tm, f), xs_SD.dtype, xs_SD, *weights, axes=axes)
               for f in ([widths[0]] * swiglu_epilogue.num_outputs(swiglu) if swiglu else widths)]
  outs = gpu_kernel.launch(
      functools.partial(protocol.run, p=p, num_weights=len(weights), swiglu=swiglu, transposed=transposed), machine,
      out_type=out_type,
      scratch_types=[gpu_machine.arrival_type((r_tiles,))] if p > 1 else [],
      interpret=interpret, transpose_b=transposed, sender=True,
  )(*(getattr(plan, name) for name in SCALARS), xs_SD, *weights)
  return tuple(ring.varying_like(out, xs_SD, *weights, axes=axes) for out in outs)


def swiglu_gradient(xr_RD: jax.Array, dh_RF: jax.Array, gate: jax.Array, up: jax.Array, plan: TilePlan, *,
                    num_blocks: int, tiles: Tiles = mosaic_tiles.DEFAULT_TILES, interpret=None):
  """(dgate_RF, dup_RF), as reference.swiglu_gradient: swiglu.gradient_kernel, local to each device."""
  reason = unsupported(xr_RD.shape[1], [gate.shape[2]], xr_RD.dtype, tiles)
  if reason:
    raise ValueError(f"MoE SwiGLU gradient kernel: {reason}")
  machine = gpu_machine.GpuMachine((), num_blocks, tiles)
  operands = (xr_RD, dh_RF, gate, up)
  out_type = [ring.out_type(dh_RF.shape, xr_RD.dtype, *operands)] * 2
  outs = gpu_kernel.launch(swiglu_epilogue.gradient_kernel, machine, out_type=out_type, scratch_types=[],
                            interpret=interpret)(
      plan.recv_expert, plan.num_recv, *operands)
  return tuple(ring.varying_like(out, *operands) for out in outs)
