"""GEMM + reduce-scatter, TPU-style: the protocol of PROTOCOL.md with remote DMAs and DMA semaphores.

It runs in Pallas' TPU interpreter on CPU devices (ring.INTERPRET_PARAMS), which is how the protocol is
tested without GPUs; its buffers are whole blocks (the Mosaic GPU kernel tiles them).

Legend: P ring positions, M rows per device, K this device's share of the contraction, N output columns.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from meshmoe.pallas_kernels import ring
from meshmoe.pallas_kernels.ring import Axes


def matmul_reducescatter(y_PMK: jax.Array, w_KN: jax.Array, axes: Axes,
                         interpret=ring.INTERPRET_PARAMS) -> jax.Array:
  """out_MN: the sum over the ring of every device's y_PMK[me] @ w_KN, in y's dtype."""
  p = ring.size(axes)
  (_, m, k), n = y_PMK.shape, w_KN.shape[1]
  if y_PMK.shape[0] != p:
    raise ValueError(f"y_PMK has {y_PMK.shape[0]} blocks for a ring of {p} devices")
  steps = max(p - 1, 1)  # buffers and semaphore arrays cannot be empty
  out_MN, _, _ = pl.pallas_call(
      lambda *refs: _kernel(*refs, axes=axes, p=p),
      out_shape=(ring.out_type((m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes),
                 # Per step: the partial sum I send, and the one I receive. Outputs, so that they live in
                 # memory my neighbours can write to; each slot is written once.
                 ring.out_type((steps, m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes),
                 ring.out_type((steps, m, n), y_PMK.dtype, y_PMK, w_KN, axes=axes)),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
      out_specs=(pl.BlockSpec(memory_space=pl.ANY),) * 3,
      scratch_shapes=[pltpu.VMEM((m, k), y_PMK.dtype), pltpu.VMEM((k, n), w_KN.dtype),
                      pltpu.VMEM((m, n), jnp.float32), pltpu.VMEM((m, n), y_PMK.dtype),
                      pltpu.SemaphoreType.DMA((steps,)), pltpu.SemaphoreType.DMA((steps,))],
      compiler_params=pltpu.CompilerParams(collective_id=0),
      interpret=interpret,
  )(y_PMK, w_KN)
  return out_MN


def _kernel(y_ref, w_ref, out_ref, sent_ref, received_ref, y_vmem, w_vmem, acc_vmem, wire_vmem, send_sems,
            recv_sems, *, axes: Axes, p: int):
  me = ring.index(axes)
  right = ring.device(axes, ring.shift(axes, 1))
  ring.barrier_with_left(axes)
  pltpu.sync_copy(w_ref, w_vmem)
  sends = []
  for step in range(p):
    # The partial sum for device `destination` starts one hop after it and reaches it after p - 1 hops.
    destination = jax.lax.rem(me - step - 1 + 2 * p, p)
    pltpu.sync_copy(y_ref.at[destination], y_vmem)
    acc_vmem[...] = jnp.dot(y_vmem[...], w_vmem[...], preferred_element_type=jnp.float32)
    if step > 0:  # add what my left neighbour sent at the step before (its own matmul did not wait)
      sends[-1].wait_recv()
      pltpu.sync_copy(received_ref.at[step - 1], wire_vmem)
      acc_vmem[...] += wire_vmem[...].astype(jnp.float32)
    wire_vmem[...] = acc_vmem[...].astype(wire_vmem.dtype)
    if step == p - 1:
      pltpu.sync_copy(wire_vmem, out_ref)  # destination == me: every device's share is in
    else:
      pltpu.sync_copy(wire_vmem, sent_ref.at[step])
      send = pltpu.make_async_remote_copy(sent_ref.at[step], received_ref.at[step], send_sems.at[step],
                                          recv_sems.at[step], device_id=right)
      send.start()
      sends.append(send)
  for send in sends:
    send.wait_send()
