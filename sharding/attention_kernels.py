"""tokamax's flash attention for context_parallel.py: causal attention in one call, and one block of queries
against one block of keys, forward with its softmax statistics and backward from merged ones.

The kernels (`kernel`, the plan's `kernel_backend` for attention): "mosaic" (tokamax's Pallas Mosaic GPU
flash attention, forward on sm80/sm90/sm100 and backward on sm90/sm100), "triton" (its Pallas Triton
flash attention, forward and backward, for sm80) and "xla" (its plain-XLA version: dense scores, only to
check the blocked path and its merging on CPU). Each takes q [B, Sq, N, H] against k, v [B, Sk, G, H] with
N a multiple of G (query head n uses key/value head n // (N/G)), scales scores by 1/sqrt(H) and keeps
its softmax in float32, like context_parallel.causal_attention. The flash kernels tile the scores in
on-chip memory: no [B, N, Sq, Sk] buffer is written.

A block's mask is one of
- "causal": the block is on the diagonal, query i sees key j iff j <= i;
- "full": every query sees every key;
- an int32 array [B, Sq] of offsets: query i sees key j iff j <= offset[i] (positions: the query's position
  minus that of the block's first key, for keys at consecutive positions). The kernels turn it into a
  per-query end of the keys (tokamax's q_indices with is_causal), never into a [Sq, Sk] mask;
- a KeyRange (first, end), int32 [B, Sq] each: query i sees key j iff first[i] <= j < end[i] (documents:
  keys of the query's document up to its position; tokamax's Mask k_start / k_end, which its kernels
  reduce per tile of queries, skipping tiles no query sees).

`forward` returns the block's normalised output and its softmax statistics (the row maximum m of the
scaled scores and the denominator l, float32 [B, N, Sq]); context_parallel.py merges blocks with them.
`backward` takes the merged output, m and l of the block's queries: with them the kernel's
p = exp(s - m) / l is the merged softmax's share of this block, so its dq, dk and dv are the block's terms
of the full gradient (the backward of ring attention). The kernels' own backward ignores the
statistics' cotangents, which is why blocks that are merged are differentiated this way and not through
the kernel's custom VJP.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend import backend


KERNELS = ("mosaic", "triton", "xla")
GPU_KERNELS = ("mosaic", "triton")
DTYPES = (jnp.bfloat16, jnp.float16)  # what the GPU kernels take (they compute in bf16/f16 on tensor cores)
MAX_HEAD_DIM = 256  # Mosaic GPU: larger heads exceed the shared memory of an H100 (q, k and v tiles)


class KeyRange(NamedTuple):
  """The keys each query sees: first[i] <= j < end[i] (int32, [..., B, Sq] each)."""

  first: jax.Array
  end: jax.Array


def unsupported(kernel: str, dtype, head_dim: int) -> str | None:
  """Why `kernel` cannot run attention over operands of `dtype` with heads of `head_dim`, or None."""
  if kernel not in GPU_KERNELS:
    return None
  if jnp.dtype(dtype) not in DTYPES:
    return f"tokamax's flash attention takes bfloat16/float16, not {jnp.dtype(dtype).name}"
  if head_dim > MAX_HEAD_DIM:
    return f"head_dim={head_dim} exceeds tokamax's flash attention's {MAX_HEAD_DIM}"
  return None


@functools.cache
def _op(kernel: str):
  """tokamax's attention op for `kernel`. tokamax is imported here, when a kernel is first traced: importing
  it takes seconds (its autotuning and quantization modules), which every process would pay at start-up.
  tokamax 0.0.17 exports these ops only through tokamax.ops.gpu, which needs jax-triton for other ops."""
  from tokamax._src.ops.attention import base, pallas_mosaic_gpu, pallas_triton

  if kernel == "mosaic":
    return pallas_mosaic_gpu.PallasMosaicGpuFlashAttention()
  if kernel == "triton":
    return pallas_triton.PallasTritonFlashAttention()
  if kernel == "xla":
    return base.DotProductAttention(vjp=base.DotProductAttentionVjp())
  raise ValueError(f"unknown attention kernel {kernel!r}; known: {', '.join(KERNELS)}")


def _check_device(kernel: str) -> None:
  if kernel in GPU_KERNELS and backend.get_default_device().platform != "gpu":
    # tokamax picks its kernel variant from the default device, which is this machine's CPU when compiling
    # for GPUs deviceless.
    raise RuntimeError(f"tokamax's {kernel} attention kernels are chosen for the default device, which is "
                       f"{backend.get_default_device()}: lower programs for GPUs you do not have inside "
                       "meshmoe.analysis.deviceless.targeting(mesh)")


def _mask_args(mask) -> dict:
  if isinstance(mask, KeyRange):
    from tokamax._src.ops.attention.base import Mask

    return {"mask": Mask(k_start=mask.first[..., None, :], k_end=mask.end[..., None, :])}  # [..., B, 1, Sq]
  if isinstance(mask, str):
    if mask not in ("causal", "full"):
      raise ValueError(f"unknown block mask {mask!r}: 'causal', 'full' or an array of offsets")
    return {"is_causal": True} if mask == "causal" else {}
  return {"is_causal": True, "q_indices": mask[..., None, :]}  # [..., B, 1 (every head), Sq]


def causal(q_BSNH, k_BSGH, v_BSGH, kernel: str, starts_BS=None) -> jax.Array:
  """Causal attention over one sequence whose rows are in order (query i sees keys 0..i, from starts[i]
  on when documents' starts are given), differentiable (the kernel's own backward)."""
  _check_device(kernel)
  if starts_BS is None:
    return _op(kernel)(q_BSNH, k_BSGH, v_BSGH, is_causal=True)
  from tokamax._src.ops.attention.base import Mask

  return _op(kernel)(q_BSNH, k_BSGH, v_BSGH, mask=Mask(k_start=starts_BS[:, None, :].astype(jnp.int32),
                                                      is_causal=True))


def forward(q_BSNH, k_BTGH, v_BTGH, mask, kernel: str):
  """(normalised output [B, S, N, H] in q's dtype, m [B, N, S], l [B, N, S]) of one block (module
  docstring). A query that sees no key of the block gets l = 0 and an m that loses every merge."""
  _check_device(kernel)
  o_BSNH, (m_BNS, l_BNS) = _op(kernel)(q_BSNH, k_BTGH, v_BTGH, return_residuals=True, **_mask_args(mask))
  return o_BSNH, m_BNS.astype(jnp.float32), l_BNS.astype(jnp.float32)


def backward(q_BSNH, k_BTGH, v_BTGH, mask, kernel: str, o_BSNH, m_BNS, l_BNS, do_BSNH):
  """(dq, dk, dv) of one block, given the merged output, statistics and output cotangent of its queries
  (module docstring)."""
  if kernel == "xla":
    return _xla_backward(q_BSNH, k_BTGH, v_BTGH, mask, o_BSNH, m_BNS, l_BNS, do_BSNH)
  _check_device(kernel)
  op = _op(kernel)
  kwargs = dict(op.bind(q_BSNH, k_BTGH, v_BTGH, **_mask_args(mask)).kwargs)
  kwargs.pop("return_residuals")
  grads = op.vjp((m_BNS, l_BNS), o_BSNH, do_BSNH, q_BSNH, k_BTGH, v_BTGH, **kwargs)
  return grads["q"], grads["k"], grads["v"]


def _xla_backward(q_BSNH, k_BTGH, v_BTGH, mask, o_BSNH, m_BNS, l_BNS, do_BSNH):
  """The GPU kernels' block backward in plain XLA (dense scores; for CPU checks). tokamax's own XLA VJP
  differentiates its forward with the statistics substituted, which takes the softmax's row sum of
  p * dp over this block's keys only; the kernels take delta = rowsum(o * do) of the merged output, which
  is what a block of a merged softmax needs. Leading axes before B are batch axes too."""
  lead = q_BSNH.shape[:-4]
  if lead:
    flat = lambda a, rank: a.reshape(-1, *a.shape[len(a.shape) - rank:])
    mask = mask if isinstance(mask, str) else jax.tree.map(lambda a: flat(a, 1), mask)
    grads = _xla_backward(flat(q_BSNH, 3), flat(k_BTGH, 3), flat(v_BTGH, 3), mask, flat(o_BSNH, 3),
                          flat(m_BNS, 2), flat(l_BNS, 2), flat(do_BSNH, 3))
    return tuple(g.reshape(like.shape) for g, like in zip(grads, (q_BSNH, k_BTGH, v_BTGH)))
  b, s, n, h = q_BSNH.shape
  t, g = k_BTGH.shape[1], k_BTGH.shape[2]
  scale = h ** -0.5
  f32 = lambda a: a.astype(jnp.float32)
  q_BSGRH = f32(q_BSNH).reshape(b, s, g, n // g, h)
  do_BSGRH = f32(do_BSNH).reshape(b, s, g, n // g, h)
  s_BGRST = jnp.einsum("bsgrh,btgh->bgrst", q_BSGRH, f32(k_BTGH)) * scale
  if isinstance(mask, str):
    visible_BST = (jnp.tril(jnp.ones((s, t), bool)) if mask == "causal" else jnp.ones((s, t), bool))[None]
  elif isinstance(mask, KeyRange):
    keys = jnp.arange(t)[None, None, :]
    visible_BST = (keys >= mask.first[:, :, None]) & (keys < mask.end[:, :, None])
  else:
    visible_BST = jnp.arange(t)[None, None, :] <= mask[:, :, None]
  stat = lambda x_BNS: x_BNS.reshape(b, g, n // g, s)[..., None]
  p_BGRST = jnp.where(visible_BST[:, None, None], jnp.exp(s_BGRST - stat(m_BNS)) / stat(l_BNS), 0.0)
  dp_BGRST = jnp.einsum("bsgrh,btgh->bgrst", do_BSGRH, f32(v_BTGH))
  delta_BGRS = jnp.einsum("bsgrh,bsgrh->bgrs", f32(o_BSNH).reshape(b, s, g, n // g, h), do_BSGRH)
  ds_BGRST = p_BGRST * (dp_BGRST - delta_BGRS[..., None]) * scale
  dq = jnp.einsum("bgrst,btgh->bsgrh", ds_BGRST, f32(k_BTGH)).reshape(b, s, n, h)
  dk = jnp.einsum("bgrst,bsgrh->btgh", ds_BGRST, q_BSGRH)
  dv = jnp.einsum("bgrst,bsgrh->btgh", p_BGRST, do_BSGRH)
  return dq.astype(q_BSNH.dtype), dk.astype(k_BTGH.dtype), dv.astype(v_BTGH.dtype)
