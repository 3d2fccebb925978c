"""How many thread blocks a fused kernel launches: the SM budget (PROTOCOL.md, "Residency").

The fused kernels are persistent: every block waits on semaphores that blocks of other devices signal, and
those wait in turn on this device's blocks, so a kernel is deadlock-free only if all its blocks are
resident at once. One block fills an SM (its shared memory is most of the SM's), so the kernel may launch
at most as many blocks as there are SMs nothing else holds. XLA runs its own collectives (NCCL kernels,
e.g. the data-parallel gradient reduction overlapping the backward pass) on other streams at the same
time; they hold up to NCCL_MAX_CTAS SMs. The budget is therefore the device's SM count, read from the
device or, compiling without one, from the target's spec, minus that reserve.
"""

from __future__ import annotations

import os

import jax

# SMs left for XLA's collectives when the job does not pin NCCL_MAX_CTAS: NCCL's largest number of
# channels (one thread block each) per collective; setting NCCL_MAX_CTAS lowers both together.
DEFAULT_COLLECTIVE_SMS = 32
# Blocks a twin kernel simulates when none is given. Tests run more (tests/pallas_kernels/harness.py): each
# simulated block is its own XLA:CPU execution, and many at once starve XLA's CPU executor.
TWIN_BLOCKS = 1


def collective_sms() -> int:
  value = os.environ.get("NCCL_MAX_CTAS", "")
  if not value:
    return DEFAULT_COLLECTIVE_SMS
  if not value.isdigit() or int(value) < 1:
    raise ValueError(f"NCCL_MAX_CTAS={value!r}: expected a positive whole number of thread blocks")
  return int(value)


def device_sms() -> int:
  """SMs of this process's first GPU; an error without one (compiling deviceless, pass the target's)."""
  device = jax.devices()[0]
  sms = int(getattr(device, "core_count", 0) or 0) if device.platform == "gpu" else 0
  if sms < 1:
    raise ValueError(f"no GPU here reports its SMs ({device.platform} device {device.device_kind!r}); pass "
                     "num_sms, the target GPU's SM count (e.g. the deviceless target's, plan.hardware.num_sms)")
  return sms


def kernel_blocks(backend: str, num_sms: int | None = None) -> int:
  """Blocks of a fused kernel on `backend`: for "mosaic_gpu", the SM budget of a GPU with `num_sms` SMs
  (read from the device when None); for "tpu_interpret", `num_sms` simulated blocks (TWIN_BLOCKS if None)."""
  if backend == "tpu_interpret":
    return num_sms or TWIN_BLOCKS
  sms = device_sms() if num_sms is None else int(num_sms)
  reserve = collective_sms()
  if sms - reserve < 1:
    raise ValueError(f"a GPU of {sms} SMs leaves no SM for the fused kernels after the {reserve} that XLA's "
                     f"collectives may hold (NCCL_MAX_CTAS); set NCCL_MAX_CTAS below {sms}")
  return sms - reserve
