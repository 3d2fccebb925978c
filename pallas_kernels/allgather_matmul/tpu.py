"""all-gather + GEMM, TPU-style: the protocol of PROTOCOL.md with remote DMAs and DMA semaphores.

It runs in Pallas' TPU interpreter on CPU devices (ring.INTERPRET_PARAMS), which is how the protocol is
tested without GPUs; its buffers are whole blocks (the Mosaic GPU kernel tiles them).

Legend: P ring positions, M rows per device, K contraction, N output columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshmoe.pallas_kernels import ring
from meshmoe.pallas_kernels.ring import Axes


def allgather_matmul(x_MK: jax.Array, w_KN: jax.Array, axes: Axes,
                     interpret=ring.INTERPRET_PARAMS) -> tuple[jax.Array, jax.Array]:
  """(out_PMN, x_PMK): every device's block times w_KN, and the gathered blocks (for the backward)."""
  p = ring.size(axes)
  (m, k), n = x_MK.shape, w_KN.shape[1]
  steps = max(p - 1, 1)  # semaphore arrays cannot be empty
  return pl.pallas_call(
      lambda *refs: _kernel(*refs, axes=axes, p=p),
      out_shape=(ring.out_type((p, m, n), x_MK.dtype, x_MK, w_KN, axes=axes),
                 ring.out_type((p, m, k), x_MK.dtype, x_MK, w_KN, axes=axes)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
      out_specs=(pl.BlockSpec(memory_space=pl.ANY),) * 2,
      scratch_shapes=[pltpu.VMEM((m, k), x_MK.dtype), pltpu.VMEM((k, n), w_KN.dtype),
                      pltpu.VMEM((m, n), x_MK.dtype),
                      pltpu.SemaphoreType.DMA((steps,)), pltpu.SemaphoreType.DMA((steps,))],
      compiler_params=pltpu.CompilerParams(collective_id=0),
      interpret=interpret,
  )(x_MK, w_KN)


def _kernel(x_ref, w_ref, out_ref, gathered_ref, block_vmem, w_vmem, out_vmem, send_sems, recv_sems, *,
            axes: Axes, p: int):
  me = ring.index(axes)
  right = ring.device(axes, ring.shift(axes, 1))
  ring.barrier_with_left(axes)
  pltpu.sync_copy(w_ref, w_vmem)
  pltpu.sync_copy(x_ref, gathered_ref.at[me])  # my own block: slot `me`, never written by anyone else
  sends = []
  for step in range(p):
    block = jax.lax.rem(me - step + p, p)  # received from my left at the end of the step before
    if step < p - 1:  # forward it before computing with it: the transfer overlaps the matmul
      send = pltpu.make_async_remote_copy(gathered_ref.at[block], gathered_ref.at[block], send_sems.at[step],
                                          recv_sems.at[step], device_id=right)
      send.start()
      sends.append(send)
    pltpu.sync_copy(gathered_ref.at[block], block_vmem)
    out_vmem[...] = jnp.dot(block_vmem[...], w_vmem[...],
                            preferred_element_type=jnp.float32).astype(out_vmem.dtype)
    pltpu.sync_copy(out_vmem, out_ref.at[block])
    if step < p - 1:
      # The next block, from my left neighbour's send of this step: same shape, same semaphore index.
      sends[-1].wait_recv()
  for send in sends:  # my blocks must stay put until they have left
    send.wait_send()
