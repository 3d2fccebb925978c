"""Context-parallel causal attention: attention over a sequence split across devices.

Layout. When the rules split the sequence inside attention (`act_attn_seq`) over n devices, the train step
permutes each sequence into zigzag order (`zigzag_order`, from the plan's `sequence_order`) before the
model sees it: cut into 2n chunks, device d holds chunks d and 2n-1-d. Causal attention's work grows with a query's position, so an early and a late chunk give
every device the same amount. Positions travel with the tokens and causality follows them (key j is
visible to query i iff pos_j <= pos_i), so any order is correct; zigzag only balances the work.

Kinds (`parallel.attention`), for a device r of n holding Sl = S/n = 2c rows of q, k, v:
- `allgather`: all-gather K, V and positions over the sequence axes ([B, S, G, H] each), then compute only
  the causal c x c blocks: the early chunk r needs key chunks 0..r, the late chunk 2n-1-r needs
  0..2n-1-r, so 2n+1 blocks on every device (against 4n for the full square). Blocks 0 (early) and n..2n
  (late) are the same kind on every device; blocks 1..n-1 are early on some and late on others, chosen at
  run time from r. Memory: the gathered K/V. Communication: (n-1)/n of the gathered K/V per layer, and a
  reduce-scatter of their gradients (all_gather's transpose) in the backward pass.
- `ring`: K/V/position blocks travel around the ring, n-1 `ppermute`s (the last block goes nowhere); each
  step attends to the block at hand (backward: the reverse ring). Memory: the block held and the one in
  flight. Communication: the same bytes as the all-gather, in n-1 steps that later tiers overlap with
  compute. This tier computes every 2c x 2c block densely and masks it: 2x the causal work.
- `ulysses`: all-to-all from sequence-split to head-split ([B, Sl, N, H] -> [B, S, N/n, H]) for q, k and
  v, attention over the whole sequence for N/n heads (and G/n key/value heads: G must be divisible by n),
  and an all-to-all back. After the first all-to-all the rows are every device's zigzag rows in device
  order, which is the order of the all-gathered positions, so masking by position stays right.
  Memory: the S x S scores of N/n heads. Communication: (n-1)/n of q, k, v and the output, whatever the
  causal structure; the all-to-all is its own transpose.

Implementations (`IMPLEMENTATIONS`; the plan picks one from the kind and the tier, sharding/plan.py):
`local` (the sequence is whole), `allgather`, `ring` and `ulysses` as above, and `zigzag_ring`, the
ring of the `xla` tier: the K/V/position block for the next step is sent before the block at hand is
computed (the transfer depends on nothing the step computes, so XLA overlaps it), and only the causally
needed c x c quarter blocks are computed, 2n+1 per device like `allgather` instead of 4n. Device r holds
early chunk r and late chunk 2n-1-r; the block at step s comes from device src = (r - s) mod n:
- step 0 (src = r): early q x early k (diagonal), late q x early k (all visible), late q x late k
  (diagonal);
- src < r: both q chunks see all of src's early chunk (src < r) and nothing of its late one
  (2n-1-src > 2n-1-r);
- src > r: the late q chunk sees both of src's chunks (src < n <= 2n-1-r, and 2n-1-src < 2n-1-r); the
  early q chunk r sees neither (src > r, 2n-1-src >= n > r).
So every step after the first computes two quarter blocks, (q chunk early if src < r else late, k early)
and (late q, k early if src < r else late), chosen at run time from r and the step with static shapes.
Each step's blocks wait for the statistics of the steps before (an optimization barrier), so XLA cannot
merge the steps' score matmuls into one that waits for every transfer, as it does for the reference ring.
Bytes moved are the plain ring's. `allgather` (already causal) and `ulysses` (all-to-alls of whole
tensors, nothing to overlap within the op) run the same implementation in every tier.

Blocks accumulate with an online softmax in float32 (running max, denominator and output). The merge is
commutative and masks with a large finite negative number, so a fully masked block contributes exactly
zero and never a NaN (-inf - -inf). The running max is kept out of autodiff: the result does not depend
on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshmoe.sharding import parallel
from meshmoe.sharding.shardings import current

QUERY_AXES = ("act_batch", "act_attn_seq", "act_heads", None)  # the logical axes of q [B, S, N, H]
_MASKED = -1e30  # finite, so a fully masked block gives exp(0) * 0 = 0 instead of NaN


def zigzag_order(seq_len: int, num_shards: int) -> np.ndarray:
  """The zigzag permutation: permuted[i] = original[order[i]] (int32, [seq_len]). The sequence is cut into
  2n equal chunks (n = num_shards) and the permuted one, split contiguously into n parts, gives part d
  chunks d and 2n-1-d. The identity for n == 1; ValueError if 2n does not divide seq_len."""
  if num_shards < 1:
    raise ValueError(f"num_shards must be positive, got {num_shards}")
  if num_shards == 1:
    return np.arange(seq_len, dtype=np.int32)
  if seq_len % (2 * num_shards):
    raise ValueError(f"sequence length {seq_len} is not divisible into 2 x {num_shards} chunks")
  chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * num_shards, -1)
  return np.concatenate([np.concatenate([chunks[d], chunks[2 * num_shards - 1 - d]])
                         for d in range(num_shards)])


def causal_attention(q_BSNH, k_BSGH, v_BSGH, q_pos_BS, k_pos_BS) -> jax.Array:
  """Attention where query i sees key j iff k_pos[j] <= q_pos[i]; GQA (query head n uses key/value
  head n // (N/G)); scores scaled by 1/sqrt(H); softmax in float32; output in q's dtype. A query that
  sees no key gets zeros."""
  stats = _block(_group(q_BSNH, k_BSGH.shape[2]), k_BSGH, v_BSGH, q_pos_BS, k_pos_BS)
  return _finish(stats, q_BSNH)


def sharded_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, *, implementation: str,
                      axis_names: parallel.Axes) -> jax.Array:
  """Causal attention inside jax.shard_map over a sequence split over `axis_names`, by `implementation`
  (a key of IMPLEMENTATIONS; module docstring).

  q/k/v/pos are this device's rows of a sequence permuted by zigzag_order(S, n) (n: the product of the
  axes' sizes) and split contiguously over `axis_names` in that order (device index
  jax.lax.axis_index(axis_names)); pos_BS holds the rows' original positions. Heads are local. Returns
  this device's output rows, laid out like q. `zigzag_ring` relies on the zigzag layout, the others only
  on positions; `local` takes no axes."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown context-parallel attention {implementation!r}; known: {', '.join(IMPLEMENTATIONS)}")
  return IMPLEMENTATIONS[implementation](q_BSNH, k_BSGH, v_BSGH, pos_BS, axis_names)


def _local_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, axes):
  if axes:
    raise ValueError(f"local attention takes no mesh axes, got {axes}")
  return causal_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, pos_BS)


def _axis_size(axes: parallel.Axes) -> int:
  return int(np.prod([jax.lax.axis_size(a) for a in axes]))


def _group(q_BSNH, num_kv_heads: int) -> jax.Array:
  """[B, S, N, H] -> [B, S, G, N/G, H]: the query heads that share each key/value head."""
  b, s, n, h = q_BSNH.shape
  return q_BSNH.reshape(b, s, num_kv_heads, n // num_kv_heads, h)


def _block(q_BSGRH, k_BTGH, v_BTGH, q_pos_BS, k_pos_BT):
  """Online-softmax statistics of queries against one key block: (max, denominator, output), float32."""
  scale = q_BSGRH.shape[-1] ** -0.5
  s_BGRST = jnp.einsum("bsgrh,btgh->bgrst", q_BSGRH, k_BTGH, preferred_element_type=jnp.float32) * scale
  visible_BST = k_pos_BT[:, None, :] <= q_pos_BS[:, :, None]
  s_BGRST = jnp.where(visible_BST[:, None, None], s_BGRST, _MASKED)
  # The softmax does not depend on the running max; keeping it out of autodiff avoids ties' gradients.
  m_BGRS = jax.lax.stop_gradient(jnp.max(s_BGRST, axis=-1))
  p_BGRST = jnp.exp(s_BGRST - m_BGRS[..., None]) * visible_BST[:, None, None]
  o_BGRSH = jnp.einsum("bgrst,btgh->bgrsh", p_BGRST, v_BTGH.astype(jnp.float32))
  return m_BGRS, jnp.sum(p_BGRST, axis=-1), o_BGRSH


def _merge(a, b):
  (m_a, l_a, o_a), (m_b, l_b, o_b) = a, b
  m = jnp.maximum(m_a, m_b)
  w_a, w_b = jnp.exp(m_a - m), jnp.exp(m_b - m)
  return m, l_a * w_a + l_b * w_b, o_a * w_a[..., None] + o_b * w_b[..., None]


def _finish(stats, q_BSNH) -> jax.Array:
  _, l_BGRS, o_BGRSH = stats
  # In sharded_attention every query sees at least itself (l > 0); causal_attention with unrelated query
  # and key positions may leave a query nothing to see: it gets zeros, not 0/0.
  o_BGRSH = o_BGRSH / jnp.where(l_BGRS > 0, l_BGRS, 1.0)[..., None]
  b, s, n, h = q_BSNH.shape
  return jnp.moveaxis(o_BGRSH, 3, 1).reshape(b, s, n, h).astype(q_BSNH.dtype)


def _chunk_len(q_BSNH) -> int:
  """c: the length of each of the two zigzag chunks of a device's rows."""
  if q_BSNH.shape[1] % 2:
    raise ValueError(f"{q_BSNH.shape[1]} local rows are not the two zigzag chunks of equal length")
  return q_BSNH.shape[1] // 2


def _allgather_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, axes):
  c = _chunk_len(q_BSNH)
  n = _axis_size(axes)
  r = jax.lax.axis_index(axes)
  k_BTGH, v_BTGH, pos_BT = (jax.lax.all_gather(a, axes, axis=1, tiled=True) for a in (k_BSGH, v_BSGH, pos_BS))
  q_BSGRH = _group(q_BSNH, k_BSGH.shape[2])

  def attend(q_start, key_chunk):
    """Stats of the c queries from local row q_start against natural key chunk `key_chunk`."""
    # Natural chunk m is the first half of device m's rows if m < n, else the second half of device
    # 2n-1-m's: gathered rows [2m c, (2m+1) c) or [(4n-1-2m) c, (4n-2m) c).
    k_start = jnp.where(key_chunk < n, 2 * key_chunk, 4 * n - 1 - 2 * key_chunk) * c
    rows = lambda a, at: jax.lax.dynamic_slice_in_dim(a, at, c, axis=1)
    return _block(rows(q_BSGRH, q_start), rows(k_BTGH, k_start), rows(v_BTGH, k_start), rows(pos_BS, q_start),
                  rows(pos_BT, k_start))

  # Block j is (early, key chunk j) for j <= r, else (late, key chunk j-r-1). As 0 <= r < n, block 0 is
  # always early and blocks n..2n always late; only blocks 1..n-1 pick their query chunk at run time. The
  # online softmax does not depend on the order of the merges, so the static blocks go first.
  early = attend(0, 0)
  late = attend(c, n - r - 1)
  for j in range(n + 1, 2 * n + 1):
    late = _merge(late, attend(c, j - r - 1))
  for j in range(1, n):
    is_early = j <= r
    stats = attend(jnp.where(is_early, 0, c), jnp.where(is_early, j, j - r - 1))
    merged = _merge(_select(is_early, early, late), stats)
    early, late = _select(is_early, merged, early), _select(is_early, late, merged)
  stats = jax.tree.map(lambda e, l: jnp.concatenate([e, l], axis=3), early, late)  # [..., S, (H)]
  return _finish(stats, q_BSNH)


def _select(pred, a, b):
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _ring_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, axes):
  n = _axis_size(axes)
  shift = [(i, (i + 1) % n) for i in range(n)]
  q_BSGRH = _group(q_BSNH, k_BSGH.shape[2])
  block = (k_BSGH, v_BSGH, pos_BS)
  stats = None
  for step in range(n):
    new = _block(q_BSGRH, block[0], block[1], pos_BS, block[2])
    stats = new if stats is None else _merge(stats, new)
    if step < n - 1:  # the last block needs no onward transfer
      block = tuple(jax.lax.ppermute(a, axes, shift) for a in block)
  return _finish(stats, q_BSNH)


def _zigzag_ring_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, axes):
  """The `xla` ring (module docstring): transfers ahead of compute, causal quarter blocks only."""
  c = _chunk_len(q_BSNH)
  n = _axis_size(axes)
  r = jax.lax.axis_index(axes)
  shift = [(i, (i + 1) % n) for i in range(n)]
  q_BSGRH = _group(q_BSNH, k_BSGH.shape[2])
  rows = lambda a, at: jax.lax.dynamic_slice_in_dim(a, at, c, axis=1)

  def attend(q_start, block, k_start):
    """Stats of the c queries from local row q_start against the c keys from row k_start of `block`."""
    k_BTGH, v_BTGH, pos_BT = block
    return _block(rows(q_BSGRH, q_start), rows(k_BTGH, k_start), rows(v_BTGH, k_start), rows(pos_BS, q_start),
                  rows(pos_BT, k_start))

  block = (k_BSGH, v_BSGH, pos_BS)
  for step in range(n):
    # Sent before this step's blocks are computed and independent of them: the transfer overlaps them.
    # The last block needs no onward transfer.
    incoming = tuple(jax.lax.ppermute(a, axes, shift) for a in block) if step < n - 1 else None
    if step == 0:
      early = attend(0, block, 0)
      late = _merge(attend(c, block, 0), attend(c, block, c))
    else:
      (early, late), block = _after((early, late), block)
      src_is_earlier = (r - step) % n < r
      chunk = jnp.where(src_is_earlier, 0, c)
      stats = attend(chunk, block, 0)  # early q (src < r) or late q (src > r) x src's early keys
      merged = _merge(_select(src_is_earlier, early, late), stats)
      early, late = _select(src_is_earlier, merged, early), _select(src_is_earlier, late, merged)
      late = _merge(late, attend(c, block, chunk))  # late q x src's early (src < r) or late (src > r) keys
    block = incoming
  stats = jax.tree.map(lambda e, l: jnp.concatenate([e, l], axis=3), early, late)  # [..., S, (H)]
  return _finish(stats, q_BSNH)


def _after(done, operand):
  """(done, operand), the operand usable only once `done` is computed (module docstring). Use both
  results: XLA drops a barrier's operands whose results go unused, and with them the ordering."""
  return jax.lax.optimization_barrier((done, operand))


def _ulysses_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, axes):
  n = _axis_size(axes)
  g = k_BSGH.shape[2]
  if g % n:
    raise ValueError(f"Ulysses attention splits the {g} local key/value heads over {n} devices: "
                     "they must divide evenly")
  to_heads = lambda a: jax.lax.all_to_all(a, axes, 2, 1, tiled=True)  # [B, S/n, X, H] -> [B, S, X/n, H]
  pos_all = jax.lax.all_gather(pos_BS, axes, axis=1, tiled=True)
  o_BSNH = causal_attention(to_heads(q_BSNH), to_heads(k_BSGH), to_heads(v_BSGH), pos_all, pos_all)
  return jax.lax.all_to_all(o_BSNH, axes, 1, 2, tiled=True)


IMPLEMENTATIONS = {"local": _local_attention, "allgather": _allgather_attention, "ring": _ring_attention,
                   "zigzag_ring": _zigzag_ring_attention, "ulysses": _ulysses_attention}


# The parallel op models call: the functions above wrapped in shard_map under the active plan.


def attention(q_BSNH: jax.Array, k_BSGH: jax.Array, v_BSGH: jax.Array, positions_BS: jax.Array) -> jax.Array:
  """Causal GQA attention by positions; with the sequence split over devices (`act_attn_seq`), as the
  active plan says. The sequence must be in the plan's `sequence_order`."""
  plan = current()
  if plan is None:
    return causal_attention(q_BSNH, k_BSGH, v_BSGH, positions_BS, positions_BS)
  q_spec = plan.activation_spec(QUERY_AXES)
  kv_spec = plan.activation_spec(("act_batch", "act_attn_seq", "act_kv_heads", None))
  axes = plan.attention_axes()
  pos_spec = parallel.spec_of(parallel.dim_axes(q_spec, 0), axes)
  implementation = plan.attention().implementation

  def body(q, k, v, pos):
    return sharded_attention(q, k, v, pos, implementation=implementation, axis_names=axes)

  return parallel.shard_map(plan, body, (q_spec, kv_spec, kv_spec, pos_spec), q_spec)(
      q_BSNH, k_BSGH, v_BSGH, positions_BS)

