"""The `xla` tier's MoE schedule: dispatch -> expert GEMM -> combine over chunks of a device's tokens.

An expert-parallel MoE layer (sharding/expert_parallel.py) is three stages per device, each waiting for the
one before: `send` (sort the assignments, exchange group sizes, exchange the tokens), `compute` (the grouped
expert GEMM over the received rows) and `receive` (return the outputs to their senders, combine them into
the tokens). Run once, every all-to-all waits for compute or compute waits for it.

Here a device's T tokens are cut into C contiguous chunks (C = `moe_chunks`, at most T; sizes differ by at
most one token, e.g. 10 tokens in 3 chunks: 3, 3, 4), unrolled in Python with static shapes. Every chunk
runs all three stages on its own: its own group-size exchange, token exchange, grouped GEMM and return
exchange. A token's output depends on its own assignments only, so the concatenated chunk outputs are the
same function as one pass over all tokens, forward and gradients. The chunks are independent, so with
asynchronous collectives (XLA's all-to-all-start/done, ragged-all-to-all-start/done on GPU) chunk i's GEMM
can run while chunk i+1's tokens arrive and chunk i-1's outputs leave:

    send:     s0  s1  s2
    compute:      c0  c1  c2
    receive:          r0  r1  r2

One ordering is imposed: chunk i's GEMM starts after chunk i-1's (an optimization barrier ties chunk i's
received rows to chunk i-1's GEMM output). Without it XLA sees C independent GEMMs on the same weights and
merges them into one (GPU dot merging), which must wait for every chunk's dispatch: no overlap at all. The
barrier's transpose orders the backward the same way, last chunk first.

Sizes, for T tokens per device split into chunks of T_c (sum T_c = T), ep devices holding the experts, D the
model width, S = T*min(K, E/ep) the slot one peer can fill (expert_parallel.peer_slot): each chunk's receive
buffer (and on CPU its padded return buffer; GPUs return into the chunk's own rows) is ep x S_c rows instead
of ep x S, so one chunk's padded buffers (CPU), and the blocks the blocked CPU GEMM computes in one go, shrink
by about C (how many chunks' buffers are live at once is the scheduler's choice). Bytes each device moves per
call are the reference tier's: the tokens there and back, 2 x (ep-1) x S x D elements of their dtype on CPU (the
padded slots for the other devices; on GPU ragged_all_to_all sends only the real rows, twice), plus one
group-size all_to_all of (ep-1) x E/ep int32 per chunk, where the reference tier has one in all. The backward pass
moves the same again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Send = Callable[[jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]  # (x_TD, experts_TK, weights_TK)
Compute = Callable[[jax.Array, Any], jax.Array]  # (received_RD, route) -> y_RD
Receive = Callable[[jax.Array, Any], jax.Array]  # (y_RD, route) -> y_TD


def num_chunks(num_tokens: int, chunks: int) -> int:
  """The chunks `pipelined` cuts `num_tokens` tokens into when asked for `chunks`: at most one per token."""
  return max(1, min(chunks, num_tokens))


def chunk_bounds(num_tokens: int, chunks: int) -> list[int]:
  """Token offsets of `chunks` contiguous chunks (clamped to num_tokens), sizes differing by at most one."""
  chunks = num_chunks(num_tokens, chunks)
  return [num_tokens * i // chunks for i in range(chunks + 1)]


def chunk_sizes(num_tokens: int, chunks: int) -> list[int]:
  """Tokens in each chunk (chunk_bounds' differences)."""
  bounds = chunk_bounds(num_tokens, chunks)
  return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def pipelined(send: Send, compute: Compute, receive: Receive, x_TD: jax.Array, experts_TK: jax.Array,
              weights_TK: jax.Array, chunks: int) -> jax.Array:
  """receive(compute(send(tokens))) over `chunks` chunks of the tokens, pipelined; one chunk is the plain
  composition (the reference tier). `send` returns (received_RD, route); route is any pytree the chunk's
  compute and receive read."""
  bounds = chunk_bounds(x_TD.shape[0], chunks)
  if len(bounds) == 2:
    received_RD, route = send(x_TD, experts_TK, weights_TK)
    return receive(compute(received_RD, route), route)
  sent = [send(x_TD[lo:hi], experts_TK[lo:hi], weights_TK[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
  outputs = []
  for received_RD, route in sent:
    if outputs:
      # Chunk i's GEMM after chunk i-1's: keeps the GEMMs apart (see the module docstring) while chunk
      # i+1's dispatch and chunk i-1's return stay free to run beside it.
      received_RD, outputs[-1] = jax.lax.optimization_barrier((received_RD, outputs[-1]))
    outputs.append(compute(received_RD, route))
  return jnp.concatenate([receive(y_RD, route) for y_RD, (_, route) in zip(outputs, sent)])
