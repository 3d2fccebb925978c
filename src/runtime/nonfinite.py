"""NaN/Inf in the loss or the gradients: caught at the step it appears, never trained on.

Inside the jitted step (`guard`): the squared norm of every parameter's gradient is computed per layer
(a parameter of a LayerStack has a leading `layers` dimension), their sum gives the global gradient norm,
and a step whose loss or gradient norm is not finite keeps the state it started from (parameters,
optimizer moments, expert bias; the step counter and PRNG key still advance, as the batch is consumed).
The per-layer norms are a few dozen scalars, so they come back with the metrics at no cost and tell, when
a step goes bad, exactly which gradients were non-finite at that step.

On the host (`Monitor`): every step's `finite` flag is read one step late (while the next step runs).
Policy `skip` counts the step and goes on, up to `resilience.max_consecutive_skips` bad steps in a row;
policy `halt`, or too many in a row, raises `NonFiniteError` naming the step, the loss and gradient norm,
and the first parameter, in forward order (embedding, layers 0..L-1, final norm, unembedding), whose
gradient is non-finite, plus any parameter that is itself non-finite.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from meshmoe.config import ModelConfig, ResilienceConfig

# Top-level parameter groups of meshmoe.models.decoder.Transformer in the order the forward pass uses them.
_FORWARD_ORDER = ("embed", "dense_layers", "moe_layers", "final_norm", "unembed_DV")


class NonFiniteError(RuntimeError):
  """Training produced a NaN or Inf that the policy does not allow to skip."""


def leaf_names(params: Any) -> list[str]:
  """'moe_layers/layer/ffn/gate_EDF' for every parameter, in `jax.tree.leaves` order."""
  paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  names = [jax.tree_util.keystr(path, simple=True, separator="/") for path in paths]
  return [name.removesuffix("/value") for name in names]


def stacked_leaves(params: Any) -> list[bool]:
  """Whether each parameter (in leaves order) is a LayerStack's, with a leading `layers` dimension."""
  from meshmoe.sharding.shardings import is_stacked, logical_axes_of

  axes = jax.tree.leaves(logical_axes_of(params), is_leaf=lambda x: isinstance(x, tuple))
  return [is_stacked(a) for a in axes]


def squared_norms(grads: Any, stacked: Sequence[bool]) -> list[jax.Array]:
  """Per parameter, the squared norm of its gradient: [layers] for stacked parameters, else a scalar."""
  leaves = jax.tree.leaves(grads)
  return [jnp.sum(jnp.square(g), axis=tuple(range(1, g.ndim)) if s else None)
          for g, s in zip(leaves, stacked, strict=True)]


def guard(finite: jax.Array, update: Callable[..., Any], state: tuple) -> Any:
  """update(*state) where the step was finite, else `state` unchanged (on device). A `cond`, not a select
  of the two: a select reads the old and the new state everywhere and keeps the old one alive through
  the update, which cost 13% of a CPU step on MaxText's tiny-MoE shape."""
  return jax.lax.cond(finite, update, lambda *state: state, *state)


class Monitor:
  """Reads each step's `finite` flag and applies `resilience.nan_policy`."""

  def __init__(self, cfg: ResilienceConfig, model: ModelConfig, params: Any, skipped_steps: int = 0):
    self.cfg, self.skipped_steps, self._in_a_row = cfg, skipped_steps, 0
    self._names, self._stacked = leaf_names(params), stacked_leaves(params)
    self._num_dense = model.num_dense_layers

  def check(self, step: int, metrics: dict, params: Any) -> None:
    """`step` is the 1-based number of the step that produced `metrics`; `params` the current ones."""
    if bool(metrics["finite"]):
      self._in_a_row = 0
      return
    self.skipped_steps += 1
    self._in_a_row += 1
    report = self.diagnose(step, metrics, params)
    if self.cfg.nan_policy == "skip" and self._in_a_row <= self.cfg.max_consecutive_skips:
      print(f"warning: {report}; update skipped ({self.skipped_steps} skipped so far, "
            f"resilience.nan_policy='skip')", flush=True)
      return
    why = ("resilience.nan_policy='halt'" if self.cfg.nan_policy == "halt" else
           f"{self._in_a_row} non-finite steps in a row > resilience.max_consecutive_skips="
           f"{self.cfg.max_consecutive_skips}")
    raise NonFiniteError(f"{report}; stopped ({why}). The state was not updated at this step; the newest "
                         "checkpoint holds the last good one")

  def diagnose(self, step: int, metrics: dict, params: Any) -> str:
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    bad_grads = self._non_finite([np.asarray(x) for x in metrics["grad_sq_norms"]])
    line = f"step {step}: non-finite training step (loss={loss:.6g}, grad_norm={grad_norm:.6g})"
    if bad_grads:
      line += (f"; first non-finite gradient: {bad_grads[0]} ({len(bad_grads)} parameter tensors or layers "
               "with non-finite gradients)")
    bad_params = self._non_finite(_finite_flags(params, self._stacked), flags=True)
    line += "; non-finite parameters: " + (", ".join(bad_params[:5]) if bad_params else "none")
    return line

  def _non_finite(self, values: list[np.ndarray], flags: bool = False) -> list[str]:
    """Names of the non-finite entries (per layer for stacked parameters), in forward order."""
    found = []
    for leaf, (name, value, stacked) in enumerate(zip(self._names, values, self._stacked, strict=True)):
      ok = value if flags else np.isfinite(value)
      group = name.split("/")[0]
      position = _FORWARD_ORDER.index(group) if group in _FORWARD_ORDER else len(_FORWARD_ORDER)
      offset = self._num_dense if group == "moe_layers" else 0
      for layer, good in enumerate(np.atleast_1d(ok)):
        if not good:
          label = f"{name} (layer {offset + layer})" if stacked else name
          found.append(((position, layer if stacked else 0, leaf), label))
    return [label for _, label in sorted(found)]


def _finite_flags(params: Any, stacked: Sequence[bool]) -> list[np.ndarray]:
  """Per parameter (per layer when stacked), whether all its values are finite; run by every process."""
  leaves = jax.tree.leaves(params)
  replicated = jax.sharding.NamedSharding(leaves[0].sharding.mesh, jax.sharding.PartitionSpec())
  check = jax.jit(lambda leaves: [jnp.all(jnp.isfinite(x), axis=tuple(range(1, x.ndim)) if s else None)
                                  for x, s in zip(leaves, stacked, strict=True)], out_shardings=replicated)
  return [np.asarray(f) for f in check(leaves)]
