"""The two Flux kernels (all-gather + GEMM, GEMM + reduce-scatter) of one backend, as a pair.

Each is the other's backward: the input gradient of an all-gather GEMM is a GEMM + reduce-scatter of
the output gradient, and the input gradient of a GEMM + reduce-scatter is an all-gather GEMM of the output
gradient (whose gathered blocks also give the weight gradient). The two api.py files define their custom
gradients with this pair, so a backend's forward and backward run the same fused protocols.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from meshmoe.pallas_kernels.allgather_matmul import mosaic_gpu as allgather_mosaic, tpu as allgather_tpu
from meshmoe.pallas_kernels.matmul_reducescatter import mosaic_gpu as scatter_mosaic, tpu as scatter_tpu
from meshmoe.pallas_kernels.options import Options
from meshmoe.pallas_kernels.ring import Axes


def allgather_matmul(options: Options, axes: Axes) -> Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]:
  """(x_MK, w_KN) -> (out_PMN, x_PMK) on `options.backend`."""
  if options.backend == "tpu_interpret":
    return functools.partial(allgather_tpu.allgather_matmul, axes=axes, num_blocks=options.num_blocks,
                             tiles=options.tiles)
  return functools.partial(allgather_mosaic.allgather_matmul, axes=axes, tiles=options.tiles,
                           num_blocks=options.num_blocks)


def matmul_reducescatter(options: Options, axes: Axes) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """(y_PMK, w_KN) -> out_MN on `options.backend`."""
  if options.backend == "tpu_interpret":
    return functools.partial(scatter_tpu.matmul_reducescatter, axes=axes, num_blocks=options.num_blocks,
                             tiles=options.tiles)
  return functools.partial(scatter_mosaic.matmul_reducescatter, axes=axes, tiles=options.tiles,
                           num_blocks=options.num_blocks)
