"""What the devices can run: the plan's view of the hardware (`Hardware`) and the kernel choices that depend
only on it and on operand shapes: the unfused MoE paths' grouped GEMM (and the measured kernels of its
forms: gpu_kernel_table.py) and attention's block kernel. `ParallelPlan` (plan.py) makes these choices per op; they live here so that the
plan's module stays about the mesh and the ops.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshmoe.config import gemm_kernel_overrides
from meshmoe.sharding import gpu_kernel_table
from meshmoe.sharding.grouped_gemm_kernels import GemmKernels


@dataclasses.dataclass(frozen=True)
class Hardware:
  """What the plan needs to know of the devices (the mesh's first; a mesh is one kind of device)."""

  platform: str  # "cpu", "gpu" or "tpu"
  device_kind: str  # e.g. "NVIDIA H100 80GB HBM3"
  compute_capability: str  # GPUs: "9.0" on Hopper; "" elsewhere
  num_sms: int  # GPUs: streaming multiprocessors of one device (fused kernels launch a block on each); else 0

  @classmethod
  def of(cls, device: jax.Device) -> Hardware:
    gpu = device.platform == "gpu"
    return cls(device.platform, str(getattr(device, "device_kind", "")),
               str(getattr(device, "compute_capability", "") or "") if gpu else "",
               int(getattr(device, "core_count", 0) or 0) if gpu else 0)

  def describe(self) -> str:
    if self.platform != "gpu":
      return self.platform
    return f"{self.device_kind or 'gpu'} (compute capability {self.compute_capability}, {self.num_sms} SMs)"


def grouped_gemm(requested: str, hardware: Hardware) -> str:
  """The grouped GEMM of the unfused MoE paths: `parallel.grouped_gemm`, with "auto" resolved by platform:
  CPUs get the blocked layout (XLA:CPU computes ragged_dot densely over every group), GPUs the measured
  kernels (the blocked layout where none can run: `grouped_gemm_for`), TPUs XLA's ragged_dot."""
  if requested != "auto":
    return requested
  return {"cpu": "blocked", "gpu": "kernels"}.get(hardware.platform, "ragged_dot")


def grouped_gemm_for(gemm: str, hardware: Hardware, dtype, d: int, f: int, overrides: str = "",
                     kernel_table: str = "") -> tuple[str, GemmKernels | None, str]:
  """(the grouped GEMM that runs for operands of `dtype`, tokens of width d and experts of width f, the
  kernels of its three forms for "kernels", why it is not `gemm`, or ""). `overrides`/`kernel_table`:
  `parallel.gemm_kernels` and `parallel.kernel_table` (GPUs only)."""
  if gemm != "kernels":
    return gemm, None, ""
  if hardware.platform != "gpu":
    return gemm, GemmKernels.exact("off GPUs: XLA's ragged dot (exact; checks the kernels' path)"), ""
  kernels, why_not = gpu_kernel_table.choose(hardware.compute_capability, dtype, d, f, hardware.num_sms,
                                             kernel_table, gemm_kernel_overrides(overrides))
  if kernels is None:
    return "blocked", None, f"{why_not}: the blocked GEMM runs (exact, slower)"
  return gemm, kernels, ""


def attention_kernel(requested: str, hardware: Hardware) -> tuple[str, str]:
  """(the kernel of attention's blocks, why it is not tokamax's GPU kernel where one was asked for, or "")
  for `parallel.attention_kernel`: "" is the einsum blocks, else tokamax's "mosaic" (its Mosaic GPU flash
  attention: forward sm80+, backward sm90/sm100 only), "triton" (its Pallas Triton one, forward and
  backward, for sm80) or "xla" (its plain-XLA version: only to check the kernel path on CPU). "auto" is
  the GPU kernel where there is one, else the einsum blocks. Operand dtypes and head sizes are checked by
  `ParallelPlan.attention` (attention_kernels.unsupported)."""
  if requested == "einsum" or (requested == "auto" and hardware.platform != "gpu"):
    return "", ""
  if hardware.platform != "gpu":
    return "xla", ""
  kernel = {"8": "triton", "9": "mosaic", "10": "mosaic"}.get(hardware.compute_capability.split(".")[0], "")
  if not kernel:
    return "", (f"tokamax has no flash attention kernel for compute capability "
                f"{hardware.compute_capability or 'unknown'}: the einsum blocks run")
  return kernel, ""
