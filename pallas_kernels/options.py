"""The static choices of a fused kernel call, shared by every op's api.py."""

from __future__ import annotations

import dataclasses

from meshmoe.pallas_kernels import mosaic_tiles, sm_budget
from meshmoe.pallas_kernels.mosaic_tiles import Tiles

FUSED_BACKENDS = ("tpu_interpret", "mosaic_gpu")


@dataclasses.dataclass(frozen=True)
class Options:
  """The backend ("tpu_interpret" or "mosaic_gpu"), the tiles (block_m is also the MoE tile plan's tile
  height) and the number of thread blocks (sm_budget.py; simulated ones for the twin)."""

  backend: str
  tiles: Tiles = mosaic_tiles.DEFAULT_TILES
  num_blocks: int = 1

  def __post_init__(self):
    if self.backend not in FUSED_BACKENDS:
      raise ValueError(f"fused backends are {', '.join(map(repr, FUSED_BACKENDS))}, not {self.backend!r}")

  @classmethod
  def of(cls, backend: str, tiles: Tiles, num_sms: int | None) -> Options:
    return cls(backend, tiles, sm_budget.kernel_blocks(backend, num_sms))
