"""Meshes of GPUs this machine does not have: compile (not run) a program for them, deviceless.

The CUDA PJRT plugin (pip extra `deviceless`) describes a GPU topology from XLA's target spec of the GPU
(`gpu_specs/<target>.txtpb`: core count, shared memory, memory size, compute capability), with no CUDA
libraries and no GPU. `jax.jit(f).lower(*abstract_args).compile()` on such a mesh gives the scheduled
GPU HLO, its `memory_analysis()` and `cost_analysis()`. Run under JAX_PLATFORMS=cpu.

Kernel libraries that choose a kernel from the device they will run on (tokamax reads
`jax.extend.backend.get_default_device()`: its compute capability and SM count) would see this machine's
CPU. `targeting(mesh)` is the one place that declares the target: lower deviceless programs inside it.
"""

from __future__ import annotations

import contextlib
import importlib.resources

import jax
from jax.experimental import topologies

from meshmoe.analysis import compiled_cache, gpus

TARGETS = tuple(gpus.gpu(name).target for name in gpus.GPUS)  # spec file stems, gpus.py's GPUs in its order
# XLA flags a deviceless compile needs. Large sorts (the MoE dispatch sorts 10^5+ assignments) become
# CUB radix sorts on GPUs, whose scratch size XLA asks the CUDA runtime for: without a GPU the compile
# fails ("Error loading CUDA libraries"), so deviceless compiles keep XLA's own sort.
COMPILE_FLAGS = ("--xla_gpu_deviceless_cub_mode=DEVICELESS_CUB_DISABLED",)


# Compiler options for analysis compiles: LLVM and ptxas at -O0. They change only the machine code, which
# an analysis never runs; the optimized, scheduled HLO, its buffer assignment and therefore every figure
# of the AOT report are identical (checked by tests/test_aot.py), and compiles take about 40% less time.
ANALYSIS_OPTIONS = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_gpu_disable_gpuasm_optimizations": True}


def compile_for_analysis(lowered, options: dict | None = None) -> compiled_cache.CompiledProgram:
  """`lowered.compile()` with ANALYSIS_OPTIONS (and `options`), for programs compiled only to be read: the
  scheduled HLO and memory figures, kept in MESHMOE_ANALYSIS_CACHE_DIR when that is set (compiled_cache.py)."""
  return compiled_cache.compile_and_read(lowered, {**ANALYSIS_OPTIONS, **(options or {})})


def gpu_spec(target: str) -> str:
  """XLA's target spec of one GPU kind (text proto): what the deviceless compiler reads, and where gpus.py reads
  the memory size and bandwidth the AOT report and the planner use."""
  return importlib.resources.files("meshmoe.analysis.gpu_specs").joinpath(f"{target}.txtpb").read_text()


def gpu_devices(num_devices: int, target: str = "h100_sxm", num_hosts: int = 1) -> list[jax.Device]:
  """`num_devices` GPUs of `target` spread evenly over `num_hosts` hosts (process_index = host)."""
  if target not in TARGETS:
    raise ValueError(f"unknown GPU target {target!r}; known: {', '.join(TARGETS)}")
  if num_hosts < 1 or num_devices % num_hosts:
    raise ValueError(f"{num_devices} devices do not split evenly over {num_hosts} hosts")
  spec = gpu_spec(target)
  try:
    topology = topologies.get_topology_desc(platform="cuda", target_config=spec,
                                            topology=f"1x{num_hosts}x{num_devices // num_hosts}")
  except Exception as error:  # the plugin missing or too old: say how to get it
    raise RuntimeError("deviceless GPU compilation needs the CUDA PJRT plugin: "
                       "pip install -e '.[deviceless]' (no GPU or CUDA libraries needed)") from error
  return list(topology.devices)


def targeting(mesh: jax.sharding.Mesh) -> contextlib.AbstractContextManager:
  """A context in which the default device is the mesh's first device, so that kernels traced inside it
  are chosen for the mesh's GPU (compute capability, SM count), deviceless or not. Trace (`.lower`) inside."""
  return jax.default_device(mesh.devices.flat[0])
