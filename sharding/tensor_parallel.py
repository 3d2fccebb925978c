"""Megatron tensor parallelism with sequence-parallel residuals: column- then row-parallel matmuls.

A block (attention, dense MLP, shared experts) is `project_in` -> per-device work -> `project_out`:

    residual x [B, S/(sp*tp), D]  --all-gather S over tp-->  [B, S/sp, D]
        @ column-parallel weights [D, X/tp]  ->  [B, S/sp, X/tp]       (project_in)
        ... heads or MLP units are independent, so no communication ...
        @ row-parallel weight [X/tp, D]  ->  partial sums [B, S/sp, D]
    --reduce-scatter S over tp-->  residual [B, S/(sp*tp), D]          (project_out)

"tp axes" are the mesh axes the rules split the weights' output units over (`heads`, `kv_heads`, `mlp`);
the residual stream's sequence is split over those too in `tp_sp` (norms and residual adds then run on a
1/tp share of the tokens, Megatron's sequence parallelism). Where the residual is not split over the tp
axes (`megascale` splits heads over `tensor` but the sequence over `expert` and `sequence`), the gather is
skipped and the reduce-scatter becomes a psum. With no tp axes both ops are local matmuls.

Bytes per device and call (reference tier): project_in all-gathers (tp-1)/tp of the gathered activation;
project_out reduce-scatters (tp-1)/tp of the [B, S/sp, D] partial sums; the backward pass swaps the two.

Tiers (`ParallelConfig.impl`, DESIGN.md):
- `reference`: the all_gather / psum_scatter collectives above around local matmuls.
- `xla`: where the sequence is gathered (project_in) or scattered (project_out) over tp axes, the
  collective and the matmul become one ring of ppermute steps (sharding/collective_matmul.py): each
  block's matmul runs while the next block (or accumulator) travels, forward and backward, with the same
  bytes per device as the reference. Where there is nothing to gather or scatter (no tp axes, or the
  psum-only layouts such as megascale's heads over `tensor`) there is no collective to split and the
  `xla` tier is the reference computation.
- `pallas`: the same gathers and scatters as one fused kernel each on Hopper GPUs
  (meshmoe.pallas_kernels: all-gather + GEMM for project_in, with q, k and v as one GEMM over their
  concatenated weights; GEMM + reduce-scatter for project_out; each the other's backward). The kernels
  take 2-D row blocks, so a [B, S, D] block is B*S rows and the gathered [P, B*S, N] result is reordered
  to [B, P*S, N] (a copy when B > 1). Elsewhere, or for shapes the kernels do not tile, the `xla` tier.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from meshmoe.pallas_kernels.allgather_matmul import api as allgather_kernel
from meshmoe.pallas_kernels.matmul_reducescatter import api as scatter_kernel
from meshmoe.sharding import collective_matmul, parallel
from meshmoe.sharding.shardings import current

_RESIDUAL = ("act_batch", "act_seq", None)


def project_in(x_BSD: jax.Array, weights: Sequence[jax.Array],
               logical: Sequence[Sequence[str | None]]) -> list[jax.Array]:
  """[x @ w for w in weights]: each w is [D, ...] with logical names `logical[i]` (first one `embed`);
  results are [B, S, ...] in x's dtype, split over the tp axes like the weights' output dimensions."""
  weights = [w.astype(x_BSD.dtype) for w in weights]
  ctx = current()
  if ctx is None:
    return [_matmul_in(x_BSD, w) for w in weights]
  x_spec = parallel.activation_spec(ctx, _RESIDUAL)
  w_specs = [parallel.weight_spec(ctx, names) for names in logical]
  tp_axes = tuple(dict.fromkeys(a for spec in w_specs for a in parallel.all_axes(spec)))
  seq_axes = parallel.dim_axes(x_spec, 1)
  gather = parallel.split_suffix(seq_axes, tp_axes, "tensor-parallel all-gather of the sequence")
  batch_axes = parallel.dim_axes(x_spec, 0)
  out_specs = [parallel.spec_of(batch_axes, parallel.without(seq_axes, gather),
                                *(parallel.dim_axes(spec, i) for i in range(1, len(names))))
               for spec, names in zip(w_specs, logical)]

  replicated = parallel.without(tp_axes, gather)
  ring = bool(gather) and ctx.parallel.impl in ("xla", "pallas")
  # The ring's custom gradient needs x and the weights to vary over the same mesh axes.
  ring_axes = tuple(dict.fromkeys(parallel.all_axes(x_spec) + tp_axes))

  def body(x_BSD, *weights):
    if ring:
      x_BSD = _vary(x_BSD, ring_axes, parallel.all_axes(x_spec))
      weights = [_vary(w, ring_axes, parallel.all_axes(spec)) for w, spec in zip(weights, w_specs)]
      b, s, d = x_BSD.shape  # one device's block; the weights' output widths are its shares too
      width = sum(math.prod(w.shape[1:]) for w in weights)
      kernel = parallel.fused_kernel_backend(ctx, "project_in (all-gather GEMM)",
                                             allgather_kernel.unsupported(b * s, d, width, x_BSD.dtype))
      if kernel:
        return _fused_allgather_matmul(x_BSD, weights, gather, kernel, parallel.num_sms(ctx))
      return list(collective_matmul.allgather_matmul(x_BSD, weights, gather))
    if gather:
      x_BSD = jax.lax.all_gather(x_BSD, gather, axis=1, tiled=True)
    if replicated:
      # x is the same on every tp device here. Marking it as differing once, before the matmuls, makes
      # the backward sum the matmuls' input gradients locally and then psum once, not once per weight.
      x_BSD = jax.lax.pcast(x_BSD, replicated, to="varying")
    return [_matmul_in(x_BSD, w) for w in weights]

  return parallel.shard_map(ctx, body, (x_spec, *w_specs), out_specs)(x_BSD, *weights)


def project_out(y: jax.Array, w: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """y [B, S, ...] @ w [..., D] (logical names `logical`, last one `embed`) -> [B, S, D] in y's dtype,
  placed like the residual stream."""
  w = w.astype(y.dtype)
  ctx = current()
  if ctx is None:
    return _matmul_out(y, w)
  res_spec = parallel.activation_spec(ctx, _RESIDUAL)
  w_spec = parallel.weight_spec(ctx, logical)
  tp_axes = parallel.all_axes(w_spec)
  seq_axes = parallel.dim_axes(res_spec, 1)
  scatter = parallel.split_suffix(seq_axes, tp_axes, "tensor-parallel reduce-scatter of the sequence")
  reduce = parallel.without(tp_axes, scatter)
  y_spec = parallel.spec_of(parallel.dim_axes(res_spec, 0), parallel.without(seq_axes, scatter),
                            *(parallel.dim_axes(w_spec, i) for i in range(len(logical) - 1)))

  ring = bool(scatter) and ctx.parallel.impl in ("xla", "pallas")
  ring_axes = tuple(dict.fromkeys(parallel.all_axes(y_spec) + tp_axes))

  def body(y, w):
    if ring:
      y, w = _vary(y, ring_axes, parallel.all_axes(y_spec)), _vary(w, ring_axes, tp_axes)
      rows = y.shape[0] * y.shape[1] // parallel.axis_size(ctx, scatter)  # of one destination block
      kernel = parallel.fused_kernel_backend(
          ctx, "project_out (GEMM reduce-scatter)",
          scatter_kernel.unsupported(rows, math.prod(w.shape[:-1]), w.shape[-1], y.dtype))
      if kernel:
        out_BSD = _fused_matmul_reducescatter(y, w, scatter, kernel, parallel.num_sms(ctx))
      else:
        out_BSD = collective_matmul.matmul_reducescatter(y, w, scatter)
      return jax.lax.psum(out_BSD, reduce) if reduce else out_BSD
    out_BSD = _matmul_out(y, w)
    if scatter:
      out_BSD = jax.lax.psum_scatter(out_BSD, scatter, scatter_dimension=1, tiled=True)
    if reduce:
      out_BSD = jax.lax.psum(out_BSD, reduce)
    return out_BSD

  return parallel.shard_map(ctx, body, (y_spec, w_spec), res_spec)(y, w)


def _vary(a: jax.Array, axes: parallel.Axes, varying: parallel.Axes) -> jax.Array:
  """`a` (varying over `varying`) marked as varying over all of `axes`. The backward pass sums its
  gradient over the added axes, as autodiff does where an invariant operand meets a varying one."""
  missing = parallel.without(axes, varying)
  return jax.lax.pcast(a, missing, to="varying") if missing else a


def _matmul_in(x_BSD: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.tensordot(x_BSD, w, axes=[[2], [0]])


def _matmul_out(y: jax.Array, w: jax.Array) -> jax.Array:
  contracted = w.ndim - 1
  return jnp.tensordot(y, w, axes=[list(range(y.ndim - contracted, y.ndim)), list(range(contracted))])



def _fused_allgather_matmul(x_BSD, weights, axes, backend: str, num_sms: int) -> list[jax.Array]:
  """[all_gather(x_BSD, axes, axis=1, tiled=True) @ w for w in weights] as one all-gather GEMM kernel over
  the weights side by side."""
  b, s, d = x_BSD.shape
  widths = [math.prod(w.shape[1:]) for w in weights]
  w_KN = jnp.concatenate([w.reshape(d, -1) for w in weights], axis=1)
  out_PMN = allgather_kernel.allgather_matmul(x_BSD.reshape(b * s, d), w_KN, axes, backend=backend,
                                              num_sms=num_sms)
  p = out_PMN.shape[0]
  out_BSN = out_PMN.reshape(p, b, s, -1).transpose(1, 0, 2, 3).reshape(b, p * s, -1)
  splits = jnp.split(out_BSN, list(itertools.accumulate(widths))[:-1], axis=2)
  return [part.reshape(b, p * s, *w.shape[1:]) for part, w in zip(splits, weights)]


def _fused_matmul_reducescatter(y, w, axes, backend: str, num_sms: int) -> jax.Array:
  """psum_scatter(y @ w, axes, scatter_dimension=1, tiled=True) as one GEMM reduce-scatter kernel: y
  [B, P*S, ...] becomes P destination blocks of B*S rows."""
  b, ps, d = y.shape[0], y.shape[1], w.shape[-1]
  p = math.prod(jax.lax.axis_size(a) for a in axes)
  s = ps // p
  y_PMK = y.reshape(b, p, s, -1).transpose(1, 0, 2, 3).reshape(p, b * s, -1)
  out_MN = scatter_kernel.matmul_reducescatter(y_PMK, w.reshape(-1, d), axes, backend=backend, num_sms=num_sms)
  return out_MN.reshape(b, s, d)
