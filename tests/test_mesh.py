"""Mesh construction: axis names and sizes, -1 filling, device order, multi-host placement."""

import dataclasses

import numpy as np
import pytest

from meshmoe.config import ConfigError, MeshConfig
from meshmoe.sharding.mesh import device_grid, make_mesh


def test_axes_and_fill():
  mesh = make_mesh(MeshConfig(data=-1, expert=2, tensor=2))
  assert mesh.axis_names == ("data", "expert", "tensor", "sequence")
  assert dict(mesh.shape) == {"data": 2, "expert": 2, "tensor": 2, "sequence": 1}
  assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_tensor_innermost_then_sequence_then_expert():
  mesh = make_mesh(MeshConfig(data=1, expert=2, tensor=2, sequence=2))
  ids = np.vectorize(lambda d: d.id)(mesh.devices)[0]  # [expert, tensor, sequence]
  assert ids[0, 1, 0] - ids[0, 0, 0] == 1  # tensor neighbours are adjacent devices
  assert ids[0, 0, 1] - ids[0, 0, 0] == 2  # then sequence
  assert ids[1, 0, 0] - ids[0, 0, 0] == 4  # then expert


def test_bad_mesh_is_a_config_error():
  with pytest.raises(ConfigError) as err:
    make_mesh(MeshConfig(data=3, expert=1))
  assert err.value.field == "mesh"


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  id: int
  process_index: int


def test_inner_axes_stay_inside_a_host():
  # Two hosts of 4 devices, listed interleaved as a runtime might return them.
  devices = [FakeDevice(id=i, process_index=i % 2) for i in range(8)]
  grid = device_grid({"data": 2, "expert": 1, "tensor": 2, "sequence": 2}, devices)
  for data_index in range(2):
    hosts = {d.process_index for d in grid[data_index].flat}
    assert hosts == {data_index}, "tensor x sequence group spans hosts"
