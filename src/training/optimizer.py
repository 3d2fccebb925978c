"""The optimizer: global-norm clipping, then AdamW with a learning-rate schedule and a weight-decay mask.

Parameters and optimizer state are float32 (the model keeps float32 parameters and casts to the compute
dtype inside each layer). Weight decay applies to matrices; norms, biases and embeddings are decayed only
when the config says so. A parameter is classified by its logical axis names (`norm` = a norm scale,
`vocab` = an embedding or output table) or, for biases, by its name.

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
  """How many updates the optimizer has applied (its schedule's count; skipped steps do not count)."""
  of_schedule = lambda path, _: getattr(path[-1], "tuple_name", "") == "ScaleByScheduleState"
  return optax.tree_utils.tree_get(opt_state, "count", filtering=of_schedule)


def weight_decay_mask(params: Any, cfg: OptimizerConfig) -> Any:
  """True for every parameter weight decay applies to (same tree structure as `params`)."""

  def decays(path, variable: nnx.Variable) -> bool:
    axes = variable.get_metadata().get("logical_axes", ())
    name = str(path[-1].key if hasattr(path[-1], "key") else path[-1])
    if "norm" in axes:
      return cfg.decay_norms
    if "bias" in name.lower():
      return cfg.decay_biases
    if "vocab" in axes:
      return cfg.decay_embeddings
    return True

  return jax.tree_util.tree_map_with_path(decays, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def make_optimizer(cfg: OptimizerConfig, total_steps: int, params: Any) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                      weight_decay=cfg.weight_decay, mask=weight_decay_mask(params, cfg))
  if cfg.grad_clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip_norm), adamw)
  return adamw
