"""tokamax's grouped GEMM as the MoE paths call it: y = x @ w[group of the row], rows sorted by group.

`ragged_matmul(x, w, sizes, kernels)` runs `tokamax.ragged_dot` forward and in the backward pass the
input gradient (a ragged_dot against the transposed weights) and the weight gradient (a ragged_dot whose
contraction is ragged: dw[g] = x_g^T dy_g), each with the implementation `kernels` names. Its own VJP,
rather than tokamax's, for two reasons:
- inside `jax.shard_map` with checked replication, a Mosaic GPU kernel's result carries no varying mesh
  axes, and tokamax's backward returns it as the cotangent of an input that varies: JAX rejects that
  ("the manual axis types do not match"), and worse, an invariant weight's gradient from varying rows
  would not be summed over the devices. Here each result varies like its operands, and each gradient is
  typed like its primal, summed over the axes where only its operands vary, as autodiff sums it;
- tokamax's Mosaic GPU kernels compute the ragged contraction on Hopper only (sm90); on Ampere (sm80) and
  Blackwell (sm100) its Triton kernel does (needs `jax-triton`), which `kernels` can name for the weight
  gradient alone.

Rows outside every group: the kernels write nothing there (forward and input gradient); callers mask them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging

import jax
import jax.numpy as jnp
import tokamax

from meshmoe.sharding import parallel

class _FirstAutotuningMiss(logging.Filter):
  """Lets tokamax's "Autotuning cache miss" warning through once per process: it is logged for every
  kernel traced at a shape its tuned table lacks (hundreds per train step), and means only that the
  kernel runs its heuristic tile configuration."""

  def __init__(self):
    super().__init__()
    self.seen = False

  def filter(self, record: logging.LogRecord) -> bool:
    if not str(record.msg).startswith("Autotuning cache miss"):
      return True
    first, self.seen = not self.seen, True
    return first


logging.getLogger("absl").addFilter(_FirstAutotuningMiss())

# dw[g] = x_g^T @ dy_g: both operands' rows are ragged and contracted; the result has a group dimension.
_WEIGHT_GRADIENT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


@dataclasses.dataclass(frozen=True)
class Kernels:
  """tokamax implementations: `rows` for the forward and input-gradient GEMMs (ragged rows), `contraction`
  for the weight gradient (ragged contraction)."""

  rows: str
  contraction: str

  def describe(self) -> str:
    return self.rows if self.rows == self.contraction else f"{self.rows}, weight gradient {self.contraction}"


def kernels_for(platform: str, compute_capability: str) -> tuple[Kernels | None, str]:
  """(the implementations for these devices, "") or (None, why tokamax's grouped GEMM cannot run here)."""
  if platform != "gpu":
    return Kernels("xla", "xla"), ""  # tokamax's XLA version: dense, exact; checks the path off GPUs
  major = compute_capability.split(".")[0]
  if major == "9":
    return Kernels("mosaic", "mosaic"), ""
  if major in ("8", "10"):
    if importlib.util.find_spec("jax_triton") is None:
      return None, (f"tokamax's weight-gradient kernel for compute capability {compute_capability} is its "
                    "Triton kernel, which needs jax-triton (pip install -e '.[cuda12]')")
    return Kernels("mosaic", "triton"), ""
  return None, f"tokamax has no grouped GEMM kernels for compute capability {compute_capability or 'unknown'}"


def ragged_matmul(x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array, kernels: Kernels) -> jax.Array:
  """y_MN: rows [sum(sizes[:g]), sum(sizes[:g+1])) of x times w[g]; rows past sum(sizes) undefined."""
  return _ragged_matmul(x_MK, w_GKN, sizes_G.astype(jnp.int32), kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_matmul(x_MK, w_GKN, sizes_G, kernels: Kernels):
  y_MN = tokamax.ragged_dot(x_MK, w_GKN, sizes_G, implementation=kernels.rows)
  # Varying like its operands: typed invariant, it would be broadcast where it meets varying values and
  # its cotangent all-reduced over the mesh in the backward pass (the whole [M, N] buffer).
  return parallel.vary_over(y_MN, tuple(sorted(set(parallel.varying_axes(x_MK) + parallel.varying_axes(w_GKN)))))


def _forward(x_MK, w_GKN, sizes_G, kernels: Kernels):
  return _ragged_matmul(x_MK, w_GKN, sizes_G, kernels), (x_MK, w_GKN, sizes_G)


def _backward(kernels: Kernels, saved, dy_MN):
  x_MK, w_GKN, sizes_G = saved
  dx_MK = tokamax.ragged_dot(dy_MN, jnp.swapaxes(w_GKN, 1, 2), sizes_G, preferred_element_type=x_MK.dtype,
                             implementation=kernels.rows)
  dw_GKN = tokamax.ragged_dot_general(x_MK, dy_MN, sizes_G, _WEIGHT_GRADIENT, preferred_element_type=w_GKN.dtype,
                                      implementation=kernels.contraction)
  return (parallel.typed_like(dx_MK, x_MK, (dy_MN, w_GKN)), parallel.typed_like(dw_GKN, w_GKN, (x_MK, dy_MN)),
          None)


_ragged_matmul.defvjp(_forward, _backward)
