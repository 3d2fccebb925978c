"""MoE dispatch + grouped GEMM, TPU-style: the protocol of PROTOCOL.md with remote DMAs and semaphores.

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

_SCALARS = ("send_dst", "send_dst_tile", "num_send", "recv_expert", "num_recv")


def dispatch_gemm(xs_SD: jax.Array, weights: Sequence[jax.Array], plan: TilePlan, axes: Axes,
                  interpret=ring.INTERPRET_PARAMS) -> tuple[jax.Array, ...]:
  """(xr_RD, *products), as reference.dispatch_gemm. weights_i: [E_l, D, F_i]."""
  p, n = ring.size(axes), len(weights)
  s_tiles, r_tiles = plan.send_dst.shape[0], plan.recv_expert.shape[0]
  tm, d = xs_SD.shape[0] // s_tiles, xs_SD.shape[1]
  widths = [w.shape[2] for w in weights]
  scalars = [getattr(plan, name) for name in _SCALARS]
  out_shape = [ring.out_type((r_tiles * tm, d), xs_SD.dtype, xs_SD, *weights, axes=axes)]
  out_shape += [ring.out_type((r_tiles * tm, f), xs_SD.dtype, xs_SD, *weights, axes=axes) for f in widths]
  return tuple(pl.pallas_call(
      functools.partial(_kernel, axes=axes, p=p, n=n, tm=tm, r_tiles=r_tiles),
      out_shape=out_shape,
      in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM)] * len(scalars) + [pl.BlockSpec(memory_space=pl.ANY)] * (1 + n),
      out_specs=[pl.BlockSpec(memory_space=pl.ANY)] * (1 + n),
      scratch_shapes=[pltpu.VMEM((tm, d), xs_SD.dtype), *(pltpu.VMEM((d, f), w.dtype) for f, w in zip(widths, weights)),
                      *(pltpu.VMEM((tm, f), xs_SD.dtype) for f in widths),
                      pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((r_tiles,))],
      compiler_params=pltpu.CompilerParams(collective_id=0),
      interpret=interpret,
  )(*scalars, xs_SD, *weights))


def _kernel(*refs, axes: Axes, p: int, n: int, tm: int, r_tiles: int):
  send_dst, send_dst_tile, num_send, recv_expert, num_recv, xs_ref = refs[:6]
  w_refs, (xr_ref, *out_refs) = refs[6:6 + n], refs[6 + n:7 + 2 * n]
  x_vmem, w_vmems, out_vmems = refs[7 + 2 * n], refs[8 + 2 * n:8 + 3 * n], refs[8 + 3 * n:8 + 4 * n]
  send_sem, recv_sems = refs[8 + 4 * n:]
  tile = lambda t: pl.ds(t * tm, tm)

  ring.barrier_with_all(axes)

  # 1. Send: each of my tiles into its tile of the receiver's buffer, signalling that tile's semaphore
  #    there. Nothing here waits for a peer.
  def send(s, carry):
    pltpu.make_async_remote_copy(xs_ref.at[tile(s)], xr_ref.at[tile(send_dst_tile[s])], send_sem,
                                 recv_sems.at[send_dst_tile[s]],
                                 device_id=ring.device(axes, send_dst[s])).start()
    return carry

  lax.fori_loop(0, num_send[0], send, 0)

  # 2. Compute: each receive tile as soon as its own semaphore says it has landed.
  def compute(m, carry):
    _arrival(xs_ref, xr_ref, send_sem, recv_sems, tile, m, axes).wait_recv()
    pltpu.sync_copy(xr_ref.at[tile(m)], x_vmem)
    for w_ref, w_vmem, out_vmem, out_ref in zip(w_refs, w_vmems, out_vmems, out_refs):
      pltpu.sync_copy(w_ref.at[recv_expert[m]], w_vmem)
      out_vmem[...] = jnp.dot(x_vmem[...], w_vmem[...], preferred_element_type=jnp.float32).astype(out_vmem.dtype)
      pltpu.sync_copy(out_vmem, out_ref.at[tile(m)])
    return carry

  lax.fori_loop(0, num_recv[0], compute, 0)

  # 3. Unused tiles: zeros (no peer writes them).
  x_vmem[...] = jnp.zeros_like(x_vmem)
  for out_vmem in out_vmems:
    out_vmem[...] = jnp.zeros_like(out_vmem)

  def zero(m, carry):
    pltpu.sync_copy(x_vmem, xr_ref.at[tile(m)])
    for out_vmem, out_ref in zip(out_vmems, out_refs):
      pltpu.sync_copy(out_vmem, out_ref.at[tile(m)])
    return carry

  lax.fori_loop(num_recv[0], r_tiles, zero, 0)

  # 4. My send buffer must outlive my sends.
  def sent(s, carry):
    _arrival(xs_ref, xr_ref, send_sem, recv_sems, tile, 0, axes).wait_send()
    return carry

  lax.fori_loop(0, num_send[0], sent, 0)


def _arrival(xs_ref, xr_ref, send_sem, recv_sems, tile, m, axes: Axes):
  """A descriptor of one tile's transfer into my receive tile m. Waiting on its receive side waits for
  that tile; on its send side, for one of my tiles to have left (every transfer is one tile, so any
  tile's descriptor measures the same amount)."""
  return pltpu.make_async_remote_copy(xs_ref.at[tile(0)], xr_ref.at[tile(m)], send_sem, recv_sems.at[m],
                                      device_id=ring.device(axes, ring.index(axes)))
