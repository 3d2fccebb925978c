"""The collectives of a compiled (optimized, SPMD-partitioned) HLO module and the bytes each moves.

Bytes are per device and per execution, counted the way the cost model counts them (cost_model.py), for
a group of g devices and a per-device buffer of b bytes:
  all-gather       (g-1)/g x b_result        (receive every other device's block)
  reduce-scatter   (g-1) x b_result          (send every block but one's own; operand = g x result)
  all-reduce       2(g-1)/g x b              (reduce-scatter + all-gather, the bandwidth-optimal ring)
  all-to-all       (g-1)/g x b               (keep one block, send the rest)
  collective-permute  b                      (one send per device)
  ragged-all-to-all   b_output               (an upper bound: the real sizes are only known at run time)
Optimized HLO does not spell out operand shapes, so everything is derived from the result's shape. Async
pairs (`*-start` / `*-done`) count once, at the start.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "ragged-all-to-all")

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<result>\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>" + "|".join(re.escape(k) for k in sorted(KINDS, key=len, reverse=True)) + r")(?:-start)?\("
    r"(?P<rest>.*)$")
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str
  group_size: int
  result_bytes: int

  @property
  def bytes(self) -> float:
    """Bytes this device moves (see the module docstring)."""
    return moved_bytes(self.kind, self.group_size, self.result_bytes)


def moved_bytes(kind: str, group_size: int, result_bytes: float) -> float:
  """Bytes one device moves in a collective of `kind` over `group_size` devices with this result size."""
  g = group_size
  if g <= 1:
    return 0.0
  factor = {"all-gather": (g - 1) / g, "reduce-scatter": g - 1, "all-reduce": 2 * (g - 1) / g,
            "all-to-all": (g - 1) / g, "collective-permute": 1.0, "ragged-all-to-all": 1.0}[kind]
  return factor * result_bytes


def shape_bytes(text: str) -> int:
  """Bytes of every array shape written in `text` (a shape or a tuple of shapes)."""
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
  return total


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
  """Every collective instruction of `hlo_text` (the compiled module's `as_text()`)."""
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if not match or "-done" in line.split("=", 1)[1].split("(", 1)[0]:
      continue
    found.append(Collective(match["kind"], _group_size(match["rest"], num_devices),
                            shape_bytes(match["result"])))
  return found


def bytes_by_kind(found: list[Collective]) -> dict[str, float]:
  totals: dict[str, float] = collections.defaultdict(float)
  for c in found:
    totals[c.kind] += c.bytes
  return dict(totals)


def _group_size(attributes: str, num_devices: int) -> int:
  """Devices per replica group, from any of XLA's three spellings of `replica_groups` (or a permute's
  source-target pairs, where it is the ring size)."""
  mesh_form = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attributes)
  if mesh_form:
    sizes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", mesh_form[1])}
    return math.prod(sizes[name] for name in re.findall(r"'(\w+)'", mesh_form[2]))
  iota_form = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attributes)
  if iota_form:
    return int(iota_form[2])
  explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", attributes)
  if explicit:
    return len(explicit[1].split(","))
  if re.search(r"replica_groups=\{\}", attributes):
    return num_devices
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}?", attributes)
  if pairs:
    return len(re.findall(r"\{\d+,\d+\}", attributes)) or num_devices
  return num_devices
