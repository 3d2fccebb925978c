"""The distributed optimizer's two copies of the weights (`mesh.optimizer_storage`: ZeRO-1, Megatron-Core's
"distributed optimizer").

Under it the train state's parameters are float32 master weights placed by the optimizer rules (split over
`data`, or over every axis, on top of where the weights lie; ParallelPlan.param_shardings), beside the Adam
moments, placed alike. A step:
1. makes the weights the model computes with (`resident`): the master cast to each weight's compute dtype and
   placed by the parameter rules (ParallelPlan.weight_shardings): one all-gather over the optimizer's storage
   axes per step, in the compute dtype;
2. runs every micro-batch on those weights and sums their gradients in a float32 accumulator
   (`accumulator_shardings`):
   - the layers' weights (stacked, used inside the layer loop): each layer's gradient is placed like its
     master in the layer loop's backward pass (sharding.shardings.with_optimizer_placed_gradients), so GPU
     compiles reduce-scatter each micro-batch's gradient into the master's slices there (XLA:CPU all-reduces
     it, then slices), where float32 weights stored whole have theirs all-reduced whole;
   - the weights outside the layer loop (the embedding and output tables, the final norm): their gradients
     are placed as the weights (sharding.shardings.with_weight_placed_gradients) and accumulated there,
     unsummed; XLA moves their sum out of the micro-batch loop: once per step (a reduce-scatter on GPUs).
     Two exceptions, XLA's: the embedding lookup's gradient (a scatter-add) is formed whole on every device
     and all-reduced over the token axes per micro-batch (at DeepSeek-V3's layout in sub-groups the cost
     model misses; as under weight storage `data`/`all`; cost_collectives.py counts the whole sum); and an
     output table stored split over token axes (tp_sp's vocabulary over `tensor`), which GSPMD gathers
     whole for the logits, has its gradient formed whole, reduce-scattered over those axes and summed over
     the rest per micro-batch (cost_collectives._output_table_gradient);
3. slices the sums to the master's placement and updates each slice of the master and the moments on the
   device that holds it.

Each weight's compute dtype (`compute_dtypes`) is the dtype its layer computes with, so the model computes
exactly what it computes from float32 weights: the model's dtype for the matrices, which every layer casts
to it; float32 for the norms' scales (models/layers.py), the router's kernel (its logits are float32,
models/router.py) and the vocabulary tables (the output logits are float32, models/output.py), all small.

The checkpoint holds the master (float32, as without a distributed optimizer) and the moments, so a
checkpoint moves between optimizer storages and weight storages as between any two layouts.

Why each micro-batch's gradient is still summed (Megatron-Core sums once per step): the devices that hold
different tokens of one weight each compute part of its gradient, and inside the MoE op (a shard_map) and
wherever XLA's partitioner writes a weight gradient, those parts are summed in that micro-batch's backward
pass. A partial sum has no place to wait in GSPMD's auto-sharded program: a weight held whole on several
devices holds one value on each, and so does its gradient. Deferring the sum would take every weight's
gradient GEMM into a manual region (per-replica copies, as sharding/gradient_sync.py makes for the experts'
compressed sum) and keep a float32 gradient per replica: 4 bytes per parameter where the accumulator here
holds 4 / N. What the distributed optimizer removes per micro-batch is the gathers of weight storage
`data`/`all` (storage "preset" holds the weights whole), and it halves the bytes of each gradient sum (a
reduce-scatter moves half an all-reduce's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from meshmoe.sharding.shardings import is_stacked

# Parameters whose layers compute in float32 whatever the model's dtype (module docstring).
_FLOAT32_LOGICAL_AXES = ("norm", "vocab")
_FLOAT32_MODULES = ("router",)


def compute_dtype(path: Sequence[str], logical_axes: Sequence[str | None], dtype: str) -> jnp.dtype:
  """The compute dtype of the parameter at `path` (its names from the model down) with these logical axis
  names: `dtype` (the model's), or float32 for the weights whose layers compute in float32."""
  if any(name in logical_axes for name in _FLOAT32_LOGICAL_AXES) or any(name in _FLOAT32_MODULES for name in path):
    return jnp.dtype(jnp.float32)
  return jnp.dtype(dtype)


def compute_dtypes(params: Any, dtype: str) -> Any:
  """Each parameter's `compute_dtype` (a tree like `params`, an nnx.State of the parameters)."""
  def of(path, variable: nnx.Variable) -> jnp.dtype:
    return compute_dtype(path_names(path), variable.get_metadata().get("logical_axes", ()), dtype)

  return jax.tree_util.tree_map_with_path(of, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def path_names(path) -> list[str]:
  """The names along a pytree key path of an nnx.State."""
  return [str(getattr(key, "key", key)) for key in path]


def resident(master: Any, dtypes: Any, shardings: Any) -> Any:
  """The weights the model computes with: `master` cast to `dtypes` and placed as `shardings` says
  (ParallelPlan.weight_shardings; inside a jitted step)."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  cast = jax.tree.map(lambda v, dtype: v.replace(v[...].astype(dtype)), master, dtypes, is_leaf=is_variable)
  return jax.lax.with_sharding_constraint(cast, shardings)


def accumulator_shardings(params: Any, master_shardings: Any, weight_shardings: Any) -> Any:
  """Where the step's float32 gradient sum of each parameter lies (module docstring, step 2): like its master
  for the layers' stacked weights (their logical axes start with `layers`), like the weight elsewhere."""
  stacked = jax.tree.map(lambda v: is_stacked(v.get_metadata().get("logical_axes", ())), params,
                         is_leaf=lambda x: isinstance(x, nnx.Variable))
  return jax.tree.map(lambda layers, master, weight: master if layers else weight, stacked, master_shardings,
                      weight_shardings)
