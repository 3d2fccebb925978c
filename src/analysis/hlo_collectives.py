"""The collectives of a compiled (optimized, SPMD-partitioned) HLO module: bytes moved, and whether they
overlap compute.

Bytes are per device and per execution of the module, counted the way the cost model counts them
(cost_collectives.py), for a group of g devices and a per-device result of b bytes:
  all-gather       (g-1)/g x b_result        (receive every other device's block)
  reduce-scatter   (g-1) x b_result          (send every block but one's own; operand = g x result)
  all-reduce       2(g-1)/g x b              (reduce-scatter + all-gather, the bandwidth-optimal ring)
  all-to-all       (g-1)/g x b               (keep one block, send the rest)
  collective-permute  b                      (one send per device)
  ragged-all-to-all   b_output               (an upper bound: the real sizes are only known at run time)
A collective inside a loop counts once per iteration (hlo_module.py gives every computation its run
count). An asynchronous pair (`*-start` ... `*-done`, or an `async-start`/`fusion-start` wrapping a
collective, as GPU compiles write them) counts once, with the result shape of its done.

Overlap (scheduled GPU modules): a collective is overlapped when its start and done are separate and
compute that does not depend on it is scheduled between them. Nothing between a start and its done can
use the collective's result, so anything there is independent. Compute means a kernel that multiplies
matrices (a fusion holding a dot, a GEMM custom call, a loop or call that runs one): the index arithmetic,
slicing and copies XLA also schedules there take microseconds and hide nothing. A start whose done lies in
the next loop iteration (a pipelined collective) is overlapped when compute follows it. Synchronous
collectives (every collective on CPU) are not overlapped.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

from meshmoe.analysis import hlo_flops, hlo_module

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "ragged-all-to-all")
_MATMULS = ("dot", "ragged-dot", "convolution")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str
  group_size: int
  result_bytes: float  # one execution's result, per device
  count: float = 1.0  # executions per run of the module (loop trip counts)
  overlapped: bool = False

  @property
  def bytes(self) -> float:
    """Bytes this device moves in all executions (see the module docstring)."""
    return self.count * moved_bytes(self.kind, self.group_size, self.result_bytes)


def moved_bytes(kind: str, group_size: int, result_bytes: float) -> float:
  """Bytes one device moves in a collective of `kind` over `group_size` devices with this result size."""
  g = group_size
  if g <= 1:
    return 0.0
  factor = {"all-gather": (g - 1) / g, "reduce-scatter": g - 1, "all-reduce": 2 * (g - 1) / g,
            "all-to-all": (g - 1) / g, "collective-permute": 1.0, "ragged-all-to-all": 1.0}[kind]
  return factor * result_bytes


def shape_bytes(text: str) -> float:
  """Bytes of every array shape written in `text` (a shape or a tuple of shapes)."""
  return hlo_module.shape_bytes(text)


def collectives(hlo: str | hlo_module.HloModule, num_devices: int) -> list[Collective]:
  """Every collective of a compiled module (its `as_text()`, or lines of instructions without computation
  headers, read as one entry computation)."""
  module = hlo if isinstance(hlo, hlo_module.HloModule) else _parse(hlo)
  overlapped = _overlapped_schedule_units(module)
  unit_of = _schedule_units(module)
  found = []
  for computation, instruction in module.instructions():
    kind = _collective_kind(instruction.opcode)
    if kind is None:
      continue
    count = module.multiplicity.get(computation.name, 0.0)
    if count == 0:
      continue
    unit = instruction.name if not computation.is_fused else unit_of.get(computation.name)
    found.append(Collective(kind, _group_size(instruction.attributes, num_devices),
                            _result_bytes(computation, instruction), count, unit in overlapped))
  return found


def bytes_by_kind(found: list[Collective]) -> dict[str, float]:
  totals: dict[str, float] = collections.defaultdict(float)
  for c in found:
    totals[c.kind] += c.bytes
  return dict(totals)


def overlap_fraction(found: list[Collective]) -> float:
  """Bytes of overlapped collectives / bytes of all collectives (1.0 when there are none)."""
  total = sum(c.bytes for c in found)
  return sum(c.bytes for c in found if c.overlapped) / total if total else 1.0


def _parse(text: str) -> hlo_module.HloModule:
  if not re.search(r"^\S.*->.*\{\s*$", text, re.MULTILINE):  # bare instruction lines
    text = "ENTRY %lines () -> () {\n" + text + "\n}\n"
  return hlo_module.parse(text)


def _collective_kind(opcode: str) -> str | None:
  base = opcode.removesuffix("-start")
  return base if base in KINDS and not opcode.endswith("-done") else None


def _result_bytes(computation: hlo_module.Computation, instruction: hlo_module.Instruction) -> float:
  """A sync collective's result; for a `*-start`, its done's result (the start's tuple also holds the
  operands), or, when the done is elsewhere (pipelined), the start's result element."""
  if not instruction.opcode.endswith("-start"):
    return hlo_module.shape_bytes(instruction.shape)
  for other in computation.instructions:
    if other.opcode.endswith("-done") and instruction.name in other.operands:
      return hlo_module.shape_bytes(other.shape)
  elements = hlo_module.tuple_elements(instruction.shape)
  if instruction.opcode == "all-reduce-start" or len(elements) < 2:
    return hlo_module.shape_bytes(instruction.shape)
  return hlo_module.shape_bytes(elements[1])


def _schedule_units(module: hlo_module.HloModule) -> dict[str, str]:
  """For every fused computation, the name of the scheduled instruction that runs it (transitively)."""
  caller: dict[str, tuple[str, str]] = {}
  for computation, instruction in module.instructions():
    for callee in instruction.callees:
      caller.setdefault(callee, (computation.name, instruction.name))
  units = {}
  for name, computation in module.computations.items():
    seen, current = set(), name
    while module.computations.get(current) is not None and module.computations[current].is_fused \
        and current in caller and current not in seen:
      seen.add(current)
      parent, instruction = caller[current]
      if not module.computations[parent].is_fused:
        units[name] = instruction
        break
      current = parent
  return units


def _overlapped_schedule_units(module: hlo_module.HloModule) -> set[str]:
  """Names of the asynchronous starts in scheduled computations with independent compute before their done."""
  overlapped = set()
  for computation in module.scheduled_computations():
    sequence = computation.instructions
    communication = {i.name for i in sequence if _contains(module, i, _is_collective)}
    compute = {i.name for i in sequence if i.name not in communication and _contains(module, i, _is_matmul)}
    for index, start in enumerate(sequence):
      if not start.opcode.endswith("-start") or start.name not in communication or _is_sync(start):
        continue
      end = next((j for j in range(index + 1, len(sequence))
                  if sequence[j].opcode.endswith("-done") and start.name in sequence[j].operands), len(sequence))
      if any(i.name in compute for i in sequence[index + 1:end]):
        overlapped.add(start.name)
  return overlapped


def _is_collective(instruction: hlo_module.Instruction) -> bool:
  return _collective_kind(instruction.opcode) is not None


# Custom-call kernels that run GEMMs (tokamax's grouped GEMM and flash attention, the fused kernels): compute
# a collective can hide behind, though their FLOPs are not countable from the HLO.
_KERNEL_TARGETS = ('custom_call_target="mosaic_gpu', 'custom_call_target="__gpu$xla.gpu.triton"')


def _is_matmul(instruction: hlo_module.Instruction) -> bool:
  return instruction.opcode in _MATMULS or (instruction.opcode == "custom-call" and any(
      t in instruction.attributes for t in hlo_flops.GEMM_TARGETS + _KERNEL_TARGETS))


def _contains(module: hlo_module.HloModule, instruction: hlo_module.Instruction, test) -> bool:
  """Whether `instruction` or anything in the computations it calls (transitively) passes `test`."""
  if test(instruction):
    return True
  pending, seen = list(instruction.callees), set()
  while pending:
    name = pending.pop()
    if name in seen or name not in module.computations:
      continue
    seen.add(name)
    for inner in module.computations[name].instructions:
      if test(inner):
        return True
      pending += inner.callees
  return False


def _is_sync(instruction: hlo_module.Instruction) -> bool:
  config = instruction.backend_config().get("collective_backend_config", {})
  return bool(config.get("is_sync", False))


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
