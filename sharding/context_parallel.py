"""Context-parallel causal attention: attention over a sequence split across devices.

Layout. When the rules split the sequence inside attention (`act_attn_seq`) over n devices, the train step
permutes each sequence into zigzag order (`zigzag_order`, from the plan's `sequence_order`) before the model
sees it: cut into 2n chunks, device d holds chunks d and 2n-1-d. Causal attention's work grows with a query's
position, so an early and a late chunk give every device the same amount. Positions travel with the tokens and
causality follows them (key j is visible to query i iff pos_j <= pos_i), so any order is correct; zigzag only
balances the work.

Kinds (`parallel.attention`), for a device r of n holding Sl = S/n = 2c rows of q, k, v:
- `allgather`: all-gather K, V and positions over the sequence axes ([B, S, G, H] each), then compute only
  the causal c x c blocks: the early chunk r needs key chunks 0..r, the late chunk 2n-1-r needs
  0..2n-1-r, so 2n+1 blocks on every device (against 4n for the full square). Blocks 0 (early) and n..2n
  (late) are the same kind on every device; blocks 1..n-1 are early on some and late on others, chosen at
  run time from r. The blocks after the first two run in two loops (`lax.fori_loop`): the program holds
  four blocks whatever n (unrolled, the blocks were 40% of a small model's compile time on CPU). Memory:
  the gathered K/V. Communication: (n-1)/n of the gathered K/V per layer, and a reduce-scatter of their
  gradients (all_gather's transpose) in the backward pass.
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
merge the steps' score matmuls into one that waits for every transfer, as it does for the reference tier's ring.
Bytes moved are the plain ring's. `allgather` (already causal) and `ulysses` (all-to-alls of whole
tensors, nothing to overlap within the op) run the same implementation in every tier.

Documents (data.document_mask). Packed rows hold several documents; a query then also carries its
document's start, the position of the document's first token, and key j is visible to query i iff
start_i <= pos_j <= pos_i. Documents are contiguous in the original order, so this is "same document and
causal". Only queries carry a start: the key side is unchanged, so the all-gather and the rings move nothing
more, and Ulysses gathers the starts like the positions. Every kind and kernel applies the same bound; the
layout still decides which blocks are computed (a block whose keys precede a query's document is masked,
not skipped: which documents a row holds is data, and the blocks' shapes are static).

Blocks accumulate with an online softmax in float32 (running max, denominator and output). The merge is
commutative and masks with a large finite negative number, so a fully masked block contributes exactly
zero and never a NaN (-inf - -inf). The running max is kept out of autodiff: the result does not depend
on it.

Kernels (`sharded_attention(..., kernel=)`, the plan's `kernel_backend` for attention). Without one (CPU,
float32, `parallel.attention_kernel="einsum"`) each block is the einsum above: its float32 [B, G, R, Sq,
Sk] scores and probabilities are in memory. With one, tokamax's flash attention (attention_kernels.py:
Mosaic GPU on sm90/sm100, Pallas Triton on sm80; its plain-XLA version on CPU, for checks) computes every
block in on-chip tiles, and the same kinds run:
- `local`, `ulysses`: one causal kernel call over the whole sequence in order (Ulysses puts its gathered
  zigzag rows back in order, whole chunks at a time, and the output back), differentiated by the
  kernel's own backward;
- `allgather`, `zigzag_ring`: the same c x c blocks, each diagonal block causal and every other one full
  (no per-element mask: the layout decides which keys a chunk sees). The all-gather kind takes this
  device's own two chunks first (early and late diagonal, late x early), then 2n-2 full blocks whose
  query chunk (early for the first r, else late) and key chunk are chosen at run time; the zigzag ring's
  blocks are those above. Blocks of one shape and mask at one step are one kernel call, stacked on a
  leading axis (context parallelism makes blocks short; one launch keeps the GPU busy);
- `ring`: per step, all 2c queries against each of the block's two key chunks, masked by position (the
  kernels take, per query, the position minus the chunk's first key position, for keys at consecutive
  positions): dense like its einsum version.
Each kernel call returns its normalised output and softmax statistics (row max m, denominator l); blocks
merge with the online softmax, into float32 accumulators of this device's rows. The backward is a
custom VJP: per block, the kernel's backward with the merged output, m and l of the block's queries (so
its p is the merged softmax's share and its dq, dk, dv the block's terms); for the rings, K/V gradients
travel back round the ring (n-1 transfers, the forward ring's transpose), the forward's K/V blocks kept
as residuals like autodiff of the einsum ring keeps them. The kernel path relies on the layout: original
positions consecutive (the train step's 0..S-1), `local`'s rows in order.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshmoe.sharding import attention_kernels, parallel
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


def causal_attention(q_BSNH, k_BSGH, v_BSGH, q_pos_BS, k_pos_BS, q_starts_BS=None) -> jax.Array:
  """Attention where query i sees key j iff k_pos[j] <= q_pos[i] (and q_starts[i] <= k_pos[j], given
  document starts); GQA (query head n uses key/value head n // (N/G)); scores scaled by 1/sqrt(H); softmax
  in float32; output in q's dtype. A query that sees no key gets zeros."""
  stats = _block(_group(q_BSNH, k_BSGH.shape[2]), k_BSGH, v_BSGH, q_pos_BS, k_pos_BS, q_starts_BS)
  return _finish(stats, q_BSNH)


def sharded_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, *, implementation: str,
                      axis_names: parallel.Axes, kernel: str = "", starts_BS=None) -> jax.Array:
  """Causal attention inside jax.shard_map over a sequence split over `axis_names`, by `implementation`
  (a key of IMPLEMENTATIONS; module docstring), its blocks computed by `kernel`: "" for the einsum blocks,
  else a kernel of attention_kernels.KERNELS (tokamax's flash attention; module docstring, "Kernels").

  q/k/v/pos are this device's rows of a sequence permuted by zigzag_order(S, n) (n: the product of the
  axes' sizes) and split contiguously over `axis_names` in that order (device index
  jax.lax.axis_index(axis_names)); pos_BS holds the rows' original positions and starts_BS, if given, the
  positions of their documents' first tokens (module docstring, "Documents"). Heads are local. Returns
  this device's output rows, laid out like q. `zigzag_ring` relies on the zigzag layout, the others only
  on positions; `local` takes no axes. With a kernel, every implementation relies on the layout: the
  original positions are consecutive (0..S-1 for the train step), `local`'s rows in order."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown context-parallel attention {implementation!r}; known: {', '.join(IMPLEMENTATIONS)}")
  if kernel:
    if kernel not in attention_kernels.KERNELS:
      raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(attention_kernels.KERNELS)}")
    return _FLASH_IMPLEMENTATIONS[implementation](q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axis_names, kernel)
  return IMPLEMENTATIONS[implementation](q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axis_names)


def _local_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes):
  if axes:
    raise ValueError(f"local attention takes no mesh axes, got {axes}")
  return causal_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, pos_BS, starts_BS)


def _axis_size(axes: parallel.Axes) -> int:
  return int(np.prod([jax.lax.axis_size(a) for a in axes]))


def _group(q_BSNH, num_kv_heads: int) -> jax.Array:
  """[B, S, N, H] -> [B, S, G, N/G, H]: the query heads that share each key/value head."""
  b, s, n, h = q_BSNH.shape
  return q_BSNH.reshape(b, s, num_kv_heads, n // num_kv_heads, h)


def _block(q_BSGRH, k_BTGH, v_BTGH, q_pos_BS, k_pos_BT, q_starts_BS=None):
  """Online-softmax statistics of queries against one key block: (max, denominator, output), float32."""
  scale = q_BSGRH.shape[-1] ** -0.5
  s_BGRST = jnp.einsum("bsgrh,btgh->bgrst", q_BSGRH, k_BTGH, preferred_element_type=jnp.float32) * scale
  visible_BST = k_pos_BT[:, None, :] <= q_pos_BS[:, :, None]
  if q_starts_BS is not None:
    visible_BST &= k_pos_BT[:, None, :] >= q_starts_BS[:, :, None]
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


def _allgather_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes):
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
    rows = lambda a, at: None if a is None else jax.lax.dynamic_slice_in_dim(a, at, c, axis=1)
    return _block(rows(q_BSGRH, q_start), rows(k_BTGH, k_start), rows(v_BTGH, k_start), rows(pos_BS, q_start),
                  rows(pos_BT, k_start), rows(starts_BS, q_start))

  # Block j is (early, key chunk j) for j <= r, else (late, key chunk j-r-1). As 0 <= r < n, block 0 is
  # always early and blocks n..2n always late; only blocks 1..n-1 pick their query chunk at run time. The
  # online softmax does not depend on the order of the merges, so the static blocks go first.
  early = attend(0, 0)
  late = attend(c, n - r - 1)
  late = jax.lax.fori_loop(n + 1, 2 * n + 1, lambda j, late: _merge(late, attend(c, j - r - 1)), late)

  def either(j, carry):
    early, late = carry
    is_early = j <= r
    stats = attend(jnp.where(is_early, 0, c), jnp.where(is_early, j, j - r - 1))
    merged = _merge(_select(is_early, early, late), stats)
    return _select(is_early, merged, early), _select(is_early, late, merged)

  early, late = jax.lax.fori_loop(1, n, either, (early, late))
  stats = jax.tree.map(lambda e, l: jnp.concatenate([e, l], axis=3), early, late)  # [..., S, (H)]
  return _finish(stats, q_BSNH)


def _select(pred, a, b):
  return jax.tree.map(lambda x, y: jnp.where(pred, x, y), a, b)


def _ring_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes):
  n = _axis_size(axes)
  shift = [(i, (i + 1) % n) for i in range(n)]
  q_BSGRH = _group(q_BSNH, k_BSGH.shape[2])
  block = (k_BSGH, v_BSGH, pos_BS)
  stats = None
  for step in range(n):
    new = _block(q_BSGRH, block[0], block[1], pos_BS, block[2], starts_BS)
    stats = new if stats is None else _merge(stats, new)
    if step < n - 1:  # the last block needs no onward transfer
      block = tuple(jax.lax.ppermute(a, axes, shift) for a in block)
  return _finish(stats, q_BSNH)


def _zigzag_ring_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes):
  """The `xla` ring (module docstring): transfers ahead of compute, causal quarter blocks only."""
  c = _chunk_len(q_BSNH)
  n = _axis_size(axes)
  r = jax.lax.axis_index(axes)
  shift = [(i, (i + 1) % n) for i in range(n)]
  q_BSGRH = _group(q_BSNH, k_BSGH.shape[2])
  rows = lambda a, at: None if a is None else jax.lax.dynamic_slice_in_dim(a, at, c, axis=1)

  def attend(q_start, block, k_start):
    """Stats of the c queries from local row q_start against the c keys from row k_start of `block`."""
    k_BTGH, v_BTGH, pos_BT = block
    return _block(rows(q_BSGRH, q_start), rows(k_BTGH, k_start), rows(v_BTGH, k_start), rows(pos_BS, q_start),
                  rows(pos_BT, k_start), rows(starts_BS, q_start))

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


def _ulysses_attention(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes):
  n = _axis_size(axes)
  _check_ulysses_heads(k_BSGH.shape[2], n)
  to_heads = lambda a: jax.lax.all_to_all(a, axes, 2, 1, tiled=True)  # [B, S/n, X, H] -> [B, S, X/n, H]
  gather = lambda a: None if a is None else jax.lax.all_gather(a, axes, axis=1, tiled=True)
  pos_all = gather(pos_BS)
  o_BSNH = causal_attention(to_heads(q_BSNH), to_heads(k_BSGH), to_heads(v_BSGH), pos_all, pos_all,
                            gather(starts_BS))
  return jax.lax.all_to_all(o_BSNH, axes, 1, 2, tiled=True)



def _check_ulysses_heads(g: int, n: int) -> None:
  if g % n:
    raise ValueError(f"Ulysses attention splits the {g} local key/value heads over {n} devices: "
                     "they must divide evenly")


IMPLEMENTATIONS = {"local": _local_attention, "allgather": _allgather_attention, "ring": _ring_attention,
                   "zigzag_ring": _zigzag_ring_attention, "ulysses": _ulysses_attention}


# The kernel path: the same kinds with every block computed by tokamax's flash attention
# (attention_kernels.py; module docstring, "Kernels").


def _flash_local(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes, kernel):
  if axes:
    raise ValueError(f"local attention takes no mesh axes, got {axes}")
  # Rows in order (sharded_attention): positions are row indices, and so are the documents' starts.
  return attention_kernels.causal(q_BSNH, k_BSGH, v_BSGH, kernel, starts_BS)


def _flash_ulysses(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes, kernel):
  n = _axis_size(axes)
  _check_ulysses_heads(k_BSGH.shape[2], n)
  c = _chunk_len(q_BSNH)
  to_heads = lambda a: jax.lax.all_to_all(a, axes, 2, 1, tiled=True)  # [B, S/n, X, H] -> [B, S, X/n, H]
  # The rows are now the whole sequence in zigzag order; the kernel wants it in order: whole chunks move.
  order = zigzag_order(2 * n, n)  # zigzag chunk i is natural chunk order[i]
  chunks = lambda a, perm: a.reshape(a.shape[0], 2 * n, c, *a.shape[2:])[:, perm].reshape(a.shape)
  natural = lambda a: chunks(to_heads(a), np.argsort(order))
  starts = None if starts_BS is None else chunks(jax.lax.all_gather(starts_BS, axes, axis=1, tiled=True),
                                                 np.argsort(order))
  o_BSNH = chunks(attention_kernels.causal(natural(q_BSNH), natural(k_BSGH), natural(v_BSGH), kernel, starts),
                  order)
  return jax.lax.all_to_all(o_BSNH, axes, 1, 2, tiled=True)


def _flash_allgather(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes, kernel):
  # Gathered outside the blocks' custom VJP: autodiff reduce-scatters the gathered K/V's gradients.
  k_BTGH, v_BTGH, pos_BT = (jax.lax.all_gather(a, axes, axis=1, tiled=True) for a in (k_BSGH, v_BSGH, pos_BS))
  return _flash_blocks(q_BSNH, k_BTGH, v_BTGH, pos_BS, pos_BT, starts_BS, axes, kernel, "allgather")


def _flash_ring(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes, kernel):
  return _flash_blocks(q_BSNH, k_BSGH, v_BSGH, pos_BS, pos_BS, starts_BS, axes, kernel, "ring")


def _flash_zigzag_ring(q_BSNH, k_BSGH, v_BSGH, pos_BS, starts_BS, axes, kernel):
  return _flash_blocks(q_BSNH, k_BSGH, v_BSGH, pos_BS, pos_BS, starts_BS, axes, kernel, "zigzag_ring")


class _Block(NamedTuple):
  """Queries [q_start, q_start + q_len) of this device against keys [k_start, k_start + k_len) of the
  key/value source at hand; the starts may be traced. mask: "causal" (a diagonal block), "full", or
  "positions" (query i sees key j iff pos_j <= pos_i, for keys at consecutive positions)."""

  q_start: Any
  q_len: int
  k_start: Any
  k_len: int
  mask: str


def _schedule(kind: str, step: int, r, n: int, c: int) -> list[_Block]:
  """The blocks device r computes at `step` (module docstring): c x c blocks of the zigzag chunks, or for
  the plain ring both key chunks against all 2c queries, masked by position."""
  if kind == "ring":
    return [_Block(0, 2 * c, 0, c, "positions"), _Block(0, 2 * c, c, c, "positions")]
  if kind == "zigzag_ring":
    if step == 0:
      return [_Block(0, c, 0, c, "causal"), _Block(c, c, 0, c, "full"), _Block(c, c, c, c, "causal")]
    chunk = jnp.where((r - step) % n < r, 0, c)  # the source's device comes before this one: early q, k
    return [_Block(chunk, c, 0, c, "full"), _Block(c, c, chunk, c, "full")]
  # allgather, in gathered rows: this device's own two chunks (rows 2rc..2rc+2c) as in the zigzag ring's
  # first step, then 2n-2 full blocks: the early query chunk against natural chunks 0..r-1, the late one
  # against chunks 0..2n-2-r but r (block i is early iff i < r, so the query chunk is chosen at run time).
  own = 2 * r * c
  blocks = [_Block(0, c, own, c, "causal"), _Block(c, c, own, c, "full"), _Block(c, c, own + c, c, "causal")]
  for i in range(2 * n - 2):
    early = i < r
    key_chunk = jnp.where(early, i, jnp.where(i - r < r, i - r, i - r + 1))
    k_start = jnp.where(key_chunk < n, 2 * key_chunk, 4 * n - 1 - 2 * key_chunk) * c
    blocks.append(_Block(jnp.where(early, 0, c), c, k_start, c, "full"))
  return blocks


def _rows(a, start, length, axis=1):
  if isinstance(start, int) and start == 0 and length == a.shape[axis]:
    return a
  return jax.lax.dynamic_slice_in_dim(a, start, length, axis=axis)


def _add_rows(acc, start, update, axis=1):
  rows = _rows(acc, start, update.shape[axis], axis) + update.astype(acc.dtype)
  return jax.lax.dynamic_update_slice_in_dim(acc, rows, start, axis=axis)


def _groups(blocks: list[_Block]) -> list[list[_Block]]:
  """The blocks by shape and mask: each group is one kernel call, its blocks stacked on a leading axis (one
  launch of many tiles instead of many launches of few: context parallelism makes blocks short)."""
  groups: dict[tuple, list[_Block]] = {}
  for block in blocks:
    groups.setdefault((block.q_len, block.k_len, block.mask), []).append(block)
  return list(groups.values())


def _stacked(group: list[_Block]):
  """(rows of a query-side array, rows of a key-side array) of every block of `group`, stacked."""
  q_rows = lambda a, axis=1: jnp.stack([_rows(a, b.q_start, b.q_len, axis) for b in group])
  kv_rows = lambda a: jnp.stack([_rows(a, b.k_start, b.k_len) for b in group])
  return q_rows, kv_rows


def _kernel_mask(group: list[_Block], q_pos_BS, k_pos_BT, q_starts_BS):
  """The group's mask as attention_kernels takes it: "causal", "full", query offsets [blocks, B, Sq], or with
  documents the key range of each query, (first, end) [blocks, B, Sq] each, relative to the block's first
  key (keys at consecutive positions: a diagonal block's end is the causal one, a full block's is past
  its last key)."""
  if q_starts_BS is None and group[0].mask != "positions":
    return group[0].mask
  relative = lambda a: jnp.stack([_rows(a, b.q_start, b.q_len) - _rows(k_pos_BT, b.k_start, 1)  # first key
                                  for b in group]).astype(jnp.int32)
  if q_starts_BS is None:
    return relative(q_pos_BS)
  return attention_kernels.KeyRange(relative(q_starts_BS), relative(q_pos_BS) + 1)


def _per_query(x_BNS):
  """[B, N, S] statistics -> [B, S, N, 1], to scale outputs laid out [B, S, N, H]."""
  return jnp.swapaxes(x_BNS, 1, 2)[..., None]


def _merge_rows(stats, start, block_stats):
  """The online-softmax merge (as _merge) of one block's (normalised output, m, l) into rows from `start` of
  the running (m, l, unnormalised output). A row no block has reached yet has m = -inf."""
  m_BNS, l_BNS, o_BSNH = stats
  bo_BSNH, bm_BNS, bl_BNS = block_stats
  length = bo_BSNH.shape[1]
  m_a, l_a, o_a = _rows(m_BNS, start, length, 2), _rows(l_BNS, start, length, 2), _rows(o_BSNH, start, length)
  m = jnp.maximum(m_a, bm_BNS)
  finite = jnp.where(m == -jnp.inf, 0.0, m)  # both -inf: weights exp(-inf) = 0, not exp(nan)
  w_a, w_b = jnp.exp(m_a - finite), jnp.exp(bm_BNS - finite)
  l = l_a * w_a + bl_BNS * w_b
  o = o_a * _per_query(w_a) + bo_BSNH.astype(jnp.float32) * _per_query(bl_BNS * w_b)
  put = lambda acc, new, axis: jax.lax.dynamic_update_slice_in_dim(acc, new, start, axis=axis)
  return put(m_BNS, m, 2), put(l_BNS, l, 2), put(o_BSNH, o, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _flash_blocks(q_BSNH, k_BTGH, v_BTGH, q_pos_BS, k_pos_BT, q_starts_BS, axes, kernel, kind):
  """The blocks of `kind` ("allgather": one source, the gathered K/V; "ring", "zigzag_ring": the local
  K/V travelling round the ring), merged. Its backward calls the kernel's backward per block with the
  merged statistics (attention_kernels.py), the K/V gradients travelling back round the ring."""
  return _flash_blocks_fwd(q_BSNH, k_BTGH, v_BTGH, q_pos_BS, k_pos_BT, q_starts_BS, axes, kernel, kind)[0]


def _flash_blocks_fwd(q_BSNH, k_BTGH, v_BTGH, q_pos_BS, k_pos_BT, q_starts_BS, axes, kernel, kind):
  c = _chunk_len(q_BSNH)
  n = _axis_size(axes)
  r = jax.lax.axis_index(axes)
  steps = 1 if kind == "allgather" else n
  shift = [(i, (i + 1) % n) for i in range(n)]
  send = lambda source: tuple(jax.lax.ppermute(a, axes, shift) for a in source)
  b, s, heads, _ = q_BSNH.shape
  stats = (jnp.full((b, heads, s), -jnp.inf, jnp.float32), jnp.zeros((b, heads, s), jnp.float32),
           jnp.zeros(q_BSNH.shape, jnp.float32))
  source = (k_BTGH, v_BTGH, k_pos_BT)
  sources = []
  for step in range(steps):
    if kind == "zigzag_ring":  # as _zigzag_ring_attention: the next source leaves first, steps in order
      incoming = send(source) if step < steps - 1 else None
      if step:
        stats, source = _after(stats, source)
    sources.append(source)
    k, v, k_pos = source
    for group in _groups(_schedule(kind, step, r, n, c)):
      q_rows, kv_rows = _stacked(group)
      mask = _kernel_mask(group, q_pos_BS, k_pos, q_starts_BS)
      out = attention_kernels.forward(q_rows(q_BSNH), kv_rows(k), kv_rows(v), mask, kernel)
      for i, block in enumerate(group):
        stats = _merge_rows(stats, block.q_start, [a[i] for a in out])
    if step < steps - 1:
      source = incoming if kind == "zigzag_ring" else send(source)
  m_BNS, l_BNS, o_BSNH = stats
  o_BSNH = (o_BSNH / _per_query(jnp.where(l_BNS > 0, l_BNS, 1.0))).astype(q_BSNH.dtype)
  return o_BSNH, (q_BSNH, q_pos_BS, q_starts_BS, tuple(sources), o_BSNH, m_BNS, l_BNS)


def _flash_blocks_bwd(axes, kernel, kind, residuals, do_BSNH):
  q_BSNH, q_pos_BS, q_starts_BS, sources, o_BSNH, m_BNS, l_BNS = residuals
  c = _chunk_len(q_BSNH)
  n = _axis_size(axes)
  r = jax.lax.axis_index(axes)
  back = [(i, (i - 1) % n) for i in range(n)]
  dq = jnp.zeros(q_BSNH.shape, jnp.float32)
  arrived = None
  # Steps in reverse: step s's K/V gradients (for the source that came from device r - s) plus those that
  # device r + 1 computed for the same source at steps after s travel one device back, so after step 0
  # every device holds its own K/V's gradients: n - 1 transfers, the transpose of the forward ring's.
  for step in reversed(range(len(sources))):
    k, v, k_pos = sources[step]
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for group in _groups(_schedule(kind, step, r, n, c)):
      q_rows, kv_rows = _stacked(group)
      gq, gk, gv = attention_kernels.backward(
          q_rows(q_BSNH), kv_rows(k), kv_rows(v), _kernel_mask(group, q_pos_BS, k_pos, q_starts_BS), kernel,
          q_rows(o_BSNH), q_rows(m_BNS, 2), q_rows(l_BNS, 2), q_rows(do_BSNH))
      for i, block in enumerate(group):
        dq = _add_rows(dq, block.q_start, gq[i])
        dk, dv = _add_rows(dk, block.k_start, gk[i]), _add_rows(dv, block.k_start, gv[i])
    if arrived is not None:
      dk, dv = dk + arrived[0], dv + arrived[1]
    dk, dv = dk.astype(k.dtype), dv.astype(v.dtype)
    if step:
      arrived = tuple(jax.lax.ppermute(a, axes, back) for a in (dk, dv))
  return dq.astype(q_BSNH.dtype), dk, dv, None, None, None


_flash_blocks.defvjp(_flash_blocks_fwd, _flash_blocks_bwd)

_FLASH_IMPLEMENTATIONS = {"local": _flash_local, "allgather": _flash_allgather, "ring": _flash_ring,
                          "zigzag_ring": _flash_zigzag_ring, "ulysses": _flash_ulysses}


# The parallel op models call: the functions above wrapped in shard_map under the active plan.


def attention(q_BSNH: jax.Array, k_BSGH: jax.Array, v_BSGH: jax.Array, positions_BS: jax.Array,
              document_starts_BS: jax.Array | None = None) -> jax.Array:
  """Causal GQA attention by positions, within documents when their starts are given (module docstring);
  with the sequence split over devices (`act_attn_seq`), as the active plan says. The sequence must be in
  the plan's `sequence_order`."""
  plan = current()
  if plan is None:
    return causal_attention(q_BSNH, k_BSGH, v_BSGH, positions_BS, positions_BS, document_starts_BS)
  q_spec = plan.activation_spec(QUERY_AXES)
  kv_spec = plan.activation_spec(("act_batch", "act_attn_seq", "act_kv_heads", None))
  axes = plan.attention_axes()
  pos_spec = parallel.spec_of(parallel.dim_axes(q_spec, 0), axes)
  choice = plan.attention(q_BSNH.dtype, q_BSNH.shape[-1])

  def body(q, k, v, pos, starts=None):
    return sharded_attention(q, k, v, pos, implementation=choice.implementation, axis_names=axes,
                             kernel=choice.kernel_backend, starts_BS=starts)

  operands = [q_BSNH, k_BSGH, v_BSGH, positions_BS] + ([] if document_starts_BS is None else [document_starts_BS])
  specs = (q_spec, kv_spec, kv_spec) + (pos_spec,) * (len(operands) - 3)
  # tokamax's Mosaic GPU kernels cannot take operands that vary over mesh axes (parallel.shard_map).
  return parallel.shard_map(plan, body, specs, q_spec, check_vma=not choice.kernel_backend)(*operands)

