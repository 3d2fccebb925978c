"""The optimizer: global-norm clipping, then `optimizer.name`'s rule (optax's own: nothing here writes an
update rule) with a learning-rate schedule and a weight-decay mask (`make_optimizer`).

Parameters and optimizer state are float32 (the model keeps float32 parameters, cast in each layer), the
statistics bfloat16 where `optimizer.moments_dtype` says so (`statistics_stored_in`). Weight
decay, times the learning rate for every rule, applies to matrices; norms, biases and embeddings only when
the config says so (`parameter_kind`). Which weights Muon updates, as which matrices: `muon_dimension_numbers`.

The schedule is a function of optax's update count (the updates applied so far: 0 for the first), so a
step skipped for a non-finite gradient (runtime/nonfinite.py) leaves the rate where it was, and the rate
the train step logs (`applied_updates` before the update) is the one the update used. Update n of the
warmup (n = count + 1) runs at peak * n / warmup_steps: the first update moves the parameters.
"""

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from meshmoe.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """The rate of the update after `count` applied ones: the linear warmup, then `cfg.schedule` (OptimizerConfig)
  over the remaining updates, the last of which (count = total_steps - 1) runs at the end rate."""
  peak, warmup = cfg.learning_rate, cfg.warmup_steps
  end = peak * cfg.min_learning_rate_ratio
  if cfg.schedule == "constant":
    after = optax.constant_schedule(peak)
  elif cfg.schedule == "cosine":  # from the peak at the first update after the warmup to `end` at the last
    after = _decay("cosine", peak, end, total_steps - warmup)
  else:  # "wsd": the peak until the last `decay_fraction` of the steps, then the decay
    decay_steps = max(1, round(cfg.decay_fraction * total_steps))
    stable_steps = max(total_steps - decay_steps - warmup, 0)
    decay = _decay(cfg.decay_shape, peak, end, min(decay_steps, total_steps - warmup))
    after = optax.join_schedules([optax.constant_schedule(peak), decay], [stable_steps])
  if warmup == 0:
    return after
  return optax.join_schedules([lambda count: peak * (count + 1) / warmup, after], [warmup])


def _decay(shape: str, peak: float, end: float, steps: int) -> optax.Schedule:
  """From `peak` at count 0 to `end` at count steps - 1 (`end` throughout when steps <= 1), shaped linear, as
  half a cosine, or as 1 - sqrt."""
  if steps <= 1:
    return optax.constant_schedule(end)
  span = steps - 1
  if shape == "linear":
    return optax.linear_schedule(peak, end, span)
  if shape == "cosine":
    return optax.cosine_decay_schedule(peak, span, end / peak)
  return lambda count: end + (peak - end) * (1 - jnp.sqrt(jnp.clip(count / span, 0.0, 1.0)))


def applied_updates(opt_state: Any) -> jax.Array:
  """How many updates the optimizer has applied (its schedule's count; skipped steps do not count). Muon's
  two rules each keep one; every applied update advances both."""
  of_schedule = lambda path, _: getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"
  counts = optax.tree_utils.tree_get_all_with_path(opt_state, "count", filtering=of_schedule)
  return counts[0][1]


def parameter_kind(path, variable: nnx.Variable) -> str:
  """"norm", "bias", "table" (embedding or output), "router" or "matrix": what decides a parameter's weight
  decay and, under Muon, its rule (module docstring)."""
  axes, names = variable.get_metadata().get("logical_axes", ()), _key_names(path)
  if "norm" in axes:
    return "norm"
  if "bias" in names[-1].lower():
    return "bias"
  if "vocab" in axes:
    return "table"
  if "router" in names:
    return "router"
  return "matrix"


def weight_decay_mask(params: Any, cfg: OptimizerConfig) -> Any:
  """True for every parameter weight decay applies to (same tree structure as `params`)."""
  decays = {"norm": cfg.decay_norms, "bias": cfg.decay_biases, "table": cfg.decay_embeddings, "router": True,
            "matrix": True}
  return _per_parameter(lambda path, variable: decays[parameter_kind(path, variable)], params)


# Axes that stack independent matrices (the layers of a scanned stack, the experts of a layer): Muon
# orthogonalises each of their matrices on its own.
_MUON_BATCH_AXES = ("layers", "exp")


def muon_dimension_numbers(params: Any) -> Any:
  """Per parameter (a tree like `params`): how Muon (optax.contrib.muon, which orthogonalises each weight
  matrix's momentum) sees it as matrices, as optax's MuonDimensionNumbers (reduction axes x output axes, the
  rest batch axes); None for the parameters AdamW updates with optimizer.name="adamw"'s settings: tables,
  norms, biases and the router (whose columns are the experts' scores, not a map to orthogonalise).

  The stacked layer axis and the experts' axis are batch axes, so each layer's and each expert's matrix is
  orthogonalised on its own. A weight's axes that project back into the residual stream (a last `embed`
  axis) are one side of its matrix and the others the other, so [heads, head_dim] stays one side."""

  def of(path, variable: nnx.Variable) -> optax.contrib.MuonDimensionNumbers | None:
    axes = variable.get_metadata().get("logical_axes", ())
    matrix_axes = [i for i, name in enumerate(axes) if name not in _MUON_BATCH_AXES]
    if parameter_kind(path, variable) != "matrix" or len(matrix_axes) < 2:
      return None
    # A projection back into the residual stream ([heads, head_dim, embed], [mlp, embed]) reduces over all
    # but its last axis; any other ([embed, heads, head_dim], [kv_lora, heads, head_dim]) over its first.
    split = len(matrix_axes) - 1 if axes[matrix_axes[-1]] == "embed" else 1
    return optax.contrib.MuonDimensionNumbers(tuple(matrix_axes[:split]), tuple(matrix_axes[split:]))

  return _per_parameter(of, params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int, params: Any) -> optax.GradientTransformation:
  """`cfg.name`'s rule for `params` (their tree, possibly abstract), after global-norm clipping."""
  schedule = learning_rate_schedule(cfg, total_steps)
  decay_mask = weight_decay_mask(params, cfg)
  adamw = lambda: optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                              mask=decay_mask)
  if cfg.name == "adamw":
    rule = adamw()
  elif cfg.name == "muon":
    dimension_numbers = muon_dimension_numbers(params)
    labels = jax.tree.map(lambda dims: "adamw" if dims is None else "muon", dimension_numbers,
                          is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))
    muon = optax.contrib.muon(schedule, beta=cfg.muon_beta, weight_decay=cfg.weight_decay,
                              consistent_rms=cfg.muon_update_rms,
                              muon_weight_dimension_numbers=lambda _: dimension_numbers)
    rule = optax.partition({"muon": muon, "adamw": adamw()}, labels)
  elif cfg.name == "adafactor":  # its decay is not multiplied by the rate unless given as a schedule
    rule = optax.adafactor(schedule, weight_decay_rate=lambda count: cfg.weight_decay * schedule(count),
                           weight_decay_mask=decay_mask)
  else:
    rule = optax.lion(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
  if cfg.moments_dtype != "float32":
    rule = statistics_stored_in(rule, jnp.dtype(cfg.moments_dtype), params)
  if cfg.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), rule)
  return rule


def statistics_stored_in(rule: optax.GradientTransformation, dtype, params: Any) -> optax.GradientTransformation:
  """`rule` with its statistics of the parameters (`parameter_of`: moments, momentum; not its counts or
  Muon's coefficients) kept in `dtype` between updates: each update widens them to float32, runs `rule`,
  and rounds the new ones to nearest (`optimizer.moments_dtype`)."""
  owner = parameter_of(params)

  def cast(state, to):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(to) if owner(path) is not None and jnp.issubdtype(x.dtype, jnp.floating) else x,
        state)

  def init(params):
    return cast(rule.init(params), dtype)

  def update(updates, state, params=None, **extra):
    updates, state = rule.update(updates, cast(state, jnp.float32), params, **extra)
    return updates, cast(state, dtype)

  return optax.GradientTransformationExtraArgs(init, update)


def parameter_of(params: Any):
  """path in an optimizer state -> the index (in jax.tree.leaves(params, is_leaf=nnx.Variable)) of the
  parameter whose statistic lies there, or None (counts, Muon's coefficients). optax's states hold trees
  shaped like the parameters, so a statistic's path ends with its parameter's path (and the variable's
  `value`). Matched by path: optax.tree_map_params cannot see through Muon's labels, which read the tree."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  index = {_key_names(path): i for i, (path, _) in
           enumerate(jax.tree_util.tree_flatten_with_path(params, is_leaf=is_variable)[0])}

  def of(path) -> int | None:
    names = _key_names(path)
    names = names[:-1] if names[-1:] == ("value",) else names
    return next((index[names[start:]] for start in range(len(names)) if names[start:] in index), None)

  return of


def statistic_shapes(cfg: OptimizerConfig, params: Any) -> list[list[tuple[int, ...]]]:
  """Per parameter (jax.tree.leaves(params, is_leaf=nnx.Variable) order): the shapes of the optimizer's
  statistics of it (AdamW: two of its shape; Lion one; Muon one for its matrices; Adafactor, for a factored
  weight, its shape less each of its two largest axes), read from optax's own state: the cost model's
  count of the optimizer's memory."""
  shapes = [[] for _ in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, nnx.Variable))]
  owner = parameter_of(params)
  for path, leaf in jax.tree_util.tree_flatten_with_path(jax.eval_shape(make_optimizer(cfg, 1, params).init,
                                                                        params))[0]:
    if (i := owner(path)) is not None:
      shapes[i].append(leaf.shape)
  return shapes


def statistic_spec(param_spec: tuple, param_shape: tuple[int, ...], shape: tuple[int, ...]) -> tuple | None:
  """Where a statistic of `shape` of a parameter whose state lies as `param_spec` says lies: like the
  parameter when shaped like it; without the axis reduced away when it lacks one of the parameter's axes
  (Adafactor's factored second moments); None (replicated) otherwise (Adafactor's placeholders)."""
  if shape == tuple(param_shape):
    return tuple(param_spec)
  spec = tuple(param_spec) + (None,) * (len(param_shape) - len(param_spec))
  for axis in range(len(param_shape)):
    if shape == tuple(param_shape[:axis]) + tuple(param_shape[axis + 1:]):
      return spec[:axis] + spec[axis + 1:]
  return None


def _key_names(path) -> tuple[str, ...]:
  return tuple(str(getattr(key, "key", getattr(key, "name", getattr(key, "idx", key)))) for key in path)


def _per_parameter(fn, params: Any) -> Any:
  """`fn(path, variable)` for every parameter of `params` (an nnx.State): a tree of its results."""
  return jax.tree_util.tree_map_with_path(fn, params, is_leaf=lambda x: isinstance(x, nnx.Variable))
