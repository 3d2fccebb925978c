"""The GPU kinds meshmoe plans and compiles for, each described once.

Two files per kind, in gpu_specs/:
- `<target>.txtpb`, XLA's target spec of the GPU (GpuTargetConfigProto): what the deviceless compiler reads
  (deviceless.py). Its memory size and bandwidth are read from it here, so that the figures the planner uses are
  the compiler's;
- `hardware.toml`, what XLA's spec lacks: the dense BF16 peak, NVLink and network bandwidth per GPU, and GPUs per
  node of the reference system, each with the datasheet it comes from.

Imports nothing of JAX or meshmoe: the training metrics (MFU) and command lines read it before JAX starts.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
import tomllib

_SPECS = "meshmoe.analysis.gpu_specs"


@dataclasses.dataclass(frozen=True)
class GpuSpec:
  name: str  # "h100"
  target: str  # XLA spec file stem, "h100_sxm"
  description: str  # "NVIDIA H100 SXM 80GB"
  dense_bf16_flops: float  # FLOP/s
  memory_bytes: float  # device_memory_size from the XLA spec
  memory_bandwidth: float  # bytes/s, memory_bandwidth from the XLA spec
  nvlink_bandwidth: float  # bytes/s per GPU per direction within a node
  network_bandwidth: float  # bytes/s per GPU per direction across nodes
  gpus_per_node: int


@functools.cache
def _hardware() -> dict[str, dict]:
  return tomllib.loads(importlib.resources.files(_SPECS).joinpath("hardware.toml").read_text())


def _spec_figure(text: str, field: str, target: str) -> float:
  found = re.search(rf"^\s*{field}:\s*(\d+)\s*$", text, re.MULTILINE)
  if found is None:
    raise ValueError(f"gpu_specs/{target}.txtpb has no {field}")
  return float(found[1])


@functools.cache
def gpu(name: str) -> GpuSpec:
  """The GPU kind `name` ("h100", "h200", ...); ValueError naming the known ones for any other."""
  if name not in _hardware():
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
  row = _hardware()[name]
  # The same text deviceless.gpu_spec hands the compiler (that module imports JAX, this one must not).
  text = importlib.resources.files(_SPECS).joinpath(f"{row['target']}.txtpb").read_text()
  return GpuSpec(name=name, target=row["target"], description=row["description"],
                 dense_bf16_flops=float(row["dense_bf16_flops"]),
                 memory_bytes=_spec_figure(text, "device_memory_size", row["target"]),
                 memory_bandwidth=_spec_figure(text, "memory_bandwidth", row["target"]),
                 nvlink_bandwidth=float(row["nvlink_bandwidth"]), network_bandwidth=float(row["network_bandwidth"]),
                 gpus_per_node=int(row["gpus_per_node"]))


GPUS: tuple[str, ...] = tuple(_hardware())
