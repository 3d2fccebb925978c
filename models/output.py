"""The output layer's cross-entropy, computed without the [tokens, V] float32 logits.

At a large vocabulary the logits dominate a step's activations: Qwen3's 151,936 entries at 8K tokens per
device are 5 GB of float32 per micro-batch, and autodiff keeps a second such buffer for their gradient.
`cross_entropy_sum` cuts each device's tokens into chunks and runs them one at a time in a lax.scan. Per
chunk it computes the float32 logits [chunk, V], their log-sum-exp and the target's logit; differentiated
(a custom VJP), the same step also turns the chunk's logits into their gradient, softmax - one-hot, and
that into the chunk's input gradient (stacked) and its share of the weight gradient (summed in the scan's
carry). So one chunk's logits and their gradient exist at a time, forward and backward, and nothing is
recomputed: the output layer costs the three matmuls of plain autodiff (logits, input and weight
gradients), and what the forward pass keeps for the backward is the input and weight gradients, which
the backward pass needs anyway (the backward only scales them by the loss's cotangent).

Chunks. A chunk is a strided slice of every device's tokens: the batch and sequence dimensions are cut
[B, S] -> [B/nb, nb, S/ns, ns] and the scan runs over the (nb, ns) positions, so each chunk keeps the
batch and sequence split of the whole (the leading B/nb and S/ns factors are what the mesh splits: nb
divides each device's rows, ns its positions) and slicing one takes no communication. The loss is a sum
over tokens, so their grouping does not change it. `chunk_counts` picks (nb, ns) from each device's shape
of the logits under the active plan: the fewest chunks, cutting the sequence first, whose float32 logits
fit `ModelConfig.logits_chunk_bytes` per device (one chunk when they all do, or when the budget is 0:
then the logits are formed whole, as plain autodiff does).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from meshmoe.sharding.shardings import activation_sharding, constrain

LOGITS = ("act_batch", "act_seq", "act_vocab")


def logits(x_BSD: jax.Array, weight: jax.Array, tied: bool) -> jax.Array:
  """Float32 logits [..., V] of hidden states [..., D]: `weight` is the tied embedding table [V, D]
  (`tied`) or an unembedding [D, V]."""
  equation = "...d,vd->...v" if tied else "...d,dv->...v"
  return jnp.einsum(equation, x_BSD.astype(jnp.float32), weight.astype(jnp.float32),
                    preferred_element_type=jnp.float32)


def local_logits_shape(batch: int, seq: int, vocab: int) -> tuple[int, int, int]:
  """One device's share [B, S, V] of the logits under the active plan (the whole without one)."""
  sharding = activation_sharding(LOGITS)
  return (batch, seq, vocab) if sharding is None else tuple(sharding.shard_shape((batch, seq, vocab)))


def chunk_counts(batch: int, seq: int, vocab: int, chunk_bytes: int) -> tuple[int, int]:
  """(nb, ns): how many ways to cut one device's [batch, seq] tokens so that a chunk's float32 logits
  [batch/nb, seq/ns, vocab] take at most `chunk_bytes` (0: no limit). The fewest chunks, cutting the
  sequence first; nb divides batch and ns divides seq. A single token's logits over budget give one
  token per chunk."""
  if chunk_bytes <= 0:
    return 1, 1
  max_tokens = max(1, chunk_bytes // (4 * vocab))
  ns = next((n for n in _divisors(seq) if batch * (seq // n) <= max_tokens), seq)
  nb = next((n for n in _divisors(batch) if (batch // n) * (seq // ns) <= max_tokens), batch)
  return nb, ns


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def cross_entropy_sum(x_BSD: jax.Array, weight: jax.Array, targets_BS: jax.Array, mask_BS: jax.Array, *,
                      tied: bool, chunk_bytes: int) -> jax.Array:
  """sum over tokens of mask * (logsumexp(logits) - logits[target]), logits = `logits(x_BSD, weight,
  tied)`, in float32, in chunks of at most `chunk_bytes` of logits per device (module docstring).
  Differentiable in x_BSD, weight and mask_BS."""
  batch, seq, _ = x_BSD.shape
  vocab = weight.shape[0 if tied else 1]
  local_batch, local_seq, local_vocab = local_logits_shape(batch, seq, vocab)
  nb, ns = chunk_counts(local_batch, local_seq, local_vocab, chunk_bytes)
  x_BSD, weight, mask_BS = x_BSD.astype(jnp.float32), weight.astype(jnp.float32), mask_BS.astype(jnp.float32)
  if nb * ns == 1:  # the whole: plain autodiff
    ce_BS, _ = _chunk_ce(x_BSD, weight, targets_BS, tied, with_gradient=False)
    return jnp.sum(ce_BS * mask_BS)
  layout = _Layout(tied, nb, ns, batch // local_batch, seq // local_seq)
  return _chunked_cross_entropy(layout)(x_BSD, weight, targets_BS, mask_BS)


@dataclasses.dataclass(frozen=True)
class _Layout:
  tied: bool
  nb: int  # chunks along each device's rows
  ns: int  # and along its positions
  kb: int  # devices that split the batch
  ks: int  # devices that split the sequence

  def to_chunks(self, a: jax.Array) -> jax.Array:
    """[B, S, ...] -> [nb * ns, B/nb, S/ns, ...]; chunk (i, j) holds rows i, i + nb, ... at positions
    j, j + ns, ... (the leading B/nb and S/ns factors keep the mesh's split of B and S)."""
    b, s, *rest = a.shape
    a = a.reshape(b // self.nb, self.nb, s // self.ns, self.ns, *rest)
    a = jnp.moveaxis(a, (1, 3), (0, 1)).reshape(self.nb * self.ns, b // self.nb, s // self.ns, *rest)
    return constrain(a, (None, "act_batch", "act_seq") + ("act_embed",) * len(rest))

  def from_chunks(self, a: jax.Array) -> jax.Array:
    """The inverse of `to_chunks`."""
    _, b, s, *rest = a.shape
    a = jnp.moveaxis(a.reshape(self.nb, self.ns, b, s, *rest), (0, 1), (1, 3))
    return a.reshape(b * self.nb, s * self.ns, *rest)

  def weight_gradient_parts(self, x_BSD: jax.Array, grad_BSV: jax.Array) -> jax.Array:
    """One chunk's weight gradient as one part per device that holds other tokens, [kb, ks, *weight]:
    each device computes its own part, and the parts are summed once after the last chunk (summed
    within the loop, GSPMD would reduce over the devices once per chunk)."""
    b, s, d = x_BSD.shape
    x = x_BSD.reshape(self.kb, b // self.kb, self.ks, s // self.ks, d)
    grad = grad_BSV.reshape(self.kb, b // self.kb, self.ks, s // self.ks, grad_BSV.shape[-1])
    parts = jnp.einsum("ibjsd,ibjsv->ij" + ("vd" if self.tied else "dv"), x, grad,
                       preferred_element_type=jnp.float32)
    return constrain(parts, self.parts_axes())

  def parts_axes(self) -> tuple[str | None, ...]:
    return ("act_batch", "act_seq") + (("act_vocab", None) if self.tied else (None, "act_vocab"))


def _gathered(weight: jax.Array, tied: bool) -> jax.Array:
  """The weight placed as the chunks' matmuls use it: the model dimension whole, the vocabulary split as
  the logits' is. Outside the loop, so that a weight stored split (fsdp, tp_sp) is gathered once, not once
  per chunk."""
  sharding = activation_sharding(LOGITS)
  if sharding is None:
    return weight
  vocab_axes = tuple(sharding.spec)[2] if len(sharding.spec) > 2 else None
  spec = PartitionSpec(vocab_axes, None) if tied else PartitionSpec(None, vocab_axes)
  return jax.lax.with_sharding_constraint(weight, NamedSharding(sharding.mesh, spec))


def _chunk_ce(x_BSD, weight, targets_BS, tied: bool, *, with_gradient: bool, mask_BS=None):
  """Per-token cross-entropy [B, S] of one chunk and, `with_gradient`, the gradient of
  sum(mask * ce) with respect to the chunk's logits, [B, S, V]."""
  logits_BSV = constrain(logits(x_BSD, weight, tied), LOGITS)
  lse_BS = jax.nn.logsumexp(logits_BSV, axis=-1)
  is_target_BSV = jax.lax.broadcasted_iota(jnp.int32, logits_BSV.shape, 2) == targets_BS[..., None]
  target_logit_BS = jnp.sum(jnp.where(is_target_BSV, logits_BSV, 0.0), axis=-1)
  ce_BS = lse_BS - target_logit_BS
  if not with_gradient:
    return ce_BS, None
  probs_BSV = jnp.exp(logits_BSV - lse_BS[..., None])
  grad_BSV = (probs_BSV - is_target_BSV.astype(jnp.float32)) * mask_BS[..., None]
  return ce_BS, constrain(grad_BSV, LOGITS)


def _chunked_cross_entropy(layout: _Layout):
  """f(x_BSD, weight, targets_BS, mask_BS) -> sum(mask * ce) over the layout's chunks, with its VJP."""
  tied = layout.tied

  def chunks(x_BSD, targets_BS, mask_BS):
    return layout.to_chunks(x_BSD), layout.to_chunks(targets_BS), layout.to_chunks(mask_BS)

  @jax.custom_vjp
  def ce_sum(x_BSD, weight, targets_BS, mask_BS):
    weight = _gathered(weight, tied)

    def step(total, chunk):
      x, targets, mask = chunk
      ce, _ = _chunk_ce(x, weight, targets, tied, with_gradient=False)
      return total + jnp.sum(ce * mask), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), chunks(x_BSD, targets_BS, mask_BS))
    return total

  def forward(x_BSD, weight, targets_BS, mask_BS):
    weight = _gathered(weight, tied)

    def step(carry, chunk):
      total, parts = carry
      x, targets, mask = chunk
      ce, grad_logits = _chunk_ce(x, weight, targets, tied, with_gradient=True, mask_BS=mask)
      grad_x = jnp.einsum("bsv,vd->bsd" if tied else "bsv,dv->bsd", grad_logits, weight,
                          preferred_element_type=jnp.float32)
      parts = parts + layout.weight_gradient_parts(x, grad_logits)
      return (total + jnp.sum(ce * mask), parts), (grad_x, ce)

    parts = constrain(jnp.zeros((layout.kb, layout.ks, *weight.shape), jnp.float32), layout.parts_axes())
    (total, parts), (grad_x, ce) = jax.lax.scan(step, (jnp.zeros((), jnp.float32), parts),
                                                chunks(x_BSD, targets_BS, mask_BS))
    grad_weight = jnp.sum(parts, axis=(0, 1))
    return total, (layout.from_chunks(grad_x), grad_weight, layout.from_chunks(ce))

  def backward(residuals, cotangent):
    grad_x_BSD, grad_weight, ce_BS = residuals
    return cotangent * grad_x_BSD, cotangent * grad_weight, None, cotangent * ce_BS

  ce_sum.defvjp(forward, backward)
  return ce_sum
