"""GEMM + reduce-scatter: the public function, which picks the implementation.

  out_MN = matmul_reducescatter(y_PMK, w_KN, axes, backend=...)   # inside jax.shard_map over `axes`

out_MN on device i = the sum over the ring of every device's y_PMK[i] @ w_KN (reference.py). Backends as
in allgather_matmul/api.py. The fused backends share one custom gradient (flux_backends.py): dy is the
all-gather GEMM kernel of dout_MN with w_KN transposed, and dw the local product of y_PMK with the
gathered dout blocks that kernel returns. `meshmoe.sharding.tensor_parallel` calls this for
`parallel.impl="pallas"` and falls back to its `xla` tier where the Mosaic GPU kernel does not apply.

Legend: P ring positions, M rows per device, K this device's share of the contraction, N output columns.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshmoe.pallas_kernels import flux_backends, mosaic_tiles, ring
from meshmoe.pallas_kernels.allgather_matmul import mosaic_gpu as allgather_mosaic
from meshmoe.pallas_kernels.matmul_reducescatter import mosaic_gpu, reference
from meshmoe.pallas_kernels.mosaic_tiles import Tiles
from meshmoe.pallas_kernels.options import Options


def matmul_reducescatter(y_PMK: jax.Array, w_KN: jax.Array, axes, *, backend: str,
                         tiles: Tiles = mosaic_tiles.DEFAULT_TILES,
                         num_sms: int | None = None) -> jax.Array:
  ring.check_backend(backend)
  axes = ring.normalize_axes(axes)
  if backend == "collectives":
    return reference.matmul_reducescatter(y_PMK, w_KN, axes)
  return _fused(Options.of(backend, tiles, num_sms), axes, y_PMK, w_KN)


def unsupported(m: int, k: int, n: int, dtype, tiles: Tiles = mosaic_tiles.DEFAULT_TILES) -> str | None:
  """Why the Mosaic GPU kernels cannot take these shapes, forward or backward (None when they can)."""
  return mosaic_gpu.unsupported(m, k, n, dtype, tiles) or allgather_mosaic.unsupported(m, n, k, dtype, tiles)


def bytes_moved(p: int, m: int, n: int, itemsize: int) -> int:
  """Bytes one device sends (and receives) in one call: P - 1 partial sums of one output block."""
  return (p - 1) * m * n * itemsize


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _fused(options: Options, axes, y_PMK, w_KN):
  return _forward(options, axes, y_PMK, w_KN)[0]


def _forward(options, axes, y_PMK, w_KN):
  return flux_backends.matmul_reducescatter(options, axes)(y_PMK, w_KN), (y_PMK, w_KN)


def _backward(options, axes, residuals, dout_MN):
  y_PMK, w_KN = residuals
  dy_PMK, dout_PMN = flux_backends.allgather_matmul(options, axes)(dout_MN.astype(y_PMK.dtype), w_KN.T)
  dw_KN = jnp.einsum("pmk,pmn->kn", y_PMK, dout_PMN, preferred_element_type=jnp.float32)
  return dy_PMK.astype(y_PMK.dtype), dw_KN.astype(w_KN.dtype)


_fused.defvjp(_forward, _backward)
