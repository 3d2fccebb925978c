"""Grouped GEMM + return to the owners, TPU-style: the protocol of PROTOCOL.md with remote DMAs and
semaphores.

It runs in Pallas' TPU interpreter on CPU devices (ring.INTERPRET_PARAMS), which is how the protocol is
tested without GPUs. Tile plan and legend: moe_routing.py.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshmoe.pallas_kernels import ring
from meshmoe.pallas_kernels.moe_routing import TilePlan
from meshmoe.pallas_kernels.ring import Axes

_SCALARS = ("recv_expert", "recv_src", "recv_src_tile", "num_recv", "num_send")


def gemm_return(hs: Sequence[jax.Array], weights: Sequence[jax.Array], plan: TilePlan, axes: Axes,
                interpret=ring.INTERPRET_PARAMS) -> jax.Array:
  """ret_SD, as reference.gemm_return. hs_i: [R, F_i]; weights_i: [E_l, F_i, D]."""
  p, n = ring.size(axes), len(hs)
  s_tiles, r_tiles = plan.send_dst.shape[0], plan.recv_expert.shape[0]
  tm, d, dtype = hs[0].shape[0] // r_tiles, weights[0].shape[2], hs[0].dtype
  scalars = [getattr(plan, name) for name in _SCALARS]
  ret_SD, _ = pl.pallas_call(
      functools.partial(_kernel, axes=axes, p=p, n=n, tm=tm, s_tiles=s_tiles),
      out_shape=[ring.out_type((s_tiles * tm, d), dtype, *hs, *weights, axes=axes),
                 # Each computed tile waits here until it has left: a send reads from memory that must
                 # stay put, and tiles go out as they are made, one buffer slot each.
                 ring.out_type((r_tiles * tm, d), dtype, *hs, *weights, axes=axes)],
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * len(scalars) + [pl.BlockSpec(memory_space=pl.ANY)] * (2 * n),
      out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
      scratch_shapes=[*(pltpu.VMEM((tm, h.shape[1]), dtype) for h in hs),
                      *(pltpu.VMEM(w.shape[1:], w.dtype) for w in weights),
                      pltpu.VMEM((tm, d), jnp.float32), pltpu.VMEM((tm, d), dtype),
                      pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((s_tiles,))],
      compiler_params=pltpu.CompilerParams(collective_id=0),
      interpret=interpret,
  )(*scalars, *hs, *weights)
  return ret_SD


def _kernel(*refs, axes: Axes, p: int, n: int, tm: int, s_tiles: int):
  recv_expert, recv_src, recv_src_tile, num_recv, num_send = refs[:5]
  h_refs, w_refs = refs[5:5 + n], refs[5 + n:5 + 2 * n]
  ret_ref, outgoing_ref = refs[5 + 2 * n:7 + 2 * n]
  h_vmems, w_vmems = refs[7 + 2 * n:7 + 3 * n], refs[7 + 3 * n:7 + 4 * n]
  acc_vmem, y_vmem, send_sem, recv_sems = refs[7 + 4 * n:]
  tile = lambda t: pl.ds(t * tm, tm)

  ring.barrier_with_all(axes)

  # 1. Compute each received tile and send it home at once, into the tile of the owner's buffer it
  #    came from, signalling that tile's semaphore there. Nothing here waits for a peer.
  def compute(m, carry):
    acc_vmem[...] = jnp.zeros_like(acc_vmem)
    for h_ref, w_ref, h_vmem, w_vmem in zip(h_refs, w_refs, h_vmems, w_vmems):
      pltpu.sync_copy(h_ref.at[tile(m)], h_vmem)
      pltpu.sync_copy(w_ref.at[recv_expert[m]], w_vmem)
      acc_vmem[...] += jnp.dot(h_vmem[...], w_vmem[...], preferred_element_type=jnp.float32)
    y_vmem[...] = acc_vmem[...].astype(y_vmem.dtype)
    pltpu.sync_copy(y_vmem, outgoing_ref.at[tile(m)])
    pltpu.make_async_remote_copy(outgoing_ref.at[tile(m)], ret_ref.at[tile(recv_src_tile[m])], send_sem,
                                 recv_sems.at[recv_src_tile[m]],
                                 device_id=ring.device(axes, recv_src[m])).start()
    return carry

  lax.fori_loop(0, num_recv[0], compute, 0)

  # 2. Wait for every tile I sent out to come back computed; zeros where I sent nothing.
  def returned(s, carry):
    _transfer(outgoing_ref, ret_ref, send_sem, recv_sems, tile, s, axes).wait_recv()
    return carry

  lax.fori_loop(0, num_send[0], returned, 0)
  y_vmem[...] = jnp.zeros_like(y_vmem)
  lax.fori_loop(num_send[0], s_tiles, lambda s, c: (pltpu.sync_copy(y_vmem, ret_ref.at[tile(s)]), c)[1], 0)

  # 3. My outgoing tiles must outlive their sends.
  def sent(m, carry):
    _transfer(outgoing_ref, ret_ref, send_sem, recv_sems, tile, 0, axes).wait_send()
    return carry

  lax.fori_loop(0, num_recv[0], sent, 0)


def _transfer(outgoing_ref, ret_ref, send_sem, recv_sems, tile, s, axes: Axes):
  """A descriptor of one tile's transfer into my returned tile s (see moe_dispatch_gemm.tpu._arrival)."""
  return pltpu.make_async_remote_copy(outgoing_ref.at[tile(0)], ret_ref.at[tile(s)], send_sem, recv_sems.at[s],
                                      device_id=ring.device(axes, ring.index(axes)))
