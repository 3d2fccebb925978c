"""What the kernel tests share: rings of simulated CPU devices, the race detector's verdict, deviceless
H100 meshes, and the tolerances of 16-bit kernels.

Every communicating kernel is checked three ways (ARCHITECTURE.md, "Kernels"): its TPU-style twin in Pallas' TPU
interpreter on 4 and 8 CPU devices (`dma_execution_mode="on_wait"`, race detector on) against the
reference; its Mosaic GPU kernel compiled for 8 H100s without a GPU; and that kernel's compute path (a
ring of one device, which never signals) in the Mosaic GPU interpreter against the reference.
"""

from __future__ import annotations

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call  # the race detector's global verdict
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.model_steps import gpu_mesh

# A 16-bit result rounds the float32 sum once: one bfloat16 unit in the last place of the largest entry.
BF16_RTOL = 2.0**-7
GPU_INTERPRET = plgpu.InterpretGPUParams()
# (mesh shape over ("a", "b"), the ring's axes): rings of 4 and 8 devices, one over two mesh axes (its
# positions run over both), and one of 4 where the other axis holds independent rings.
RINGS = [((4, 1), ("a",)), ((2, 2), ("a", "b")), ((8, 1), ("a",)), ((2, 4), ("a", "b")), ((4, 2), ("a",))]
RING_IDS = ["4", "2x2", "8", "2x4", "4-of-4x2"]


def cpu_mesh(shape) -> Mesh:
  return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), ("a", "b"))


def ring_size(mesh: Mesh, axes) -> int:
  return int(np.prod([mesh.shape[a] for a in axes]))


def per_device(fn, mesh: Mesh, in_specs, out_specs, check_vma: bool = False):
  """fn under jit(shard_map). The Pallas interpreters evaluate a kernel's body with plain primitives, which
  trip shard_map's varying-axis checks (an axis index added to a constant), so tests turn them off;
  compiled kernels (deviceless) are checked with them on."""
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma))


def races_found() -> bool:
  """Whether the TPU interpreter's race detector flagged the kernel it ran last."""
  return bool(interpret_pallas_call.races is not None and interpret_pallas_call.races.races_found)


def h100_mesh(n: int = 8) -> Mesh:
  return gpu_mesh((n,), ("x",))


def abstract(mesh: Mesh, shape, dtype, spec) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def one_device_ring() -> Mesh:
  """A mesh of one CPU device, for a kernel's compute path in the Mosaic GPU interpreter."""
  return Mesh(np.array(jax.devices()[:1]), ("x",))


SPEC_ALL = P(("a", "b"))
