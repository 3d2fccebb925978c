"""Collective matmuls as rings of `ppermute` steps: the `xla` tier of tensor_parallel's projections.

Per-device functions, called inside jax.shard_map over a ring of t devices: the mesh axes `axes` (one or
several; device i is jax.lax.axis_index(axes), the linear index over them, which is also the order of
all_gather(..., tiled=True) and the index ppermute's pairs use).

- `allgather_matmul(x, weights, axes)` = [all_gather(x, axes, axis=1, tiled=True) @ w for w in weights].
  Every device's sequence block passes by every other device; each device multiplies the block it holds
  with all the weights (q, k and v share one ring) and writes the products at the block's sequence
  position, while the next block is already on its way: the transfer issued in a step forwards the
  block received in the step before and never waits for that step's matmul, so XLA can run the two at
  once.
- `matmul_reducescatter(y, w, axes)` = psum_scatter(y @ w, axes, scatter_dimension=1, tiled=True).
  Each destination block's sum travels to its owner: at every step a device computes its partial product
  for one destination block (its rows of y for that block @ w), adds the accumulator received from its
  neighbour and passes it on; the next step's matmul does not depend on that transfer.

Bidirectional rings. Blocks (and accumulators) travel both ways round the ring, one whole block per
direction and step: ceil((t-1)/2) steps clockwise (i -> i+1) and floor((t-1)/2) counter-clockwise, so no
block goes more than half way round: about half the steps of a one-way ring, with both directions of
every link in use. For t == 2 the counter-clockwise part is empty: the one-way ring of one step (there is
only one neighbour, so a second direction would not help). In the compiled H100 program XLA's scheduler
keeps one collective-permute in flight at a time (its default), alternating the two directions, each
behind one block's matmul.

Steps are chained with optimization barriers (`_after`). The matmuls are otherwise independent and share
the weights: XLA merges them into one matmul over the whole gathered block, before or after the ring,
and runs the transfers synchronously with nothing to overlap (as the compiled H100 program shows). So in
the all-gather ring a received block is used, and forwarded, only once the matmuls before it are done
(its own step's matmul never gates its transfer), and in the reduce-scatter ring a partial product is
computed only once the accumulator before it has been formed (and is travelling). In the compiled H100
program of a block's forward and backward (tests/test_tensor_parallel_xla.py) this leaves about 1 in 50
transfers without a matmul to hide behind, against nearly all without the chain.

Gradients (custom_vjp, the dual ring): the backward of the all-gather matmul is a reduce-scatter ring of
the output gradient (dx, summed over the weights in each partial product) plus one local matmul for each
weight's gradient against the gathered x saved by the forward; the backward of the reduce-scatter matmul
is an all-gather ring of the output gradient, writing dy block by block, plus one local matmul for dw
against the gathered gradient. So neither direction contains an all-gather or reduce-scatter collective.

Bytes per device and call: each direction of the ring carries whole blocks, so a device receives t-1
blocks in all, (t-1)/t of the gathered activation (all-gather matmul) or of the [B, t*S, D] partial sums
(reduce-scatter matmul), the same bytes as the reference tier's all_gather / psum_scatter, split over
both neighbours' links; the backward pass moves the same bytes with the roles swapped. Memory: the
forward of allgather_matmul keeps the gathered x for the weight gradients, as the reference tier's does.

All operands must vary over the same mesh axes (jax.lax.pcast them first): the custom_vjp's cotangents
then have the primals' types.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from meshmoe.sharding.parallel import Axes


def allgather_matmul(x_BSD: jax.Array, weights: Sequence[jax.Array], axes: Axes) -> tuple[jax.Array, ...]:
  """[all_gather(x_BSD, axes, axis=1, tiled=True) @ w for w in weights], each w [D, ...] contracted over
  D: results [B, t*S, ...] in the matmul's dtype."""
  return _allgather_matmul(tuple(axes), x_BSD, tuple(weights))


def matmul_reducescatter(y: jax.Array, w: jax.Array, axes: Axes) -> jax.Array:
  """psum_scatter(y @ w, axes, scatter_dimension=1, tiled=True): y [B, t*S, ...] contracted over its
  trailing w.ndim-1 dimensions with w [..., D]; result [B, S, D]."""
  return _matmul_reducescatter(tuple(axes), y, w)


# The two rings. Clockwise blocks move i -> i+1, counter-clockwise ones i -> i-1.


def _ring_size(axes: Axes) -> int:
  return math.prod(jax.lax.axis_size(a) for a in axes)


def _steps(t: int) -> tuple[int, int]:
  """Steps (hops) clockwise and counter-clockwise that reach all t-1 other devices."""
  return t // 2, (t - 1) // 2


def _shift(a: jax.Array, axes: Axes, t: int, direction: int) -> jax.Array:
  return jax.lax.ppermute(a, axes, [(i, (i + direction) % t) for i in range(t)])


def _gather_ring(x, axes: Axes, visit: Callable, carry):
  """carry = visit(j, carry, x_j) for the x_j of every device j of the ring (its own x first), then
  returns carry. visit's work on one block overlaps the transfer of the next; each received block waits
  for the visits before it, so the visits stay one per block and in ring order."""
  t = _ring_size(axes)
  i = jax.lax.axis_index(axes)
  clockwise_steps, counter_steps = _steps(t)
  clockwise = counter = x
  carry = visit(i, carry, x)
  for k in range(1, clockwise_steps + 1):
    carry, clockwise = _after(carry, _shift(clockwise, axes, t, 1))  # device i-k's block
    carry = visit((i - k) % t, carry, clockwise)
    if k <= counter_steps:
      carry, counter = _after(carry, _shift(counter, axes, t, -1))  # device i+k's block
      carry = visit((i + k) % t, carry, counter)
  return carry


def _scatter_ring(partial: Callable, axes: Axes) -> jax.Array:
  """The sum over all devices of their partial(i) for this device i, where partial(d) is a device's
  contribution to destination d's block. A destination's clockwise accumulator starts `steps` hops
  before it and collects one partial per device on the way; the counter-clockwise one comes from after.
  Each partial is computed once the accumulator formed before it is on its way, and overlaps that
  transfer."""
  t = _ring_size(axes)
  i = jax.lax.axis_index(axes)
  steps = dict(zip((1, -1), _steps(t)))
  # (direction, distance) of each partial in the order computed: the farthest destinations first, the
  # device's own block (distance 0) last.
  order = [(direction, distance) for distance in range(steps[1], 0, -1) for direction in (1, -1)
           if distance <= steps[direction]] + [(0, 0)]
  accumulators = {}
  last = None  # (direction, partial) of the step before
  for direction, distance in order:
    destination = (i + direction * distance) % t
    if last is not None:  # the last partial joins its accumulator, which travels on
      accumulator = accumulators.get(last[0])
      accumulator = last[1] if accumulator is None else accumulator + last[1]
      accumulator, destination = _after(accumulator, destination)
      accumulators[last[0]] = _shift(accumulator, axes, t, last[0])
    last = (direction, partial(destination))
  return functools.reduce(jnp.add, [last[1], *accumulators.values()])


def _after(done, operand):
  """(done, operand), both usable only once both are computed: chains a ring step to the one before
  (module docstring). Callers use both results: XLA drops a barrier's operands whose results go unused,
  and with them the ordering."""
  return jax.lax.optimization_barrier((done, operand))


def _write(buffer: jax.Array, block: jax.Array, block_index) -> jax.Array:
  """buffer with `block` at sequence block `block_index` (dimension 1)."""
  return jax.lax.dynamic_update_slice_in_dim(buffer, block, block_index * block.shape[1], axis=1)


def _rows(a: jax.Array, block_index, size: int) -> jax.Array:
  return jax.lax.dynamic_slice_in_dim(a, block_index * size, size, axis=1)


# all-gather + matmul


def _in(x_BSD, w):
  """x [B, S, D] @ w [D, ...] -> [B, S, ...]."""
  return jnp.tensordot(x_BSD, w, axes=[[2], [0]])


def _in_transposed(dout, w):
  """d(x @ w)/dx applied to dout [B, S, ...]: -> [B, S, D]."""
  return jnp.tensordot(dout, w, axes=[list(range(2, dout.ndim)), list(range(1, w.ndim))])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _allgather_matmul(axes, x_BSD, weights):
  return _allgather_matmul_fwd(axes, x_BSD, weights)[0]


def _allgather_matmul_fwd(axes, x_BSD, weights):
  b, s, d = x_BSD.shape
  t = _ring_size(axes)

  def visit(j, carry, x_j):
    x_all, outs = carry
    return _write(x_all, x_j, j), tuple(_write(out, _in(x_j, w), j) for out, w in zip(outs, weights))

  products = [jax.eval_shape(_in, x_BSD, w) for w in weights]
  empty = (jnp.zeros((b, t * s, d), x_BSD.dtype),
           tuple(jnp.zeros((b, t * s, *p.shape[2:]), p.dtype) for p in products))
  x_all, outs = _gather_ring(x_BSD, axes, visit, empty)
  return outs, (x_all, weights)


def _allgather_matmul_bwd(axes, residuals, douts):
  x_all, weights = residuals
  s = x_all.shape[1] // _ring_size(axes)

  def partial(dst):  # this device's share of dx for destination dst's rows
    terms = [_in_transposed(_rows(dout, dst, s), w) for dout, w in zip(douts, weights)]
    return functools.reduce(jnp.add, terms)

  dx_BSD = _scatter_ring(partial, axes)
  dweights = tuple(jnp.tensordot(x_all, dout, axes=[[0, 1], [0, 1]]) for dout in douts)
  return dx_BSD, dweights


_allgather_matmul.defvjp(_allgather_matmul_fwd, _allgather_matmul_bwd)


# matmul + reduce-scatter


def _out(y, w):
  """y [B, S, ...] @ w [..., D] over w's leading dimensions -> [B, S, D]."""
  contracted = w.ndim - 1
  return jnp.tensordot(y, w, axes=[list(range(y.ndim - contracted, y.ndim)), list(range(contracted))])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul_reducescatter(axes, y, w):
  return _matmul_reducescatter_fwd(axes, y, w)[0]


def _matmul_reducescatter_fwd(axes, y, w):
  s = y.shape[1] // _ring_size(axes)
  return _scatter_ring(lambda dst: _out(_rows(y, dst, s), w), axes), (y, w)


def _matmul_reducescatter_bwd(axes, residuals, dout_BSD):
  y, w = residuals
  b, _, d = dout_BSD.shape

  def visit(j, carry, dout_j):
    dy, dout_all = carry
    dy_j = jnp.tensordot(dout_j, w, axes=[[2], [w.ndim - 1]])  # [B, S, ...]
    return _write(dy, dy_j, j), _write(dout_all, dout_j, j)

  empty = (jnp.zeros_like(y), jnp.zeros((b, y.shape[1], d), dout_BSD.dtype))
  dy, dout_all = _gather_ring(dout_BSD, axes, visit, empty)
  return dy, jnp.tensordot(y, dout_all, axes=[[0, 1], [0, 1]])  # dw [..., D]


_matmul_reducescatter.defvjp(_matmul_reducescatter_fwd, _matmul_reducescatter_bwd)
