"""Compressed gradient synchronisation over the replicas, with error feedback (`parallel.gradient_compression`).

What it covers: the routed experts' weights, the bulk of an MoE model's parameters and of its gradient
bytes. Their gradient is summed inside the MoE op's backward pass (an all-reduce per micro-batch) over the
"replica axes": the mesh axes that split the tokens but not the experts (`data`, and `sequence` where it
splits the tokens, as in `megascale`; ParallelPlan.gradient_replica_axes). Here that sum travels
compressed. The other weights' gradients (attention, embeddings, router, norms, shared experts) are summed
by XLA as before, in full precision.

How: under compression, the MoE layer stack (models/decoder.py, expert_parallel.expert_replicas) turns
every layer's expert weights into one copy per replica, `per_replica(w)`: [layers, R, ...] split over the
replica axes, which costs nothing (each device holds its replica's copy already). Inside the MoE op each
device's copy then differs from the others' only by name, so autodiff does not sum the gradient over those
axes there, and `per_replica`'s custom VJP receives each replica's own gradient of every layer after the
layer loop's backward pass. It sums them compressed, all layers at once, once per micro-batch (inside the
loop, those collectives took XLA's overlap from the layers' token exchanges: moe_1b's overlap fell from
0.68 to 0.53 with 1-bit signs; summing one layer at a time after the loop, with `lax.map`, held more
memory). A direct call of the MoE op (no layer stack) makes its own copies, without feedback:

- "bfloat16": a psum in bfloat16 (half the bytes of float32 gradients on GPUs; nothing saved where the
  model computes in bfloat16, whose in-op sums are bfloat16 already; XLA:CPU promotes the all-reduce to
  float32, so there it saves nothing either);
- "int8": blocks of `BLOCK` values, each as int8 with a float32 scale (its largest magnitude / 127), in two
  phases: an all-to-all gives each device every replica's int8 copy of its 1/R of the elements, which it
  dequantises and sums in float32, then re-quantises to int8 and all-gathers. Bytes per device: about
  2 (R-1)/R bytes per element and 1/32 more for the scales, against a ring all-reduce's 4 (R-1)/R in
  bfloat16 or 8 (R-1)/R in float32;
- "sign": the first phase sends each value's sign (1 bit, packed 8 to a byte) with one float32 scale per
  block (the block's mean magnitude: the scaled-sign compressor of EF-signSGD), the second phase int8.

Error feedback (`parallel.gradient_error_feedback`, for the low-bit formats, off by default): each device
keeps what its first-phase compression lost, e = v - C(v) for the value v it sent, and adds it to its next
gradient before compressing, so nothing is lost for good (1-bit Adam, EF-SGD). What is kept, the
error-feedback residual `grad_residual` (TrainState.grad_residual), is float32, a copy of the device's expert
weights per device, stored [layers, R, ...] split like the weights and over the replica axes, in the train
state beside the optimizer state (checkpointed with it). It enters the computation as an input of
`per_replica`, and its "gradient" is the new grad_residual. Each micro-batch's sum is one round: the train
step feeds what one micro-batch's sum lost into the next one's. With AdamW it does not help on tiny_moe
(experiments/benchmarks/RESULTS.md): Adam's per-value normalisation already makes its steps sign-like, and
the residual's delayed gradients upset its second moment.

Error bounds (per element, per use): int8 loses at most half a step, max|block| / 254, in each phase;
bfloat16 rounding is relative, 2^-9 of the value, plus the psum's own bfloat16 additions. The sign
compressor has no per-element bound (it keeps a block's mean magnitude and each value's sign).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

BLOCK = 128  # values per quantisation block; each block has one float32 scale
LOW_BIT = ("int8", "sign")  # formats error feedback applies to


def replica_spec(spec: PartitionSpec, axes: tuple[str, ...], axis: int = 0) -> PartitionSpec:
  """The spec of copies of a weight placed as `spec`, one per replica over `axes`, stacked at `axis`."""
  entries = [*spec, *[None] * max(0, axis - len(spec))]
  return PartitionSpec(*entries[:axis], axes, *entries[axis:])


def per_replica(w, grad_residual, mesh, specs, compression: str, axes: tuple[str, ...], axis: int = 0):
  """`w` (a pytree of weights, each placed as `specs` says) as one copy per replica over mesh `axes`,
  stacked at `axis` (size R there); the backward sums the replicas' gradients in `compression`, adding the
  error-feedback `grad_residual` (a pytree like the copies; None: no feedback) before compressing and returning
  what the compression lost as the cotangent of `grad_residual`."""
  replicas = math.prod(mesh.shape[a] for a in axes)
  replica_specs = jax.tree.map(lambda spec: replica_spec(spec, axes, axis), specs,
                               is_leaf=lambda x: isinstance(x, PartitionSpec))

  def copies(w):
    return jax.tree.map(lambda a, spec: jax.lax.with_sharding_constraint(
        jnp.broadcast_to(jnp.expand_dims(a, axis), (*a.shape[:axis], replicas, *a.shape[axis:])),
        NamedSharding(mesh, spec)), w, replica_specs)

  @jax.custom_vjp
  def replicate(w, grad_residual):
    return copies(w)

  def forward(w, grad_residual):
    return copies(w), grad_residual

  def backward(grad_residual, grads):
    leaves, tree = jax.tree.flatten(grads)
    spec_leaves = tree.flatten_up_to(replica_specs)
    feedback = grad_residual is not None

    def body(*args):
      gs, es = args[:len(leaves)], (args[len(leaves):] if feedback else [None] * len(leaves))
      mine = lambda a: None if a is None else jnp.squeeze(a, axis)  # this device's replica
      summed = [compressed_sum(mine(g), mine(e), compression, axes, replicas) for g, e in zip(gs, es)]
      return [total for total, _ in summed], [jnp.expand_dims(lost, axis) for _, lost in summed]

    operands = leaves + (tree.flatten_up_to(grad_residual) if feedback else [])
    # check_vma=False: the sums are the same on every replica (each dequantises the same gathered
    # bytes in the same order), which the out_specs state and the type system cannot see.
    totals, lost = jax.shard_map(body, mesh=mesh, in_specs=tuple(spec_leaves * (2 if feedback else 1)),
                                 out_specs=(tree.flatten_up_to(specs), spec_leaves), check_vma=False)(*operands)
    return tree.unflatten(totals), (tree.unflatten(lost) if feedback else None)

  replicate.defvjp(forward, backward)
  return replicate(w, grad_residual)


def compressed_sum(g: jax.Array, grad_residual: jax.Array | None, compression: str, axes: tuple[str, ...],
                   replicas: int) -> tuple[jax.Array, jax.Array]:
  """(the sum over mesh `axes` (`replicas` devices) of every replica's g, what this device's compression
  lost), per device inside shard_map. `grad_residual` (or zero) is added to g before compressing."""
  v = g.astype(jnp.float32) + (0.0 if grad_residual is None else grad_residual)
  if compression == "bfloat16":
    sent = v.astype(jnp.bfloat16)
    return jax.lax.psum(sent, axes).astype(jnp.float32), v - sent.astype(jnp.float32)
  if compression not in LOW_BIT:
    raise ValueError(f"unknown gradient compression {compression!r}; known: bfloat16, {', '.join(LOW_BIT)}")
  blocks = _blocks(v, replicas)  # [D, blocks per device, BLOCK]: device j sums the values of row j
  quantise, dequantise = _FORMATS[compression]
  payload, scales = quantise(blocks)
  lost = v - _unblocks(dequantise(payload, scales), v)
  # Phase 1: every replica's copy of my row, dequantised and summed in float32.
  payload, scales = (jax.lax.all_to_all(a, axes, 0, 0, tiled=False) for a in (payload, scales))
  mine = jnp.sum(dequantise(payload, scales), axis=0)
  # Phase 2: each row's sum, as int8, to every replica.
  payload, scales = _quantise_int8(mine)
  payload, scales = (jax.lax.all_gather(a, axes, axis=0, tiled=False) for a in (payload, scales))
  return _unblocks(_dequantise_int8(payload, scales), v), lost


def _blocks(v: jax.Array, replicas: int) -> jax.Array:
  """v's values, zero-padded, as [replicas, n, BLOCK]."""
  per_device = math.ceil(v.size / (replicas * BLOCK))
  flat = jnp.pad(v.reshape(-1), (0, replicas * per_device * BLOCK - v.size))
  return flat.reshape(replicas, per_device, BLOCK)


def _unblocks(blocks: jax.Array, like: jax.Array) -> jax.Array:
  return blocks.reshape(-1)[:like.size].reshape(like.shape)


def _quantise_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """int8 values and a float32 scale per block (last axis): x ~ q * scale, |error| <= scale / 2."""
  scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
  safe = jnp.where(scale > 0, scale, 1.0)[..., None]
  return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale


def _dequantise_int8(q: jax.Array, scale: jax.Array) -> jax.Array:
  return q.astype(jnp.float32) * scale[..., None]


def _quantise_sign(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Each value's sign, 8 to a byte, and the block's mean magnitude: x ~ sign(x) * mean|x|."""
  return jnp.packbits(x >= 0, axis=-1), jnp.mean(jnp.abs(x), axis=-1)


def _dequantise_sign(bits: jax.Array, scale: jax.Array) -> jax.Array:
  signs = jnp.unpackbits(bits, axis=-1, count=BLOCK).astype(jnp.float32) * 2.0 - 1.0
  return signs * scale[..., None]


_FORMATS = {"int8": (_quantise_int8, _dequantise_int8), "sign": (_quantise_sign, _dequantise_sign)}


def result_bytes(elements: int, compression: str, replicas: int, platform: str) -> dict[str, float]:
  """The result bytes of each kind of collective (as XLA's program states them, and as the cost model's
  `moved_bytes` takes them) that sum one weight of `elements` values per device over `replicas`."""
  if compression == "bfloat16":  # XLA:CPU promotes a bfloat16 all-reduce to float32; GPUs reduce bfloat16
    return {"all-reduce": (4.0 if platform == "cpu" else 2.0) * elements}
  blocks = math.ceil(elements / (replicas * BLOCK)) * replicas
  payload = {"int8": BLOCK, "sign": BLOCK // 8}[compression]
  return {"all-to-all": blocks * (payload + 4.0), "all-gather": blocks * (BLOCK + 4.0)}
