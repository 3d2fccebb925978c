"""Grouped weight gradient: the public function, which picks the implementation.

  dw_EDF = weight_gradient(x_RD, dy_RF, rows_E, like, tile_rows=TM, backend=...)

For each expert e, its contiguous rows of x transposed times theirs of dy (reference.py). Backends:
"collectives" and "tpu_interpret" use XLA's transposed ragged dot (no twin: nothing
communicates); "mosaic_gpu" the Hopper kernel, which reads only each expert's own rows, with
`tiles.consumers` > 1 warp-specialised (mosaic_gpu.py). The fused MoE kernels' backward passes
(moe_backends.py) call this for the expert weights' gradients with their tiles (`parallel.kernel_tiles`);
the unfused MoE path can run it for rows in any group sizes (`meshmoe_mosaic`, sharding/grouped_gemm_kernels.py).

Legend: R rows, D and F the two widths, E experts, TM rows per tile.
"""

from __future__ import annotations

import jax

from meshmoe.pallas_kernels import mosaic_tiles, ring, sm_budget
from meshmoe.pallas_kernels.grouped_weight_gradient import mosaic_gpu, reference
from meshmoe.pallas_kernels.mosaic_tiles import Tiles


def weight_gradient(x_RD: jax.Array, dy_RF: jax.Array, rows_E: jax.Array, like: jax.Array, *, tile_rows: int,
                    backend: str, tiles: Tiles = mosaic_tiles.DEFAULT_TILES,
                    num_sms: int | None = None) -> jax.Array:
  ring.check_backend(backend)
  if backend == "mosaic_gpu":
    return mosaic_gpu.weight_gradient(x_RD, dy_RF.astype(x_RD.dtype), rows_E, like, tile_rows=tile_rows,
                                      tiles=tiles, num_blocks=sm_budget.kernel_blocks(backend, num_sms))
  return reference.weight_gradient(x_RD, dy_RF, rows_E, like)


def unsupported(d: int, f: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES,
                tile_rows: int | None = None) -> str | None:
  """Why the Mosaic GPU kernel cannot take widths D and F (None when it can)."""
  return mosaic_gpu.unsupported(d, f, dtype, tiles, tile_rows)
