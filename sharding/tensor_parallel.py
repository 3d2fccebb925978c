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

Implementations (the plan picks one per call: sharding/plan.py; the tiers in ARCHITECTURE.md):
- `local`: nothing to gather or scatter (no tp axes, or the psum-only layouts such as megascale's heads
  over `tensor`): local matmuls, partial sums psum-ed over the tp axes that do not split the tokens.
- `collectives`: the all_gather / psum_scatter collectives above around local matmuls (reference tier).
- `ring`: the collective and the matmul as one ring of ppermute steps (sharding/collective_matmul.py):
  each block's matmul runs while the next block (or accumulator) travels, forward and backward, with the
  same bytes per device as the collectives (xla tier).
- `fused`: the same gathers and scatters as one fused kernel each (meshmoe.pallas_kernels: all-gather +
  GEMM for project_in, with q, k and v as one GEMM over their concatenated weights; GEMM + reduce-scatter
  for project_out; each the other's backward), on Hopper GPUs for shapes they tile (pallas tier). The
  kernels take 2-D row blocks, so a [B, S, D] block is B*S rows and the gathered [P, B*S, N] result is
  reordered to [B, P*S, N] (a copy when B > 1).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from meshmoe.pallas_kernels.allgather_matmul import api as allgather_matmul
from meshmoe.pallas_kernels.matmul_reducescatter import api as matmul_reducescatter
from meshmoe.sharding import collective_matmul, parallel
from meshmoe.sharding.shardings import current

# The logical axes of the residual stream's tokens [B, S, ...], its last dimension left out: where the
# parallel ops find each device's tokens.
_STREAM_TOKENS = ("act_batch", "act_seq", None)


class _Layout(NamedTuple):
  """One projection call's mesh axes (inside shard_map)."""

  gather: parallel.Axes  # the sequence is gathered (project_in) / scattered (project_out) over these
  replicated: parallel.Axes  # tp axes that do not split the tokens: partial sums are psum-ed over them
  ring: parallel.Axes  # the axes every operand of a ring or a fused kernel must vary over
  varying: tuple[parallel.Axes, ...]  # each operand's own axes (x or y first, then the weights)


def project_in(x_BSD: jax.Array, weights: Sequence[jax.Array],
               logical: Sequence[Sequence[str | None]]) -> list[jax.Array]:
  """[x @ w for w in weights]: each w is [D, ...] with logical names `logical[i]` (first one `embed`);
  results are [B, S, ...] in x's dtype, split over the tp axes like the weights' output dimensions."""
  weights = [w.astype(x_BSD.dtype) for w in weights]
  plan = current()
  if plan is None:
    return [_matmul_in(x_BSD, w) for w in weights]
  x_spec = plan.activation_spec(_STREAM_TOKENS)
  w_specs = [plan.weight_spec(names) for names in logical]
  tp_axes, gather = plan.projection_axes(logical)
  seq_axes = parallel.dim_axes(x_spec, 1)
  batch_axes = parallel.dim_axes(x_spec, 0)
  out_specs = [parallel.spec_of(batch_axes, parallel.without(seq_axes, gather),
                                *(parallel.dim_axes(spec, i) for i in range(1, len(names))))
               for spec, names in zip(w_specs, logical)]
  # The ring's custom gradient needs x and the weights to vary over the same mesh axes.
  lay = _Layout(gather, parallel.without(tp_axes, gather),
                tuple(dict.fromkeys(parallel.all_axes(x_spec) + tp_axes)),
                (parallel.all_axes(x_spec), *(parallel.all_axes(spec) for spec in w_specs)))

  def body(x_BSD, *weights):
    b, s, d = x_BSD.shape  # one device's block; the weights' output widths are its shares too
    width = sum(math.prod(w.shape[1:]) for w in weights)
    choice = plan.project_in(gather, b * s, d, width, x_BSD.dtype)
    return PROJECT_IN[choice.implementation](x_BSD, list(weights), lay, choice, plan)

  return parallel.shard_map(plan, body, (x_spec, *w_specs), out_specs)(x_BSD, *weights)


def project_out(y: jax.Array, w: jax.Array, logical: Sequence[str | None]) -> jax.Array:
  """y [B, S, ...] @ w [..., D] (logical names `logical`, last one `embed`) -> [B, S, D] in y's dtype,
  placed like the residual stream."""
  w = w.astype(y.dtype)
  plan = current()
  if plan is None:
    return _matmul_out(y, w)
  res_spec = plan.activation_spec(_STREAM_TOKENS)
  w_spec = plan.weight_spec(logical)
  tp_axes, scatter = plan.projection_axes([logical])
  seq_axes = parallel.dim_axes(res_spec, 1)
  y_spec = parallel.spec_of(parallel.dim_axes(res_spec, 0), parallel.without(seq_axes, scatter),
                            *(parallel.dim_axes(w_spec, i) for i in range(len(logical) - 1)))
  lay = _Layout(scatter, parallel.without(tp_axes, scatter),
                tuple(dict.fromkeys(parallel.all_axes(y_spec) + tp_axes)), (parallel.all_axes(y_spec), tp_axes))

  def body(y, w):
    rows = y.shape[0] * y.shape[1] // plan.axis_size(scatter)  # of one destination block
    choice = plan.project_out(scatter, rows, math.prod(w.shape[:-1]), w.shape[-1], y.dtype)
    out_BSD = PROJECT_OUT[choice.implementation](y, w, lay, choice, plan)
    return jax.lax.psum(out_BSD, lay.replicated) if lay.replicated else out_BSD

  return parallel.shard_map(plan, body, (y_spec, w_spec), res_spec)(y, w)


# --- project_in's implementations: (x_BSD, weights, layout, choice, plan) -> [x_gathered @ w, ...] -------


def _local_in(x_BSD, weights, lay: _Layout, choice, plan) -> list[jax.Array]:
  if lay.replicated:
    # x is the same on every tp device here. Marking it as differing once, before the matmuls, makes
    # the backward sum the matmuls' input gradients locally and then psum once, not once per weight.
    x_BSD = jax.lax.pcast(x_BSD, lay.replicated, to="varying")
  return [_matmul_in(x_BSD, w) for w in weights]


def _collectives_in(x_BSD, weights, lay: _Layout, choice, plan) -> list[jax.Array]:
  return _local_in(jax.lax.all_gather(x_BSD, lay.gather, axis=1, tiled=True), weights, lay, choice, plan)


def _ring_in(x_BSD, weights, lay: _Layout, choice, plan) -> list[jax.Array]:
  x_BSD, *weights = _vary(lay, x_BSD, *weights)
  return list(collective_matmul.allgather_matmul(x_BSD, weights, lay.gather))


def _fused_in(x_BSD, weights, lay: _Layout, choice, plan) -> list[jax.Array]:
  """[all_gather(x_BSD, axes, axis=1, tiled=True) @ w for w in weights] as one all-gather GEMM kernel over
  the weights side by side."""
  x_BSD, *weights = _vary(lay, x_BSD, *weights)
  b, s, d = x_BSD.shape
  widths = [math.prod(w.shape[1:]) for w in weights]
  w_KN = jnp.concatenate([w.reshape(d, -1) for w in weights], axis=1)
  out_PMN = allgather_matmul.allgather_matmul(x_BSD.reshape(b * s, d), w_KN, lay.gather,
                                              backend=choice.kernel_backend, num_sms=plan.hardware.num_sms,
                                              tiles=choice.tiles)
  p = out_PMN.shape[0]
  out_BSN = out_PMN.reshape(p, b, s, -1).transpose(1, 0, 2, 3).reshape(b, p * s, -1)
  splits = jnp.split(out_BSN, list(itertools.accumulate(widths))[:-1], axis=2)
  return [part.reshape(b, p * s, *w.shape[1:]) for part, w in zip(splits, weights)]


PROJECT_IN = {"local": _local_in, "collectives": _collectives_in, "ring": _ring_in, "fused": _fused_in}


# --- project_out's implementations: (y, w, layout, choice, plan) -> [B, S, D] before the psum ----------


def _local_out(y, w, lay: _Layout, choice, plan) -> jax.Array:
  return _matmul_out(y, w)


def _collectives_out(y, w, lay: _Layout, choice, plan) -> jax.Array:
  return jax.lax.psum_scatter(_matmul_out(y, w), lay.gather, scatter_dimension=1, tiled=True)


def _ring_out(y, w, lay: _Layout, choice, plan) -> jax.Array:
  return collective_matmul.matmul_reducescatter(*_vary(lay, y, w), lay.gather)


def _fused_out(y, w, lay: _Layout, choice, plan) -> jax.Array:
  """psum_scatter(y @ w, axes, scatter_dimension=1, tiled=True) as one GEMM reduce-scatter kernel: y
  [B, P*S, ...] becomes P destination blocks of B*S rows."""
  y, w = _vary(lay, y, w)
  b, ps, d = y.shape[0], y.shape[1], w.shape[-1]
  p = plan.axis_size(lay.gather)
  s = ps // p
  y_PMK = y.reshape(b, p, s, -1).transpose(1, 0, 2, 3).reshape(p, b * s, -1)
  out_MN = matmul_reducescatter.matmul_reducescatter(y_PMK, w.reshape(-1, d), lay.gather,
                                                     backend=choice.kernel_backend, num_sms=plan.hardware.num_sms,
                                                     tiles=choice.tiles)
  return out_MN.reshape(b, s, d)


PROJECT_OUT = {"local": _local_out, "collectives": _collectives_out, "ring": _ring_out, "fused": _fused_out}


def _vary(lay: _Layout, *operands: jax.Array) -> list[jax.Array]:
  """The operands marked as varying over all of the ring's axes (each varies over its own `lay.varying`
  already). The backward pass sums each gradient over the added axes, as autodiff does where an invariant
  operand meets a varying one."""
  marked = []
  for a, varying in zip(operands, lay.varying, strict=True):
    missing = parallel.without(lay.ring, varying)
    marked.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
  return marked


def _matmul_in(x_BSD: jax.Array, w: jax.Array) -> jax.Array:
  return jnp.tensordot(x_BSD, w, axes=[[2], [0]])


def _matmul_out(y: jax.Array, w: jax.Array) -> jax.Array:
  contracted = w.ndim - 1
  return jnp.tensordot(y, w, axes=[list(range(y.ndim - contracted, y.ndim)), list(range(contracted))])
