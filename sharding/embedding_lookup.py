"""The token embedding's lookup, with a backward pass that forms the table's gradient where it is stored.

jnp.take's gradient is a scatter-add of the tokens' gradients [T, D] into the [V, D] table. When the table
is stored split (V or D) over mesh axes that also split the tokens (V over `tensor` under `tp_sp`, D under
`mesh.weight_storage` "data"/"all"), GSPMD partitions that scatter by giving every device a partial sum of
the whole table and all-reducing it, once per micro-batch (compiled deviceless for H100s: Mixtral-8x7B on
64, 0.5 GB over 64 devices, 64 times a step; DeepSeek-V3 on 256, 3.7 GB, 480 times a step).

Here the backward instead moves the tokens' gradients to the table's layout: each device receives the
columns of its own D slice for the tokens of every device that holds the same table slice (the tokens
stay split over the token axes that the table does not split: `rest`), casts them to the table's dtype
and scatters them into its slice locally. What the devices along `rest` then hold are partial sums of
the same slice, which XLA sums where the gradient is placed (per micro-batch into the master's slices
under a distributed optimizer on GPUs). Moved per micro-batch: T / |rest| x D / |D axes| values in the
lookup's dtype and a V x D / |table axes| float32 sum over `rest`, where GSPMD moved V x D float32 values.

Single device, no active plan, or a table split over no token axis or along D exactly like the batch
(FSDP: GSPMD then looks up locally and all-to-alls, the same bytes): jnp.take as it is. A tied table
(models/layers.Embed decides) keeps jnp.take too: its gradient joins the output layer's, a partition
not compiled this way yet. The values are jnp.take's gradient's; with `rest` empty, bit for bit (each
device adds its columns in the same token order).
The cost model counts the same bytes (analysis/cost_collectives.py asks `gradient_layout`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from meshmoe.sharding import parallel
from meshmoe.sharding.shardings import current

TABLE = ("vocab", "embed")  # the table's logical axes
TOKENS = ("act_batch", "act_seq")  # the looked-up tokens' logical axes


class GradientLayout(NamedTuple):
  """Where the backward pass forms the table's gradient (module docstring)."""

  table: PartitionSpec  # the table's gradient [V, D]: as the table is stored
  tokens: PartitionSpec  # the tokens' gradients [T, D] once moved: T over `rest`, D as the table's
  rest: tuple[str, ...]  # token axes the table does not split: their devices' slices are partial sums
  # The token ids [B, S] as the model places them. Pinned in the forward pass: left free, the backward's
  # placement of them propagates into the forward's gather, which XLA's partitioner then fails on (a CHECK
  # in PartitionGatherOperandPassthroughDimensions, tp_sp 2x1x2x2, jax 0.11.2).
  ids: PartitionSpec = PartitionSpec()


def gradient_layout(plan) -> GradientLayout | None:
  """The layout of the table's gradient under `plan`, or None where jnp.take's own gradient is used
  (module docstring)."""
  table = plan.param_spec(TABLE)
  split = lambda axes: tuple(a for a in axes if plan.axis_size((a,)) > 1)
  vocab_axes, d_axes = split(parallel.dim_axes(table, 0)), split(parallel.dim_axes(table, 1))
  tokens = plan.activation_spec(TOKENS)
  batch_axes, seq_axes = split(parallel.dim_axes(tokens, 0)), split(parallel.dim_axes(tokens, 1))
  token_axes = batch_axes + seq_axes
  if not set(vocab_axes + d_axes) & set(token_axes):
    return None
  if set(d_axes) == set(batch_axes) and not seq_axes:  # GSPMD's local lookup (FSDP)
    return None
  rest = tuple(a for a in plan.mesh.axis_names if a in token_axes and a not in vocab_axes + d_axes)
  return GradientLayout(table, parallel.spec_of(rest, parallel.dim_axes(table, 1)), rest, tokens)


def lookup(table_VD: jax.Array, tokens_BS: jax.Array, dtype) -> jax.Array:
  """table_VD[tokens_BS] in `dtype`, its gradient formed in the table's layout under the active plan."""
  plan = current()
  layout = None if plan is None else gradient_layout(plan)
  if layout is None:
    return jnp.take(table_VD, tokens_BS, axis=0).astype(dtype)
  table = jax.ShapeDtypeStruct(table_VD.shape, table_VD.dtype)
  return _placed_lookup(table_VD, tokens_BS, jnp.dtype(dtype), (table.shape, table.dtype, plan.mesh, layout))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _placed_lookup(table_VD, tokens_BS, dtype, static):
  return jnp.take(table_VD, tokens_BS, axis=0).astype(dtype)


def _forward(table_VD, tokens_BS, dtype, static):
  _, _, mesh, layout = static
  tokens_BS = jax.lax.with_sharding_constraint(tokens_BS, NamedSharding(mesh, layout.ids))
  return _placed_lookup(table_VD, tokens_BS, dtype, static), tokens_BS


def _backward(dtype, static, tokens_BS, d_out_BSD):
  shape, table_dtype, mesh, layout = static
  placed = lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  d_out_TD = placed(d_out_BSD.reshape(-1, d_out_BSD.shape[-1]), layout.tokens)  # moved in the lookup's dtype
  tokens_T = placed(tokens_BS.reshape(-1), PartitionSpec(*layout.tokens[:1]))
  d_table_VD = placed(jnp.zeros(shape, table_dtype), layout.table).at[tokens_T].add(d_out_TD.astype(table_dtype))
  return placed(d_table_VD, layout.table), None


_placed_lookup.defvjp(_forward, _backward)
