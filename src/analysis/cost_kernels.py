"""Cost model, kernel part: what custom-call kernels move and compute, which compiled HLO cannot show.

Two kinds of kernels run as custom calls: tokamax's (grouped GEMM and flash attention, on GPUs, every
tier) and the `pallas` tier's fused communicating kernels. Their FLOPs here are modelled from the tiles
the kernels launch for the shapes (balanced routing, or the worst case the buffers allow), never read from
a compiled program; the AOT report keeps them apart from what XLA's program shows.

Fused kernels:
Whether a kernel runs is the parallel plan's decision (meshmoe.sharding.plan: `ops`, implementation
"fused"); this module only accounts for it. Mosaic GPU kernels are custom calls: the compiled HLO shows
neither the collectives fused into them nor their GEMMs, so the cost model takes both from the kernels'
own accounting (each kernel's api `bytes_moved`, `moe_routing.expected_rows`), and the AOT report lists
them beside what XLA shows, under kinds of their own ("fused all-gather", "fused reduce-scatter", "fused
all-to-all") so nobody looks for them in the HLO. The "collectives" kernel backend is plain XLA (each
kernel's reference.py): its collectives and GEMMs are in the HLO like any other.
"""

from __future__ import annotations

import math

from meshmoe.pallas_kernels import moe_routing
from meshmoe.pallas_kernels.allgather_matmul import api as allgather_matmul
from meshmoe.sharding.plan import OpChoice

FUSED_KINDS = ("fused all-gather", "fused reduce-scatter", "fused all-to-all")


# The row tiles of the grouped-GEMM kernels (sharding/grouped_gemm_kernels.py), as (rows per tile, the
# multiple an expert's first tile starts at): only tiles holding rows of some expert run.
# - tokamax 0.0.17's Mosaic GPU kernels with their heuristic config (what runs without autotuning, and in
#   every deviceless compile): 64-row tiles, a group's first starting at its first row rounded down to 8;
# - tokamax's Triton kernels (heuristics): 128-row tiles from a group's first row;
# - JAX's Hopper kernels: `block_m`-row tiles on one grid over the buffer, so a group's first tile starts at
#   its first row rounded down to a multiple of block_m.
TOKAMAX_TILES = (64, 8)
TOKAMAX_TRITON_TILES = (128, 1)


def in_custom_calls(choice: OpChoice | None) -> bool:
  """Whether an op's communication and GEMMs run inside custom calls the HLO cannot show."""
  return choice is not None and choice.implementation == "fused" and choice.kernel_backend != "collectives"


def gemm_in_kernels(choice: OpChoice | None) -> bool:
  """Whether the routed experts' grouped GEMM runs GPU kernels (custom calls), not XLA's ragged dot."""
  kernels = getattr(choice, "gemm_kernels", None)
  return kernels is not None and kernels.forward.implementation not in ("xla", "xla_cudnn")


def gemm_tiles(choice: OpChoice) -> tuple[int, int]:
  """(rows per tile, start alignment) of the row GEMMs of `choice.gemm_kernels` (module constants)."""
  forward = choice.gemm_kernels.forward
  if forward.implementation == "jax_mgpu":
    rows = dict(forward.tiles)["block_m"]
    return rows, rows
  return TOKAMAX_TRITON_TILES if forward.implementation == "tokamax_triton" else TOKAMAX_TILES


def swiglu_recomputed(choice: OpChoice | None) -> bool:
  """Whether the MoE kernels compute SwiGLU themselves and recompute gate and up for its gradient
  (pallas_kernels/moe_dispatch_gemm/swiglu.py): no [R, F] gate or up buffer, 2 more GEMMs per 9."""
  return in_custom_calls(choice) and choice.implementation == "fused" and choice.swiglu_gradient == "recompute"


def kernel_rows(rows_per_expert: float, experts: int, tiles: tuple[int, int]) -> float:
  """Rows a grouped-GEMM kernel with `tiles` (gemm_tiles) computes for `experts` groups of `rows_per_expert`
  rows (balanced routing): each group's rows, from a start at most align - 1 rows early, in whole tiles."""
  tile, align = tiles
  count = math.ceil((rows_per_expert + align - 1) / tile) if rows_per_expert else 0
  return experts * count * tile


def kernel_worst_rows(buffer_rows: int, experts: int, tiles: tuple[int, int]) -> float:
  """The most rows it can compute over a buffer of `buffer_rows`: every tile of the buffer, plus one
  partial tile per expert boundary (the kernels' task count)."""
  return (math.ceil(buffer_rows / tiles[0]) + experts - 1) * tiles[0]


def projection_bytes(g: int, rows: int, d: int, itemsize: int) -> float:
  """Bytes of one all-gather GEMM or GEMM reduce-scatter over g devices on [rows, D] blocks."""
  return float(allgather_matmul.bytes_moved(g, rows, d, itemsize))


def tile_rows(choice: OpChoice) -> int:
  """Rows per tile of the MoE kernels' tile plan: their tiles' height (`parallel.kernel_tiles`)."""
  return choice.tiles.block_m


def moe_rows(assignments: int, ep: int, local_experts: int, rows_per_tile: int) -> tuple[float, float]:
  """(rows a device's expert GEMMs compute, rows it sends to other devices) per call."""
  return moe_routing.expected_rows(assignments, ep, local_experts, rows_per_tile)


def moe_buffer_rows(assignments: int, ep: int, local_experts: int, rows_per_tile: int) -> tuple[int, int]:
  """(send, receive) buffer rows of the tile plan: the dropless worst case, allocated whatever the routing."""
  send, receive = moe_routing.sizes(assignments, ep, local_experts, rows_per_tile)
  return send * rows_per_tile, receive * rows_per_tile
