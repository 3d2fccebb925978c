"""Building the 4-axis device mesh (`data`, `expert`, `tensor`, `sequence`).

Device order: the axes that talk most sit closest. `tensor` (a collective in every layer) is innermost,
then `sequence`, then `expert`, then `data`. Devices are sorted by (process, id), so with several
processes the inner axes stay inside one host whenever their product divides the devices per host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
from jax.sharding import AxisType, Mesh

from meshmoe.config import MESH_AXES, MeshConfig, resolve_mesh_sizes

# Device-array order, outermost first; the mesh itself keeps the MESH_AXES order of names.
_PLACEMENT_ORDER = ("data", "expert", "sequence", "tensor")


def make_mesh(mesh_config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A Mesh with axes MESH_AXES sized by `mesh_config` (-1 filled) over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_mesh_sizes(mesh_config, len(devices))
  _warn_if_inner_axes_cross_hosts(sizes, devices)
  return Mesh(device_grid(sizes, devices), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def device_grid(sizes: dict[str, int], devices: Sequence[jax.Device]) -> np.ndarray:
  """Devices arranged [data, expert, tensor, sequence], `tensor` varying fastest, hosts outermost."""
  ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
  placed = np.array(ordered, dtype=object).reshape([sizes[a] for a in _PLACEMENT_ORDER])
  return placed.transpose([_PLACEMENT_ORDER.index(a) for a in MESH_AXES])


def _warn_if_inner_axes_cross_hosts(sizes: dict[str, int], devices: list[jax.Device]) -> None:
  per_host = len(devices) // len({d.process_index for d in devices})
  inner = math.prod(sizes[a] for a in ("tensor", "sequence", "expert"))
  if per_host % inner and inner % per_host:
    logging.warning(
        "mesh axes tensor x sequence x expert = %d do not tile the %d devices of one host; some inner-axis "
        "collectives will cross hosts", inner, per_host)
