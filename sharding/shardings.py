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
