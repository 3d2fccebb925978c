"""all-gather + GEMM: the public function, which picks the implementation.

  out_PMN = allgather_matmul(x_MK, w_KN, axes, backend=...)   # inside jax.shard_map over `axes`

out_PMN[j] = (device j's x_MK) @ w_KN for every device j of the ring (reference.py). Backends:
"collectives" (all_gather then einsum, plain autodiff), "tpu_interpret" (the twin: protocol.py in Pallas' TPU
interpreter, CPU devices) and "mosaic_gpu" (the Hopper kernel; `unsupported` says which shapes it takes).
The fused backends share one custom gradient (flux_backends.py): dx is the GEMM + reduce-scatter kernel
of dout_PMN with w_KN transposed, dw the local product of the gathered blocks (saved by the forward
kernel) with dout_PMN. `meshmoe.sharding.tensor_parallel` calls this for `parallel.impl="pallas"` and falls
back to its `xla` tier where the Mosaic GPU kernel does not apply.

Legend: P ring positions, M rows per device, K contraction, N output columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshmoe.pallas_kernels import flux_backends, mosaic_tiles, ring
from meshmoe.pallas_kernels.allgather_matmul import mosaic_gpu, reference
from meshmoe.pallas_kernels.matmul_reducescatter import mosaic_gpu as scatter_mosaic
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.options import Options


def allgather_matmul(x_MK: jax.Array, w_KN: jax.Array, axes, *, backend: str,
                     tiles: Tiles = mosaic_tiles.DEFAULT_TILES, num_sms: int | None = None) -> jax.Array:
  ring.check_backend(backend)
  axes = ring.normalize_axes(axes)
  if backend == "collectives":
    return reference.allgather_matmul(x_MK, w_KN, axes)
  return _fused(Options.of(backend, tiles, num_sms), axes, x_MK, w_KN)


def unsupported(m: int, k: int, n: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why the Mosaic GPU kernels cannot take these shapes, forward or backward (None when they can)."""
  return mosaic_gpu.unsupported(m, k, n, dtype, tiles) or scatter_mosaic.unsupported(m, n, k, dtype, tiles)


def bytes_moved(p: int, m: int, k: int, itemsize: int) -> int:
  """Bytes one device sends (and receives) in one call: every block but its own passes it once."""
  return (p - 1) * m * k * itemsize


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(options: Options, axes, x_MK, w_KN):
  return _forward(options, axes, x_MK, w_KN)[0]


def _forward(options, axes, x_MK, w_KN):
  out_PMN, x_PMK = flux_backends.allgather_matmul(options, axes)(x_MK, w_KN)
  return out_PMN, (x_PMK, w_KN)


def _backward(options, axes, residuals, dout_PMN):
  x_PMK, w_KN = residuals
  dx_MK = flux_backends.matmul_reducescatter(options, axes)(dout_PMN.astype(x_PMK.dtype), w_KN.T)
  dw_KN = jnp.einsum("pmk,pmn->kn", x_PMK, dout_PMN, preferred_element_type=jnp.float32)
  return dx_MK.astype(x_PMK.dtype), dw_KN.astype(w_KN.dtype)


_fused.defvjp(_forward, _backward)
