"""Grouped GEMM + return to the owners as one Mosaic GPU kernel (Hopper): protocol.py on gpu_machine.py.

Tile plan and legend: moe_routing.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax

from meshmoe.pallas_kernels import gpu_kernel, gpu_machine, mosaic_tiles, ring
from meshmoe.pallas_kernels.moe_gemm_return import protocol
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.ring import Axes

SCALARS = ("recv_expert", "recv_src", "recv_src_tile", "num_recv", "send_dst", "send_dst_tile", "num_send")


def unsupported(widths: Sequence[int], d: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why this kernel cannot take inputs of these widths and outputs of width `d` (None when it can)."""
  shapes = {f"F{i}": (f, tiles.block_k) for i, f in enumerate(widths)} | {"D": (d, tiles.block_n)}
  return mosaic_tiles.unsupported(dtype, shapes, tiles)


def gemm_return(hs: Sequence[jax.Array], weights: Sequence[jax.Array], plan: TilePlan, axes: Axes, *,
                num_blocks: int, tiles: Tiles = mosaic_tiles.DEFAULT_TILES, transposed: bool = False,
                interpret=None) -> jax.Array:
  """ret_SD, as reference.gemm_return (with `transposed`, weights stored [E_l, D, F_i] and multiplied
  transposed); the plan's tile rows must be tiles.block_m. `interpret`: see moe_dispatch_gemm.mosaic_gpu."""
  p = ring.size(axes)
  s_tiles, r_tiles = plan.send_dst.shape[0], plan.recv_expert.shape[0]
  tm, d, dtype = tiles.block_m, weights[0].shape[1 if transposed else 2], hs[0].dtype
  if hs[0].shape[0] != r_tiles * tm:
    raise ValueError(f"inputs of {hs[0].shape[0]} rows are not {r_tiles} tiles of block_m={tm} rows")
  reason = unsupported([h.shape[1] for h in hs], d, dtype, tiles)
  if reason:
    raise ValueError(f"MoE GEMM return kernel: {reason}")
  machine = gpu_machine.GpuMachine(axes, num_blocks, tiles)
  ret_SD = gpu_kernel.launch(
      functools.partial(protocol.run, p=p, num_inputs=len(hs), transposed=transposed), machine,
      out_type=ring.out_type((s_tiles * tm, d), dtype, *hs, *weights, axes=axes),
      scratch_types=[gpu_machine.arrival_type((s_tiles * (d // tiles.block_n),))] if p > 1 else [],
      interpret=interpret, transpose_b=transposed,
  )(*(getattr(plan, name) for name in SCALARS), *hs, *weights)
  return ring.varying_like(ret_SD, *hs, *weights, axes=axes)
