"""Cost model, fused-kernel part: when the `pallas` tier's kernels run, and what they move and compute.

The Mosaic GPU kernels are custom calls: the compiled HLO shows neither the collectives fused into them
nor their GEMMs. The cost model takes both from the kernels' own accounting (each kernel's api
`bytes_moved`, `moe_routing.expected_rows`), and the AOT report lists them beside what XLA shows.

The kernels run where the parallel ops would pick them (meshmoe.sharding.parallel.fused_kernel_backend):
`parallel.impl="pallas"` on GPUs, for per-device shapes the kernels tile. Their collectives get kinds of
their own ("fused all-gather", "fused reduce-scatter", "fused all-to-all") so nobody looks for them in
the HLO.
"""

from __future__ import annotations

import jax.numpy as jnp

from meshmoe.config import Config
from meshmoe.pallas_kernels import moe_routing, mosaic_tiles
from meshmoe.pallas_kernels.allgather_matmul import api as allgather_kernel
from meshmoe.pallas_kernels.matmul_reducescatter import api as scatter_kernel
from meshmoe.pallas_kernels.moe_dispatch_gemm import api as dispatch_kernel
from meshmoe.pallas_kernels.moe_gemm_combine import api as combine_kernel

FUSED_KINDS = ("fused all-gather", "fused reduce-scatter", "fused all-to-all")
TILE_ROWS = mosaic_tiles.DEFAULT_TILES.block_m


def _on(config: Config, platform: str) -> bool:
  return config.parallel.impl == "pallas" and platform == "gpu"


def projection_kernels_apply(config: Config, platform: str, rows: int, d: int, in_widths: list[float],
                             out_contraction: float) -> bool:
  """Whether a tensor-parallel block's all-gather GEMM (x [rows, D] @ the concatenated in-weights) and
  GEMM reduce-scatter (rows x out_contraction @ [out_contraction, D]) both run as kernels."""
  dtype = jnp.dtype(config.model.dtype)
  return (_on(config, platform)
          and allgather_kernel.unsupported(rows, d, int(sum(in_widths)), dtype) is None
          and scatter_kernel.unsupported(rows, int(out_contraction), d, dtype) is None)


def moe_kernels_apply(config: Config, platform: str, ep: int, width: float) -> bool:
  """Whether expert parallelism over `ep` devices with expert width `width` per device runs the kernels."""
  dtype = jnp.dtype(config.model.dtype)
  d, f = config.model.embed_dim, int(width)
  return (_on(config, platform) and ep > 1 and dispatch_kernel.unsupported(d, [f, f], dtype) is None
          and combine_kernel.unsupported([f], d, dtype) is None)


def projection_bytes(g: int, rows: int, d: int, itemsize: int) -> float:
  """Bytes of one all-gather GEMM or GEMM reduce-scatter over g devices on [rows, D] blocks."""
  return float(allgather_kernel.bytes_moved(g, rows, d, itemsize))


def moe_rows(assignments: int, ep: int, local_experts: int) -> tuple[float, float]:
  """(rows a device's expert GEMMs compute, rows it sends to other devices) per call."""
  return moe_routing.expected_rows(assignments, ep, local_experts, TILE_ROWS)


def moe_buffer_rows(assignments: int, ep: int, local_experts: int) -> tuple[int, int]:
  """(send, receive) buffer rows of the tile plan: the dropless worst case, allocated whatever the routing."""
  send, receive = moe_routing.sizes(assignments, ep, local_experts, TILE_ROWS)
  return send * TILE_ROWS, receive * TILE_ROWS
