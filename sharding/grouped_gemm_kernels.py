"""The grouped GEMM's candidate implementations on GPUs, one function per form, as measured and as run.

An MoE layer's expert GEMMs take three forms (rows sorted by expert; `sizes_G` rows per group):
- "forward":          y_MN  = x_MK @ w_GKN[g]          for the rows of group g;
- "input_gradient":   dx_MK = dy_MN @ w_GKN[g]^T       (the weights as stored: implementations that read
                                                        them transposed do, the others get a transposed copy);
- "weight_gradient":  dw_GKN[g] = x_g^T @ dy_g         (a ragged contraction; a group without rows gets 0).

A `Candidate` is one implementation of one form with its tile configuration; `GemmKernels` is the three
the plan runs (sharding/gpu_kernel_table.py chooses them from measurements; sharding/ragged_gemm.py runs
them). The GPU measurement script (experiments/benchmarks/gpu_measure.py) checks and times every candidate.
Implementations:
- `tokamax_mosaic`: tokamax's Pallas Mosaic GPU kernels (Hopper and Blackwell);
- `tokamax_triton`: tokamax's Triton kernels (needs `jax-triton`; compute capability 8.0 and up), with
  tokamax's tile table or heuristics (never its autotuning), or the tiles given;
- `jax_mgpu`: JAX's own Hopper kernels (jax.experimental.pallas.ops.gpu: ragged_dot_mgpu for the row
  forms, transposed_ragged_dot_mgpu for the contraction), with the tiles given;
- `xla`: jax.lax.ragged_dot_general as XLA lowers it (on GPUs and CPUs: dense over every group; exact);
- `xla_cudnn`: the same with XLA's opt-in cuDNN ragged-dot fusion (row forms only; an XLA option, so it
  applies to the whole program that runs it);
- `meshmoe_mosaic`: meshmoe's grouped weight-gradient kernel (pallas_kernels/grouped_weight_gradient;
  Hopper; rows in any group sizes).
Rows outside every group (past sum(sizes)) are left undefined by every candidate; callers mask them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshmoe.config import GEMM_FORMS as FORMS
from meshmoe.config import GEMM_IMPLEMENTATIONS

_ROWS = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
                                          rhs_group_dimensions=[0])
_ROWS_TRANSPOSED = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                                     lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
_CONTRACTION = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                                 lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
_DIMS = {"forward": _ROWS, "input_gradient": _ROWS_TRANSPOSED, "weight_gradient": _CONTRACTION}

# XLA option of the cuDNN ragged-dot fusion (the `xla_cudnn` candidate).
CUDNN_RAGGED_DOT_OPTION = "xla_gpu_experimental_use_ragged_dot_fusion"
# Operand dtypes of the GPU kernels (tensor cores, float32 accumulation).
KERNEL_DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One implementation of one form. `tiles`: its tile configuration as (name, value) pairs, () for the
  implementation's own choice (tokamax: its tuned table, else its heuristics)."""

  implementation: str
  form: str
  tiles: tuple[tuple[str, int], ...] = ()

  def __post_init__(self):
    if self.implementation not in _IMPLEMENTATIONS:
      raise ValueError(f"unknown grouped GEMM implementation {self.implementation!r}; known: "
                       f"{', '.join(_IMPLEMENTATIONS)}")
    if self.form not in FORMS:
      raise ValueError(f"unknown grouped GEMM form {self.form!r}; known: {', '.join(FORMS)}")

  @property
  def name(self) -> str:
    tiles = "x".join(str(v) for _, v in self.tiles)
    return f"{self.implementation}[{tiles}]" if tiles else self.implementation

  @property
  def compiler_options(self) -> dict[str, bool]:
    """XLA options the program running this candidate must be compiled with."""
    return {CUDNN_RAGGED_DOT_OPTION: True} if self.implementation == "xla_cudnn" else {}

  def fn(self, num_sms: int = 0) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """(a, b, sizes_G) -> result, with (a, b) = (x, w) forward, (dy, w) input gradient, (x, dy) weight
    gradient; the weight gradient's result is [G, K, N] in b's dtype, the others [M, N] / [M, K] in a's.
    `num_sms`: the GPU's SMs, for kernels that launch one block per SM (0: read from the device)."""
    return functools.partial(_IMPLEMENTATIONS[self.implementation], form=self.form, tiles=dict(self.tiles),
                             num_sms=num_sms)

  def unsupported(self, compute_capability: str, dtype, k: int, n: int) -> str | None:
    """Why this candidate cannot run its form for operands of `dtype` on a GPU of `compute_capability`
    (e.g. "9.0"; "" off GPUs) with per-group weights of K x N (None when it can)."""
    major = int(compute_capability.split(".")[0]) if compute_capability else 0
    dtype = jnp.dtype(dtype)
    impl, tiles = self.implementation, dict(self.tiles)
    if impl == "xla":
      return None
    if impl == "xla_cudnn":
      return "XLA's cuDNN ragged-dot fusion has no weight gradient" if self.form == "weight_gradient" else (
          None if major else "the cuDNN fusion needs a GPU")
    if dtype not in KERNEL_DTYPES:
      return f"{impl} takes bfloat16/float16 operands, not {dtype.name}"
    if k * dtype.itemsize % 16 or n * dtype.itemsize % 16:
      return f"{impl} copies rows of whole 16-byte units: widths {k} and {n} in {dtype.name} are not"
    if impl == "tokamax_mosaic":
      if major < 9:
        return f"tokamax's Mosaic GPU kernels need Hopper or later, not sm{major}x"
      # Its operands are copied in 128-byte swizzled tiles: a width above one tile must fill whole tiles.
      swizzle = 128 // dtype.itemsize
      if wide := [w for w in (k, n) if w > swizzle and w % swizzle]:
        return f"tokamax's Mosaic GPU kernels tile a width above {swizzle} by {swizzle}: {wide[0]} is not a multiple"
      return None
    if impl == "tokamax_triton":
      if importlib.util.find_spec("jax_triton") is None:
        return "tokamax's Triton kernels need jax-triton (pip install -e '.[cuda12]')"
      return None if major >= 8 else f"tokamax's Triton kernels need compute capability 8.0 or later, not {major}.x"
    if major != 9:
      return f"{impl} is a Hopper (sm90) kernel"
    if impl == "jax_mgpu":
      # The contracted width in block_k steps; the output's columns (and, for the contraction, rows) in tiles.
      contracted, columns = {"forward": (k, n), "input_gradient": (n, k), "weight_gradient": (None, n)}[self.form]
      checks = [("block_n", columns)] + ([("block_k", contracted)] if contracted else [("block_m", k)])
      for tile, width in checks:
        if width % tiles[tile]:
          return f"JAX's kernel tiles a width of {width} by {tile}={tiles[tile]}"
      return None
    if impl == "meshmoe_mosaic":
      from meshmoe.pallas_kernels.grouped_weight_gradient import api as weight_gradient

      if self.form != "weight_gradient":
        return "meshmoe's Mosaic GPU grouped kernel here is the weight gradient only"
      return weight_gradient.unsupported(k, n, dtype)
    raise AssertionError(impl)


@dataclasses.dataclass(frozen=True)
class GemmKernels:
  """The three forms' candidates the plan runs, and where each choice came from (`sources`, one line per
  form: the measured row it came from, or the stated default)."""

  forward: Candidate
  input_gradient: Candidate
  weight_gradient: Candidate
  sources: tuple[str, str, str] = ("", "", "")
  num_sms: int = 0  # the GPU's SMs for kernels with one block per SM (0: read from the device)

  def __post_init__(self):
    for form in FORMS:
      if getattr(self, form).form != form:
        raise ValueError(f"GemmKernels.{form} is a {getattr(self, form).form} candidate")

  @classmethod
  def exact(cls, why: str = "") -> GemmKernels:
    """XLA's ragged dot for every form (dense, exact): what runs off GPUs, to check the path."""
    return cls(*(Candidate("xla", form) for form in FORMS), sources=(why,) * 3)

  def candidates(self) -> tuple[Candidate, Candidate, Candidate]:
    return self.forward, self.input_gradient, self.weight_gradient

  def describe(self) -> str:
    return ", ".join(f"{form} {c.name}" for form, c in zip(FORMS, self.candidates()))

  def compiler_options(self) -> dict[str, bool]:
    return {k: v for c in self.candidates() for k, v in c.compiler_options.items()}

  @property
  def row_multiple(self) -> int:
    """Rows the callers pad the row buffer to: meshmoe's kernel steps by block_k rows, the others 8."""
    if self.weight_gradient.implementation == "meshmoe_mosaic":
      from meshmoe.pallas_kernels import mosaic_tiles

      return mosaic_tiles.DEFAULT_TILES.block_k
    return 8


def _tokamax(kernel: str):
  def run(a, b, sizes_G, *, form: str, tiles: dict, num_sms: int):
    del num_sms
    import tokamax

    implementation = kernel
    if tiles and kernel == "triton":
      from tokamax._src.ops.ragged_dot import triton as tokamax_triton

      implementation = tokamax_triton.TritonRaggedDot(config=tokamax_triton.Config(**tiles))
    out_dtype = b.dtype if form == "weight_gradient" else a.dtype
    return tokamax.ragged_dot_general(a, b, sizes_G, _DIMS[form], preferred_element_type=out_dtype,
                                      implementation=(implementation,))
  return run


def _jax_mgpu(a, b, sizes_G, *, form: str, tiles: dict, num_sms: int):
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

  if form == "weight_gradient":
    with _sm_count_seen_by(transposed_ragged_dot_mgpu, num_sms):
      return transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b.astype(a.dtype), group_sizes=sizes_G, **tiles)
  return ragged_dot_mgpu.ragged_dot(a, b.astype(a.dtype), group_sizes=sizes_G, transpose_rhs=form == "input_gradient",
                                    **tiles)


@contextlib.contextmanager
def _sm_count_seen_by(module: types.ModuleType, num_sms: int):
  """JAX's transposed kernel launches `jax.devices()[0].core_count` blocks, read while it is traced. When
  compiling for GPUs this machine lacks (deviceless; src/analysis/deviceless.py) that device is a CPU
  without SMs: for the trace, the module sees a `jax` whose first device has `num_sms` SMs, or those of
  the default device (the target GPU, which `deviceless.targeting` makes the default)."""
  first = module.jax.devices()[0]
  if not num_sms and getattr(first, "core_count", None):
    yield
    return
  sms = num_sms or getattr(jax.config.jax_default_device, "core_count", None)
  if not sms:
    raise ValueError("JAX's grouped weight-gradient kernel needs the GPU's SM count, and none is known here: "
                     "trace it on a GPU or inside meshmoe.analysis.deviceless.targeting(mesh)")
  real_jax = module.jax
  module.jax = _JaxWithSMs(sms)
  try:
    yield
  finally:
    module.jax = real_jax


class _JaxWithSMs:
  """`jax` as a kernel module sees it, except that its first device has `sms` SMs."""

  def __init__(self, sms: int):
    self._device = types.SimpleNamespace(core_count=sms)

  def __getattr__(self, name):
    return getattr(jax, name)

  def devices(self, *_):
    return [self._device]


def _xla(a, b, sizes_G, *, form: str, tiles: dict, num_sms: int):
  del tiles, num_sms
  out_dtype = b.dtype if form == "weight_gradient" else a.dtype
  return jax.lax.ragged_dot_general(a, b.astype(a.dtype), sizes_G, _DIMS[form], preferred_element_type=out_dtype)


def _meshmoe_mosaic(a, b, sizes_G, *, form: str, tiles: dict, num_sms: int):
  from meshmoe.pallas_kernels.grouped_weight_gradient import api as weight_gradient

  del tiles
  if form != "weight_gradient":
    raise NotImplementedError("meshmoe's Mosaic GPU grouped kernel here is the weight gradient only")
  like = jnp.zeros((sizes_G.shape[0], a.shape[1], b.shape[1]), b.dtype)  # typing only: its values are not read
  return weight_gradient.weight_gradient(a, b, sizes_G, like, tile_rows=1, backend="mosaic_gpu",
                                         num_sms=num_sms or None)


_IMPLEMENTATIONS = {"tokamax_mosaic": _tokamax("mosaic"), "tokamax_triton": _tokamax("triton"),
                    "jax_mgpu": _jax_mgpu, "xla": _xla, "xla_cudnn": _xla, "meshmoe_mosaic": _meshmoe_mosaic}
IMPLEMENTATIONS = tuple(_IMPLEMENTATIONS)
assert IMPLEMENTATIONS == GEMM_IMPLEMENTATIONS, "meshmoe.config.GEMM_IMPLEMENTATIONS names these, in this order"
