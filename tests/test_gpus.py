"""The GPU kinds (meshmoe.analysis.gpus): each one's figures load, its memory is its XLA spec's, and its XLA spec
(src/analysis/gpu_specs/<target>.txtpb) compiles a sharded program deviceless, on one host and on two; the
AOT report, the deviceless targets and the MFU table read the same figures.
"""

import re
import tomllib

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshmoe.analysis import aot, deviceless, gpus
from meshmoe.training import metrics
from tests.model_steps import gpu_mesh

FIGURES = ("dense_bf16_flops", "memory_bytes", "memory_bandwidth", "nvlink_bandwidth", "network_bandwidth",
           "gpus_per_node")
FIELDS = {"target", "description", "dense_bf16_flops", "nvlink_bandwidth", "network_bandwidth", "gpus_per_node"}


def _spec_int(text: str, field: str) -> int:
  """A field of the text proto, not of its `#` comments."""
  return int(re.search(rf"^ *{field}: (\d+)$", text, re.MULTILINE)[1])


@pytest.mark.parametrize("name", gpus.GPUS)
def test_every_gpu_loads_with_positive_figures_and_its_xla_specs_memory(name):
  spec = gpus.gpu(name)
  assert spec.name == name and spec.description
  for field in FIGURES:
    assert getattr(spec, field) > 0, (name, field)
  text = deviceless.gpu_spec(spec.target)
  assert spec.memory_bytes == _spec_int(text, "device_memory_size")
  assert spec.memory_bandwidth == _spec_int(text, "memory_bandwidth")
  if "model_str" in text:  # XLA's summary line repeats the memory size: the edited specs keep it in step
    assert f" with {int(spec.memory_bytes)}B RAM" in text
  # Within a node NVLink is faster than the network across nodes, and HBM faster than both.
  assert spec.memory_bandwidth > spec.nvlink_bandwidth > spec.network_bandwidth


def test_the_table_has_every_field_and_no_other():
  """A misspelt key in hardware.toml would be ignored, its figure missing: each table has exactly these."""
  from importlib.resources import files

  tables = tomllib.loads(files("meshmoe.analysis.gpu_specs").joinpath("hardware.toml").read_text())
  assert tuple(tables) == gpus.GPUS and gpus.GPUS[:3] == ("h100", "h200", "a100")
  assert all(set(table) == FIELDS for table in tables.values()), tables


def test_an_unknown_gpu_names_the_known_ones():
  with pytest.raises(ValueError, match="unknown GPU 'v100'; known: h100, h200, a100"):
    gpus.gpu("v100")


def test_the_deviceless_targets_the_aot_report_and_the_mfu_table_read_the_same_figures():
  assert deviceless.TARGETS == tuple(gpus.gpu(name).target for name in gpus.GPUS)
  assert aot.TARGETS == {**{name: gpus.gpu(name).target for name in gpus.GPUS}, "cpu": None}
  assert aot.device_memory_bytes("h200") == gpus.gpu("h200").memory_bytes and aot.device_memory_bytes("cpu") is None
  assert metrics.peak_flops_per_device("NVIDIA H200", "gpu") == gpus.gpu("h200").dense_bf16_flops
  assert metrics.peak_flops_per_device("NVIDIA H100 80GB HBM3", "gpu") == 989e12  # as before the table moved
  assert metrics.peak_flops_per_device("NVIDIA H100 PCIe", "gpu") == 756e12  # the PCIe/NVL rows stay metrics'


@pytest.mark.parametrize("num_devices, num_hosts", [(8, 1), (16, 2)])
@pytest.mark.parametrize("name", gpus.GPUS)
def test_each_spec_compiles_a_sharded_matmul_deviceless(name, num_devices, num_hosts):
  spec = gpus.gpu(name)
  mesh = gpu_mesh((num_devices // 2, 2), ("data", "model"), spec.target, num_hosts)
  device = mesh.devices.flat[0]
  assert {d.process_index for d in mesh.devices.flat} == set(range(num_hosts))
  assert f'device_description_str: "{device.device_kind}"' in deviceless.gpu_spec(spec.target)
  # The device kind a real GPU of this kind reports gets this kind's peak in the MFU table.
  assert metrics.peak_flops_per_device(device.device_kind, "gpu") == spec.dense_bf16_flops

  x = jax.ShapeDtypeStruct((num_devices * 16, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("data", "model")))
  w = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("model", None)))
  step = jax.jit(lambda x, w: jnp.tanh(x @ w), out_shardings=NamedSharding(mesh, P("data", None)))
  with deviceless.targeting(mesh):
    lowered = step.lower(x, w)
  compiled = deviceless.compile_for_analysis(lowered)
  # The contraction is split over "model": the partial products are summed across it.
  assert re.search(r"all-reduce|reduce-scatter", compiled.as_text())
  memory = compiled.memory_analysis()
  assert 0 < memory.argument_size_in_bytes < spec.memory_bytes
