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
- the weight gradient (the ragged contraction) is not always tokamax's: on Hopper (sm90) tokamax's Mosaic
  GPU contraction returned wrong gradients on both GPUs it was run on (relative errors 0.22 and 0.25 at
  moe_1b's shapes, non-finite gradients in the FFN tests; README, "On Hopper the weight gradients are
  meshmoe's"), so there meshmoe's own grouped weight-gradient kernel runs it (`MESHMOE`:
  pallas_kernels/grouped_weight_gradient, ragged rows masked per step). On Ampere (sm80) and Blackwell
  (sm100) tokamax's Triton kernel does (needs `jax-triton`).

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

from meshmoe.pallas_kernels import mosaic_tiles
from meshmoe.pallas_kernels.grouped_weight_gradient import api as weight_gradient
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
  for the weight gradient (ragged contraction; or MESHMOE, meshmoe's own kernel, launched on `num_sms`
  SMs of the GPU, 0: read from the device)."""

  rows: str
  contraction: str
  num_sms: int = 0

  def describe(self) -> str:
    contraction = "meshmoe's grouped weight-gradient kernel" if self.contraction == MESHMOE else self.contraction
    return self.rows if self.rows == self.contraction else f"{self.rows}, weight gradient {contraction}"

  @property
  def row_multiple(self) -> int:
    """Rows the callers pad the row buffer to: tokamax tiles rows by 8, meshmoe's kernel steps by block_k."""
    return mosaic_tiles.DEFAULT_TILES.block_k if self.contraction == MESHMOE else 8


# `Kernels.contraction` naming meshmoe's grouped weight-gradient kernel (module docstring).
MESHMOE = "meshmoe"


def kernels_for(platform: str, compute_capability: str, num_sms: int = 0) -> tuple[Kernels | None, str]:
  """(the implementations for these devices, "") or (None, why tokamax's grouped GEMM cannot run here);
  `num_sms`: the GPU's, for meshmoe's weight-gradient kernel on Hopper (0: read from the device)."""
  if platform != "gpu":
    return Kernels("xla", "xla"), ""  # tokamax's XLA version: dense, exact; checks the path off GPUs
  major = compute_capability.split(".")[0]
  if major == "9":
    return Kernels("mosaic", MESHMOE, num_sms), ""
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
  if kernels.contraction == MESHMOE:  # rows of any group size: tile_rows=1 (its ragged steps)
    dw_GKN = weight_gradient.weight_gradient(x_MK, dy_MN, sizes_G, w_GKN, tile_rows=1, backend="mosaic_gpu",
                                             num_sms=kernels.num_sms or None)
  else:
    dw_GKN = tokamax.ragged_dot_general(x_MK, dy_MN, sizes_G, _WEIGHT_GRADIENT, preferred_element_type=w_GKN.dtype,
                                        implementation=kernels.contraction)
  return (parallel.typed_like(dx_MK, x_MK, (dy_MN, w_GKN)), parallel.typed_like(dw_GKN, w_GKN, (x_MK, dy_MN)),
          None)


_ragged_matmul.defvjp(_forward, _backward)
