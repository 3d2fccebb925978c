"""The optimizer: global-norm clipping, then AdamW with warmup + cosine decay and a weight-decay mask.

Parameters and optimizer state are float32 (the model keeps float32 parameters and casts to the compute
dtype inside each layer). Weight decay applies to matrices; norms, biases and embeddings are decayed only
when the config says so. A parameter is classified by its logical axis names (`norm` = a norm scale,
`vocab` = an embedding or output table) or, for biases, by its name.
"""

from typing import Any

import jax
import optax
from flax import nnx

from meshmoe.config import OptimizerConfig


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `learning_rate`, then cosine decay to `learning_rate * min_learning_rate_ratio`."""
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
      decay_steps=max(total_steps, cfg.warmup_steps + 1),
      end_value=cfg.learning_rate * cfg.min_learning_rate_ratio)


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
