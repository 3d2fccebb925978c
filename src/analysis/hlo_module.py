"""A parsed compiled HLO module (`compiled.as_text()`): computations, instructions and how often each runs.

XLA's own `cost_analysis()` counts a while loop's body once, whatever its trip count, so a scanned layer
stack or a gradient-accumulation loop would be undercounted L- or A-fold. This parser keeps the call graph
instead: every computation gets a multiplicity (how many times it runs per execution of the module), from
the entry computation through while loops (times their `known_trip_count`), fusions, calls, conditionals
(each branch counted as if taken: an upper bound) and async wrappers. The analyses in hlo_collectives.py
and hlo_flops.py, and the overlap analysis of the AOT report, read the module through this.

A scheduled module (`is_scheduled=true`, what a GPU compile returns) lists each non-fused computation's
instructions in execution order; fused computations are one kernel and have no order of their own.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterator

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
                "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e8m0fnu": 1, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION_HEAD = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"([\w\-$.]+)\(")
_SINGLE_CALLEE = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLEE_LIST = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # the result shape as written: an array, or a tuple "(...)"
  opcode: str
  operands: list[str]  # operand instruction names
  attributes: str  # everything after the operand list
  callees: list[str]  # computations it calls
  is_root: bool = False

  def backend_config(self) -> dict:
    """The `backend_config` JSON (empty when absent or unparsable)."""
    start = self.attributes.find("backend_config=")
    if start < 0:
      return {}
    text = self.attributes[start + len("backend_config="):]
    try:
      return json.JSONDecoder().raw_decode(text)[0]
    except ValueError:
      return {}


@dataclasses.dataclass
class Computation:
  name: str
  instructions: list[Instruction]
  is_entry: bool = False
  is_fused: bool = False  # the body of a fusion: one kernel, no schedule of its own

  def by_name(self) -> dict[str, Instruction]:
    return {i.name: i for i in self.instructions}


@dataclasses.dataclass
class HloModule:
  computations: dict[str, Computation]  # in the order of the text (callees before callers)
  multiplicity: dict[str, float]  # runs of each computation per execution of the module
  unknown_trip_counts: int  # while loops without a known trip count (counted once)

  def instructions(self) -> Iterator[tuple[Computation, Instruction]]:
    for computation in self.computations.values():
      for instruction in computation.instructions:
        yield computation, instruction

  def scheduled_computations(self) -> Iterator[Computation]:
    """Computations that run as a sequence of kernels (entry, loop bodies, branches), in schedule order."""
    for computation in self.computations.values():
      if not computation.is_fused and self.multiplicity.get(computation.name, 0) > 0:
        yield computation


def parse(hlo_text: str) -> HloModule:
  computations: dict[str, Computation] = {}
  current: Computation | None = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION_HEADER.match(line)
    if header and current is None:
      current = Computation(header[2], [], is_entry=bool(header[1]))
      continue
    if current is None:
      continue
    if line.strip() == "}":
      computations[current.name] = current
      current = None
      continue
    instruction = parse_instruction(line)
    if instruction is not None:
      current.instructions.append(instruction)
  _mark_fused(computations)
  multiplicity, unknown = _multiplicities(computations)
  return HloModule(computations, multiplicity, unknown)


def parse_instruction(line: str) -> Instruction | None:
  head = _INSTRUCTION_HEAD.match(line)
  if not head:
    return None
  rest = line[head.end():]
  shape_end = _balanced_token_end(rest, 0)
  shape = rest[:shape_end]
  opcode = _OPCODE.match(rest, shape_end + 1)
  if not opcode:
    return None
  operands_start = opcode.end() - 1
  operands_end = _matching_paren(rest, operands_start)
  operands = re.findall(r"%([\w.\-]+)", rest[operands_start:operands_end])
  attributes = rest[operands_end + 1:]
  callees = [m[2] for m in _SINGLE_CALLEE.finditer(attributes)]
  for m in _CALLEE_LIST.finditer(attributes):
    callees += re.findall(r"%?([\w.\-]+)", m[2])
  return Instruction(head[2], shape, opcode[1], operands, attributes, callees, bool(head[1]))


def _balanced_token_end(text: str, start: int) -> int:
  """End of the token at `start` (a shape, possibly a tuple with nested brackets): the first space outside
  any bracket."""
  depth = 0
  for i in range(start, len(text)):
    ch = text[i]
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == " " and depth == 0:
      return i
  return len(text)


def _matching_paren(text: str, open_index: int) -> int:
  depth = 0
  for i in range(open_index, len(text)):
    if text[i] == "(":
      depth += 1
    elif text[i] == ")":
      depth -= 1
      if depth == 0:
        return i
  return len(text)


def _mark_fused(computations: dict[str, Computation]) -> None:
  """Computations called by anything but a while loop, a conditional or a call run inside one kernel or
  one op (fusions, async wrappers, reduction combiners): they have no schedule of their own."""
  for computation in computations.values():
    for instruction in computation.instructions:
      if instruction.opcode in ("while", "conditional", "call"):
        continue
      for callee in instruction.callees:
        if callee in computations:
          computations[callee].is_fused = True


def _multiplicities(computations: dict[str, Computation]) -> tuple[dict[str, float], int]:
  """Runs of every computation per module execution. Callees are defined before their callers, so one
  pass over the computations in reverse text order sees every caller's count before its callees'."""
  counts = {name: 0.0 for name in computations}
  unknown = 0
  for computation in computations.values():
    if computation.is_entry:
      counts[computation.name] = 1.0
  for computation in reversed(list(computations.values())):
    runs = counts[computation.name]
    for instruction in computation.instructions:
      factor = 1.0
      if instruction.opcode == "while":
        trip = _TRIP_COUNT.search(instruction.attributes)
        if trip:
          factor = float(trip[1])
        else:
          unknown += 1
      for callee in instruction.callees:
        if callee in counts:
          counts[callee] += runs * factor
  return counts, unknown


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array written in `shape` (one array, or a tuple of them)."""
  return [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(shape)
          if dtype in _DTYPE_BYTES]


def shape_bytes(shape: str) -> float:
  """Bytes of every array in `shape`."""
  return sum(_DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in array_shapes(shape))


def tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape "(a, (b, c), d)" -> ["a", "(b, c)", "d"]; [shape] if not a
  tuple."""
  shape = re.sub(r"/\*.*?\*/", "", shape).strip()
  if not shape.startswith("("):
    return [shape]
  elements, depth, start = [], 0, 1
  for i, ch in enumerate(shape):
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
      elements.append(shape[start:i].strip())
      start = i + 1
  return [e for e in elements if e]
