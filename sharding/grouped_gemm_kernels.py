"""The grouped GEMM's candidate implementations on GPUs, one function per form, as measured and as run.

An MoE layer's expert GEMMs take three forms (rows sorted by expert; `sizes_G` rows per group):
- "forward":          y_MN  = x_MK @ w_GKN[g]          for the rows of group g;
- "input_gradient":   dx_MK = dy_MN @ w_GKN[g]^T       (the weights as stored, never transposed in memory
                                                        where the implementation reads them transposed);
- "weight_gradient":  dw_GKN[g] = x_g^T @ dy_g         (a ragged contraction; a group without rows gets 0).

Each `Candidate` names one implementation of one form with its tile configuration. The GPU measurement
script (experiments/benchmarks/gpu_measure.py) checks and times every candidate on the device; the plan
then runs, per form, the one a measured row chose. Candidates:
- `tokamax_mosaic`: tokamax's Pallas Mosaic GPU kernels (Hopper and Blackwell);
- `tokamax_triton`: tokamax's Triton kernels (needs `jax-triton`; any CUDA GPU of compute capability 8+),
  with tokamax's tile table or heuristics, or the tiles given;
- `jax_mgpu`: JAX's own Hopper kernels (jax.experimental.pallas.ops.gpu: ragged_dot_mgpu for the row
  forms, transposed_ragged_dot_mgpu for the contraction), with the tiles given;
- `xla`: jax.lax.ragged_dot_general as XLA lowers it (on GPUs: dense over every group);
- `xla_cudnn`: the same with XLA's opt-in cuDNN ragged-dot fusion (row forms only; an XLA flag, so it
  applies to the whole program that runs it);
- `meshmoe_mosaic`: meshmoe's grouped weight-gradient kernel (pallas_kernels/grouped_weight_gradient;
  Hopper; rows in any group sizes).
Rows outside every group (past sum(sizes)) are left undefined by every candidate; callers mask them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

FORMS = ("forward", "input_gradient", "weight_gradient")

_ROWS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
                                          rhs_group_dimensions=[0])
_ROWS_TRANSPOSED = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_CONTRACTION = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                 lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
_DIMS = {"forward": _ROWS, "input_gradient": _ROWS_TRANSPOSED, "weight_gradient": _CONTRACTION}

# XLA flag of the cuDNN ragged-dot fusion (the `xla_cudnn` candidate).
CUDNN_RAGGED_DOT_FLAG = "xla_gpu_experimental_use_ragged_dot_fusion"


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One implementation of one form. `tiles`: its tile configuration as (name, value) pairs, () for the
  implementation's own choice (tokamax: its tuned table, else its heuristics; never autotuning)."""

  implementation: str
  form: str
  tiles: tuple[tuple[str, int], ...] = ()

  @property
  def name(self) -> str:
    tiles = "x".join(str(v) for _, v in self.tiles)
    return f"{self.implementation}[{tiles}]" if tiles else self.implementation

  @property
  def compiler_options(self) -> dict[str, bool]:
    """XLA options the program running this candidate must be compiled with."""
    return {CUDNN_RAGGED_DOT_FLAG: True} if self.implementation == "xla_cudnn" else {}

  def fn(self) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """(a, b, sizes_G) -> result, with (a, b) = (x, w) forward, (dy, w) input gradient, (x, dy) weight
    gradient; the weight gradient's result is [G, K, N] in b's dtype, the others [M, N] / [M, K]."""
    return functools.partial(_IMPLEMENTATIONS[self.implementation], form=self.form, tiles=dict(self.tiles))


def _tokamax(kernel: str):
  def run(a, b, sizes_G, *, form: str, tiles: dict):
    import tokamax

    implementation = kernel
    if tiles and kernel == "triton":
      from tokamax._src.ops.ragged_dot import triton as tokamax_triton

      implementation = tokamax_triton.TritonRaggedDot(config=tokamax_triton.Config(**tiles))
    return tokamax.ragged_dot_general(a, b, sizes_G, _DIMS[form], preferred_element_type=a.dtype,
                                      implementation=(implementation,))
  return run


def _jax_mgpu(a, b, sizes_G, *, form: str, tiles: dict):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

  if form == "weight_gradient":
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=sizes_G, **tiles)
  return ragged_dot_mgpu.ragged_dot(a, b, group_sizes=sizes_G, transpose_rhs=form == "input_gradient", **tiles)


def _xla(a, b, sizes_G, *, form: str, tiles: dict):
  del tiles
  return jax.lax.ragged_dot_general(a, b, sizes_G, _DIMS[form], preferred_element_type=a.dtype)


def _meshmoe_mosaic(a, b, sizes_G, *, form: str, tiles: dict):
  from meshmoe.pallas_kernels.grouped_weight_gradient import api as weight_gradient

  if form != "weight_gradient":
    raise NotImplementedError("meshmoe's Mosaic GPU kernel here is the weight gradient only")
  like = jnp.zeros((sizes_G.shape[0], a.shape[1], b.shape[1]), b.dtype)  # typing only: its values are not read
  return weight_gradient.weight_gradient(a, b, sizes_G, like, tile_rows=1, backend="mosaic_gpu", **tiles)


_IMPLEMENTATIONS = {"tokamax_mosaic": _tokamax("mosaic"), "tokamax_triton": _tokamax("triton"),
                    "jax_mgpu": _jax_mgpu, "xla": _xla, "xla_cudnn": _xla, "meshmoe_mosaic": _meshmoe_mosaic}
IMPLEMENTATIONS = tuple(_IMPLEMENTATIONS)
