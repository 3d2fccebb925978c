"""Turning logical axis names into shardings, and the active parallel plan.

Model code calls `constrain(x, ("act_batch", "act_seq", "act_embed"))`. Inside `use_plan(plan)` that
becomes a sharding constraint under the plan's rules; outside it (a single device, a notebook) it does
nothing. Parameters carry their logical names as `logical_axes` metadata on each nnx.Variable. The
parallel ops read the plan that `use_plan` activates (`current`) to choose their implementation.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshmoe.sharding.rules import Rules, logical_to_spec

# The active meshmoe.sharding.plan.ParallelPlan (not imported: the plan module imports this one).
_CURRENT: contextvars.ContextVar[Any] = contextvars.ContextVar("meshmoe_plan", default=None)


@contextlib.contextmanager
def use_plan(plan) -> Iterator[Any]:
  """Activates `plan` (a ParallelPlan) for model code and parallel ops traced inside the block."""
  token = _CURRENT.set(plan)
  try:
    yield plan
  finally:
    _CURRENT.reset(token)


@contextlib.contextmanager
def per_device() -> Iterator[None]:
  """Deactivates the plan: for code traced inside a shard_map body, which sees per-device arrays."""
  token = _CURRENT.set(None)
  try:
    yield
  finally:
    _CURRENT.reset(token)


def current():
  """The active ParallelPlan, or None."""
  return _CURRENT.get()


def activation_sharding(logical_axes: Sequence[str | None]) -> NamedSharding | None:
  plan = _CURRENT.get()
  return None if plan is None else plan.activation_sharding(logical_axes)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Constrains activation `x` to the sharding its logical axes get under the active plan."""
  if x.ndim != len(logical_axes):
    raise ValueError(f"array of rank {x.ndim} given {len(logical_axes)} logical axes {logical_axes}")
  sharding = activation_sharding(logical_axes)
  return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


def _is_variable(x: Any) -> bool:
  return isinstance(x, nnx.Variable)


def logical_axes_of(state: Any) -> Any:
  """Maps every nnx.Variable in `state` to its `logical_axes` metadata (a tuple of names)."""

  def axes(v: nnx.Variable) -> tuple[str | None, ...]:
    names = v.get_metadata().get("logical_axes")
    if names is None:
      raise ValueError(f"variable {type(v).__name__} of shape {v.value.shape} has no logical_axes metadata")
    return tuple(names)

  return jax.tree.map(axes, state, is_leaf=_is_variable)


def partition_specs(state: Any, rules: Rules) -> Any:
  """PartitionSpec for every variable in `state` under `rules` (same tree structure)."""
  return jax.tree.map(lambda names: logical_to_spec(names, rules), logical_axes_of(state),
                      is_leaf=lambda x: isinstance(x, tuple))


def named_shardings(state: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedSharding for every variable in `state` under `rules` (same tree structure)."""
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), partition_specs(state, rules),
                      is_leaf=lambda x: isinstance(x, PartitionSpec))


def with_optimizer_placed_gradients(state: Any, stacked: bool = False) -> Any:
  """`state` (an nnx.State of parameters) unchanged, its gradient placed in the backward pass as the active
  plan's optimizer rules place the parameters, where the plan has a distributed optimizer
  (`mesh.optimizer_storage`; training/master_weights.py); otherwise `state` itself. `stacked`: `state` is
  one layer's slice of stacked parameters inside the layer loop (its logical axes still name `layers`).

  Why: a weight's gradient is a sum over the devices that hold different tokens. Placed split, XLA sums it
  straight into each device's slice where the gradient is formed (a reduce-scatter, inside the layer loop);
  left to the step's accumulator after the loop, XLA all-reduces each layer's gradient whole inside the loop
  and slices the sum afterwards."""
  return _with_placed_gradients(state, "optimizer", stacked)


def with_weight_placed_gradients(state: Any) -> Any:
  """`state` (an nnx.State of all the parameters) unchanged, the gradient of each parameter outside the layer
  loop placed as the weight is (the parameter rules), where the plan has a distributed optimizer. Its sum
  then waits in the step's accumulator, and XLA moves the all-reduce out of the micro-batch loop
  (training/master_weights.py). Placed like its master instead, Mixtral-8x7B's output table's gradient was
  formed whole on every device and all-reduced per micro-batch (compiled deviceless)."""
  return _with_placed_gradients(state, "weights", stacked=False, only=lambda logical: not is_stacked(logical))


def _with_placed_gradients(state: Any, rules: str, stacked: bool, only=lambda logical: True) -> Any:
  """`state` unchanged; in the backward pass the gradient of each parameter whose logical axes `only` accepts
  is constrained to the placement the plan's `rules` ("optimizer" or "weights") give it."""
  plan = _CURRENT.get()
  if plan is None or not plan.distributed_optimizer:
    return state
  spec_of = plan.optimizer_spec if rules == "optimizer" else plan.param_spec
  variables, treedef = jax.tree.flatten(state, is_leaf=_is_variable)
  logicals = [tuple(v.get_metadata()["logical_axes"]) for v in variables]
  shardings = [NamedSharding(plan.mesh, spec_of(logical[1:] if stacked else logical)) if only(logical)
               else None for logical in logicals]

  @jax.custom_vjp
  def identity(*arrays):
    return arrays

  def backward(_, cotangents):
    return tuple(g if s is None else jax.lax.with_sharding_constraint(g, s)
                 for g, s in zip(cotangents, shardings, strict=True))

  identity.defvjp(lambda *arrays: (arrays, None), backward)
  arrays = identity(*(v[...] for v in variables))
  return jax.tree.unflatten(treedef, [v.replace(a) for v, a in zip(variables, arrays, strict=True)])


def is_stacked(logical_axes: Sequence[str | None]) -> bool:
  """Whether a parameter with these logical axis names is a LayerStack's, with a leading `layers` dimension
  (the layer loop slices it)."""
  return bool(logical_axes) and logical_axes[0] == "layers"
