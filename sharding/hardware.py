"""What the devices can run: the plan's view of the hardware (`Hardware`) and the kernel choices that depend
only on it and on operand shapes: the unfused MoE paths' grouped GEMM (and tokamax's kernels for it) and
attention's block kernel. `ParallelPlan` (plan.py) makes these choices per op; they live here so that the
plan's module stays about the mesh and the ops.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from meshmoe.pallas_kernels.grouped_weight_gradient import api as grouped_weight_gradient
from meshmoe.sharding import tokamax_gemm


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
  CPUs get the blocked layout (XLA:CPU computes ragged_dot densely over every group), GPUs tokamax's
  kernels (the blocked layout where those cannot run: `grouped_gemm_for`), TPUs XLA's ragged_dot."""
  if requested != "auto":
    return requested
  return {"cpu": "blocked", "gpu": "tokamax"}.get(hardware.platform, "ragged_dot")


# Operand dtypes tokamax's GPU grouped GEMM kernels take.
TOKAMAX_DTYPES = (jnp.bfloat16, jnp.float16)


def grouped_gemm_for(gemm: str, hardware: Hardware, dtype, d: int,
                     f: int) -> tuple[str, tokamax_gemm.Kernels | None, str]:
  """(the grouped GEMM that runs for operands of `dtype`, tokens of width d and experts of width f, the
  tokamax kernels it calls, why it is not `gemm`, or "")."""
  if gemm != "tokamax":
    return gemm, None, ""
  kernels, why_not = tokamax_gemm.kernels_for(hardware.platform, hardware.compute_capability, hardware.num_sms)
  dtype = jnp.dtype(dtype)
  if kernels and hardware.platform == "gpu":
    if dtype not in TOKAMAX_DTYPES:
      kernels, why_not = None, f"tokamax's grouped GEMM takes bfloat16/float16, not {dtype.name}"
    elif d * dtype.itemsize % 16 or f * dtype.itemsize % 16:  # TMA copies rows of whole 16-byte units
      kernels, why_not = None, (f"tokamax's grouped GEMM needs rows of whole 16-byte units: widths {d} and {f} "
                                f"in {dtype.name} are not")
    elif kernels.contraction == tokamax_gemm.MESHMOE and (why := (
        grouped_weight_gradient.unsupported(d, 2 * f, dtype) or grouped_weight_gradient.unsupported(f, d, dtype))):
      # Gate and up side by side, then down. tokamax's own Hopper weight gradient is wrong (tokamax_gemm.py).
      kernels, why_not = None, f"on Hopper the weight gradients run meshmoe's kernel, which cannot take them: {why}"
  if kernels is None:
    return "blocked", None, why_not + ": the blocked GEMM runs"
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
