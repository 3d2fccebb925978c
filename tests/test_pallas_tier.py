"""Which implementation the `pallas` tier picks per op (meshmoe.sharding.parallel.fused_kernel_backend):
the Mosaic GPU kernels on Hopper GPUs for shapes they tile, the op's `xla` tier elsewhere (said once in the
log), the kernels' references with `parallel.kernel_backend="reference"`."""

import jax
import numpy as np
import pytest
from absl import logging
from jax.sharding import Mesh

from meshmoe.analysis import deviceless
from meshmoe.config import ParallelConfig
from meshmoe.sharding import parallel
from meshmoe.sharding.rules import get_preset
from meshmoe.sharding.shardings import ShardingContext


def _ctx(devices, **parallel_fields) -> ShardingContext:
  mesh = Mesh(np.array(devices).reshape(len(devices)), ("data",))
  return ShardingContext(mesh, get_preset("dp"), ParallelConfig(**parallel_fields))


def test_hopper_gpus_get_the_mosaic_kernels_for_shapes_that_tile():
  ctx = _ctx(deviceless.gpu_devices(8), impl="pallas")
  assert parallel.fused_kernel_backend(ctx, "op") == "mosaic_gpu"
  assert parallel.num_sms(ctx) == 132
  assert parallel.fused_kernel_backend(ctx, "op", unsupported="N=100 is not a multiple of its tile 128") is None


def test_other_tiers_never_use_kernels():
  for impl in ("reference", "xla"):
    assert parallel.fused_kernel_backend(_ctx(deviceless.gpu_devices(8), impl=impl), "op") is None


def test_cpu_falls_back_and_says_so_once(monkeypatch):
  messages = []
  monkeypatch.setattr(logging, "warning", lambda fmt, *args: messages.append(fmt % args))
  ctx = _ctx(jax.devices()[:8], impl="pallas")
  for _ in range(3):
    assert parallel.fused_kernel_backend(ctx, "test op (cpu)") is None
  assert len(messages) == 1 and "test op (cpu) runs its xla tier: no fused kernels on cpu" in messages[0]


@pytest.mark.parametrize("devices", ["cpu", "h100"])
def test_reference_kernel_backend_runs_anywhere(devices):
  chosen = jax.devices()[:8] if devices == "cpu" else deviceless.gpu_devices(8)
  ctx = _ctx(chosen, impl="pallas", kernel_backend="reference")
  assert parallel.fused_kernel_backend(ctx, "op", unsupported="dtype float32") == "reference"
