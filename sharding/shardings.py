"""Turning logical axis names into shardings: parameters (from variable metadata) and activations.

Model code calls `constrain(x, ("act_batch", "act_seq", "act_embed"))`. Inside `use_rules(mesh, preset)`
that becomes a sharding constraint; outside it (a single device, a notebook) it does nothing. Parameters
carry their logical names as `logical_axes` metadata on each nnx.Variable.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshmoe.config import ParallelConfig
from meshmoe.sharding.rules import Preset, Rules, get_preset, logical_to_spec


@dataclasses.dataclass(frozen=True)
class ShardingContext:
  mesh: Mesh
  preset: Preset
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)  # parallel-op choices


_CURRENT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar("meshmoe_rules", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, preset: str | Preset,
              parallel: ParallelConfig | None = None) -> Iterator[ShardingContext]:
  """Activates `preset` on `mesh` (and the parallel-op choices) for model code traced inside the block."""
  ctx = ShardingContext(mesh, get_preset(preset) if isinstance(preset, str) else preset,
                        parallel or ParallelConfig())
  token = _CURRENT.set(ctx)
  try:
    yield ctx
  finally:
    _CURRENT.reset(token)


@contextlib.contextmanager
def per_device() -> Iterator[None]:
  """Deactivates the rules: for code traced inside a shard_map body, which sees per-device arrays."""
  token = _CURRENT.set(None)
  try:
    yield
  finally:
    _CURRENT.reset(token)


def current() -> ShardingContext | None:
  return _CURRENT.get()


def activation_sharding(logical_axes: Sequence[str | None]) -> NamedSharding | None:
  ctx = _CURRENT.get()
  if ctx is None:
    return None
  return NamedSharding(ctx.mesh, logical_to_spec(logical_axes, ctx.preset.activations))


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Constrains activation `x` to the sharding its logical axes get under the active rules."""
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


def param_shardings(state: Any, mesh: Mesh, preset: str | Preset) -> Any:
  preset = get_preset(preset) if isinstance(preset, str) else preset
  return named_shardings(state, mesh, preset.params)


def optimizer_shardings(state: Any, mesh: Mesh, preset: str | Preset) -> Any:
  """Shardings for optimizer state shaped like the parameters in `state` (ZeRO-1 splits it further)."""
  preset = get_preset(preset) if isinstance(preset, str) else preset
  return named_shardings(state, mesh, preset.optimizer_rules())


def batch_sharding(mesh: Mesh, preset: str | Preset) -> NamedSharding:
  """Sharding of a [batch, seq] token array under `preset`."""
  preset = get_preset(preset) if isinstance(preset, str) else preset
  return NamedSharding(mesh, logical_to_spec(("act_batch", "act_seq"), preset.activations))
