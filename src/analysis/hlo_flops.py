"""Matmul FLOPs of a compiled HLO module, with loops counted once per iteration.

XLA's `compiled.cost_analysis()["flops"]` counts a while loop's body once, so a program with a scanned
layer stack or gradient-accumulation loop reports a fraction of its work. This counts every `dot` and
`ragged-dot` (wherever it sits: in a GEMM fusion, a loop body, a remat branch) and every cuBLAS GEMM
custom call, 2 x (result elements) x (contracted elements), times the run count of its computation
(hlo_module.py). Elementwise work (softmax, norms, activations) is left out, as in the cost model's FLOPs
(cost_model.py), so the two compare directly.
"""

from __future__ import annotations

import math
import re

from meshmoe.analysis import hlo_module

_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cudnn$matmul")


def matmul_flops(hlo: str | hlo_module.HloModule) -> float:
  """FLOPs of every matmul in one execution of the module."""
  module = hlo if isinstance(hlo, hlo_module.HloModule) else hlo_module.parse(hlo)
  total = 0.0
  for computation in module.computations.values():
    runs = module.multiplicity.get(computation.name, 0.0)
    if runs == 0:
      continue
    shapes = {i.name: i.shape for i in computation.instructions}
    for instruction in computation.instructions:
      total += runs * _instruction_flops(instruction, shapes)
  return total


def _instruction_flops(instruction: hlo_module.Instruction, shapes: dict[str, str]) -> float:
  if instruction.opcode in ("dot", "ragged-dot"):
    contracting = _CONTRACTING.search(instruction.attributes)
    dims = [int(d) for d in contracting[1].split(",") if d] if contracting else []
    result = hlo_module.array_shapes(instruction.shape)
  elif instruction.opcode == "custom-call" and any(t in instruction.attributes for t in GEMM_TARGETS):
    numbers = instruction.backend_config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
    dims = [int(d) for d in numbers.get("lhs_contracting_dimensions", [])]
    result = hlo_module.array_shapes(instruction.shape)[:1]  # (output, workspace)
  else:
    return 0.0
  lhs = hlo_module.array_shapes(shapes.get(instruction.operands[0], "")) if instruction.operands else []
  if not result or not lhs:
    return 0.0
  contracted = math.prod(lhs[0][1][d] for d in dims)
  # A ragged dot's result has one row per lhs row; each row multiplies one group: same formula.
  return 2.0 * math.prod(result[0][1]) * contracted
