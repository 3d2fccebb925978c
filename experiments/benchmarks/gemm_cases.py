"""The grouped-GEMM cases the GPU measurement (gpu_measure.py) and the GPU tests (tests/test_gpu_kernels.py,
tests/test_kernel_table.py) share: each shipped config's expert GEMM shape, group sizes (balanced or uneven
with an empty and a one-row group), the float32 padded reference and the per-group error. No flags here:
the tests import it beside the command-line modules, whose absl flags would collide."""

from __future__ import annotations

import dataclasses
import math

GEMM_TOLERANCE = 1e-2  # bf16 output rounding is ~2e-3 relative; a wrong tile or race is far above


@dataclasses.dataclass(frozen=True)
class GemmShape:
  """One device's grouped GEMM: `rows` assignment rows over `experts` local experts, K x N per expert."""

  experts: int
  rows: int
  d_model: int
  expert_width: int
  why: str

  @property
  def k(self) -> int:
    return self.d_model

  @property
  def n(self) -> int:
    return 2 * self.expert_width  # gate and up side by side, as sharding/grouped_ffn.py runs them


SHAPES = {
    "moe_1b": GemmShape(32, 32768, 1024, 512, "8192 tokens x top-4 on one GPU, all 32 experts"),
    "mixtral_8x7b": GemmShape(8, 16384, 4096, 14336, "8192 tokens x top-2, all 8 experts (expert width whole)"),
    "qwen3_30b_a3b": GemmShape(128, 65536, 2048, 768, "8192 tokens x top-8 on one GPU, all 128 experts"),
    "deepseek_v3": GemmShape(32, 32768, 7168, 2048, "4096 tokens x top-8 at 8-way expert parallelism: 32 of 256"),
}
DRY_RUN_SHAPES = {"tiny": GemmShape(4, 64, 32, 16, "dry run")}


def group_sizes(experts: int, rows: int, uneven: bool, seed: int = 0):
  """Balanced (rows / experts each) or uneven: group 0 empty, group 1 one row, the rest skewed."""
  import numpy as np

  if not uneven:
    sizes = np.full(experts, rows // experts, np.int64)
    sizes[: rows % experts] += 1
    return sizes
  rng = np.random.default_rng(seed)
  sizes = np.zeros(experts, np.int64)
  if experts >= 3:
    sizes[1] = 1
    sizes[2:] = rng.multinomial(rows - 1, rng.dirichlet(np.full(experts - 2, 0.5)))
  else:
    sizes[-1] = rows
  return sizes


def padded_reference(form: str, a, b, sizes):
  """The form's result in float32 (HIGHEST precision) from each group's rows gathered into a padded dense
  batch [G, R, .]: independent of every ragged kernel."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  g, widest = len(sizes), max(int(sizes.max()), 1)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  index = starts[:, None] + np.arange(widest)[None, :]
  valid = np.arange(widest)[None, :] < sizes[:, None]
  index = np.where(valid, index, 0)
  hi = jax.lax.Precision.HIGHEST

  @jax.jit
  def run(a, b):
    gather = lambda t: jnp.where(jnp.asarray(valid)[..., None], t.astype(jnp.float32)[jnp.asarray(index)], 0.0)
    if form == "weight_gradient":
      return jnp.einsum("grk,grn->gkn", gather(a), gather(b), precision=hi)
    w = b.astype(jnp.float32)
    out = jnp.einsum("grk,gkn->grn" if form == "forward" else "grn,gkn->grk", gather(a), w, precision=hi)
    filled = out.reshape(g * widest, -1)[jnp.asarray(np.flatnonzero(valid))]  # group by group, in row order
    return jnp.zeros((a.shape[0], out.shape[-1]), jnp.float32).at[jnp.asarray(index[valid])].set(filled)
  return run(a, b)


def per_group_error(form: str, out, ref, sizes) -> tuple[float, str]:
  """(worst relative Frobenius error over non-empty groups, what failed or "")."""
  import numpy as np

  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  if not np.all(np.isfinite(out)):
    return math.inf, "non-finite values"
  starts = np.concatenate([[0], np.cumsum(sizes)])
  worst = 0.0
  for gi, size in enumerate(sizes):
    o, r = (out[gi], ref[gi]) if form == "weight_gradient" else (out[starts[gi]:starts[gi + 1]],
                                                                   ref[starts[gi]:starts[gi + 1]])
    if size == 0:
      if form == "weight_gradient" and np.any(o != 0):
        return math.inf, f"group {gi} has no rows but a non-zero weight gradient"
      continue
    worst = max(worst, float(np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)))
  return worst, ""
