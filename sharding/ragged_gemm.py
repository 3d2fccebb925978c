"""The grouped GEMM as the MoE paths call it: y = x @ w[group of the row], rows sorted by group.

`ragged_matmul(x, w, sizes, kernels)` runs the forward with `kernels.forward` and, in the backward pass,
the input gradient with `kernels.input_gradient` and the weight gradient (dw[g] = x_g^T dy_g, a ragged
contraction) with `kernels.weight_gradient`: three candidates of sharding/grouped_gemm_kernels.py, each
chosen from measurements (sharding/gpu_kernel_table.py). Its own VJP, for two reasons:
- each form's fastest correct kernel differs by form and GPU (tokamax's Hopper weight gradient is wrong
  at every measured shape; JAX's is the fastest there), so no one library's VJP is the one to run;
- inside `jax.shard_map` with checked replication, a Pallas kernel's result carries no varying mesh axes.
  Here each result varies like its operands, and each gradient is typed like its primal, summed over the
  axes where only its operands vary, as autodiff sums it (sharding/parallel.py).

Rows outside every group: the kernels write nothing there (forward and input gradient); callers mask them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from meshmoe.sharding import parallel
from meshmoe.sharding.grouped_gemm_kernels import GemmKernels


def ragged_matmul(x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array, kernels: GemmKernels) -> jax.Array:
  """y_MN: rows [sum(sizes[:g]), sum(sizes[:g+1])) of x times w[g]; rows past sum(sizes) undefined."""
  return _ragged_matmul(x_MK, w_GKN, sizes_G.astype(jnp.int32), kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_matmul(x_MK, w_GKN, sizes_G, kernels: GemmKernels):
  y_MN = kernels.forward.fn(kernels.num_sms)(x_MK, w_GKN, sizes_G)
  # Varying like its operands: typed invariant, it would be broadcast where it meets varying values and
  # its cotangent all-reduced over the mesh in the backward pass (the whole [M, N] buffer).
  return parallel.vary_over(y_MN, tuple(sorted(set(parallel.varying_axes(x_MK) + parallel.varying_axes(w_GKN)))))


def _forward(x_MK, w_GKN, sizes_G, kernels: GemmKernels):
  return _ragged_matmul(x_MK, w_GKN, sizes_G, kernels), (x_MK, w_GKN, sizes_G)


def _backward(kernels: GemmKernels, saved, dy_MN):
  x_MK, w_GKN, sizes_G = saved
  dy_MN = dy_MN.astype(x_MK.dtype)
  dx_MK = kernels.input_gradient.fn(kernels.num_sms)(dy_MN, w_GKN, sizes_G)
  dw_GKN = kernels.weight_gradient.fn(kernels.num_sms)(x_MK, dy_MN, sizes_G).astype(w_GKN.dtype)
  return (parallel.typed_like(dx_MK.astype(x_MK.dtype), x_MK, (dy_MN, w_GKN)),
          parallel.typed_like(dw_GKN, w_GKN, (x_MK, dy_MN)), None)


_ragged_matmul.defvjp(_forward, _backward)
