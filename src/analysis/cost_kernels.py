"""Cost model, fused-kernel part: what the `pallas` tier's kernels move and compute.

Whether a kernel runs is the parallel plan's decision (meshmoe.sharding.plan: `ops`, implementation
"fused"); this module only accounts for it. Mosaic GPU kernels are custom calls: the compiled HLO shows
neither the collectives fused into them nor their GEMMs, so the cost model takes both from the kernels'
own accounting (each kernel's api `bytes_moved`, `moe_routing.expected_rows`), and the AOT report lists
them beside what XLA shows, under kinds of their own ("fused all-gather", "fused reduce-scatter", "fused
all-to-all") so nobody looks for them in the HLO. The "collectives" kernel backend is plain XLA (each
kernel's reference.py): its collectives and GEMMs are in the HLO like any other.
"""

from __future__ import annotations

from meshmoe.pallas_kernels import moe_routing, mosaic_tiles
from meshmoe.pallas_kernels.allgather_matmul import api as allgather_matmul
from meshmoe.sharding.plan import OpChoice

FUSED_KINDS = ("fused all-gather", "fused reduce-scatter", "fused all-to-all")
TILE_ROWS = mosaic_tiles.DEFAULT_TILES.block_m


def in_custom_calls(choice: OpChoice | None) -> bool:
  """Whether an op's communication and GEMMs run inside custom calls the HLO cannot show."""
  return choice is not None and choice.implementation == "fused" and choice.kernel_backend != "collectives"


def projection_bytes(g: int, rows: int, d: int, itemsize: int) -> float:
  """Bytes of one all-gather GEMM or GEMM reduce-scatter over g devices on [rows, D] blocks."""
  return float(allgather_matmul.bytes_moved(g, rows, d, itemsize))


def moe_rows(assignments: int, ep: int, local_experts: int) -> tuple[float, float]:
  """(rows a device's expert GEMMs compute, rows it sends to other devices) per call."""
  return moe_routing.expected_rows(assignments, ep, local_experts, TILE_ROWS)


def moe_buffer_rows(assignments: int, ep: int, local_experts: int) -> tuple[int, int]:
  """(send, receive) buffer rows of the tile plan: the dropless worst case, allocated whatever the routing."""
  send, receive = moe_routing.sizes(assignments, ep, local_experts, TILE_ROWS)
  return send * TILE_ROWS, receive * TILE_ROWS
