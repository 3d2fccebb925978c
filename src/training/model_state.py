"""Sharded model and optimizer-state creation, batch placement, and a jitted loss/gradient function.

Parameters are created directly in their sharded layout (the init is jitted with the rules' shardings as
outputs), so no device ever holds a full copy. The rules are activated inside the traced functions, so each
jitted function is tied to one (mesh, preset) pair and nothing global leaks between meshes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshmoe.config import Config
from meshmoe.models.decoder import Transformer, lm_loss
from meshmoe.sharding.shardings import batch_sharding, optimizer_shardings, param_shardings, use_rules


def init_model(config: Config, mesh: Mesh) -> Transformer:
  """The model of `config`, initialised from `config.train.seed`, with parameters sharded on `mesh`."""
  create = lambda: Transformer(config.model, rngs=nnx.Rngs(config.train.seed))
  abstract = nnx.eval_shape(create)
  shardings = param_shardings(nnx.state(abstract), mesh, config.mesh.preset)
  state = jax.jit(lambda: nnx.state(create()), out_shardings=shardings)()
  return nnx.merge(nnx.graphdef(abstract), state)


def init_optimizer_state(optimizer: optax.GradientTransformation, params: Any, config: Config,
                         mesh: Mesh) -> Any:
  """`optimizer.init(params)` with every parameter-shaped leaf (moments, ...) placed by the preset's
  optimizer rules (ZeRO-1 splits them over the devices) and scalars such as the step count replicated."""
  shardings = optimizer_state_shardings(optimizer, params, config, mesh)
  return jax.jit(optimizer.init, out_shardings=shardings)(params)


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params: Any, config: Config,
                              mesh: Mesh) -> Any:
  """The shardings `init_optimizer_state` gives (`params` may be abstract)."""
  abstract = jax.eval_shape(optimizer.init, params)
  return optax.tree_map_params(
      optimizer, lambda _, sharding: sharding, abstract, optimizer_shardings(params, mesh, config.mesh.preset),
      transform_non_params=lambda _: NamedSharding(mesh, PartitionSpec()),
      is_leaf=lambda x: isinstance(x, nnx.Variable))


def abstract_model_state(config: Config, mesh: Mesh) -> tuple[Any, Any, Any]:
  """(graphdef, params, others) of the model with every leaf a jax.ShapeDtypeStruct carrying the sharding
  `init_model` would give it: the model's shape on `mesh` without allocating it."""
  abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(config.train.seed)))
  graphdef, params, others = nnx.split(abstract, nnx.Param, ...)
  whole = NamedSharding(mesh, PartitionSpec())
  placed = lambda variable, sharding: variable.replace(
      jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding))
  is_variable = lambda x: isinstance(x, nnx.Variable)
  params = jax.tree.map(placed, params, param_shardings(params, mesh, config.mesh.preset), is_leaf=is_variable)
  others = jax.tree.map(lambda v: placed(v, whole), others, is_leaf=is_variable)
  return graphdef, params, others


def shard_batch(tokens_BS: jax.Array, config: Config, mesh: Mesh) -> jax.Array:
  return jax.device_put(tokens_BS, batch_sharding(mesh, config.mesh.preset))


def synthetic_batch(config: Config, mesh: Mesh, seed: int = 0) -> tuple[jax.Array, jax.Array]:
  """Uniformly random (inputs_BS, targets_BS) of the config's batch shape, sharded (benchmarks, tests)."""
  b, s = config.train.global_batch_size, config.train.seq_len
  tokens = jax.random.randint(jax.random.key(seed), (b, s + 1), 0, config.model.vocab_size)
  return shard_batch(tokens[:, :-1], config, mesh), shard_batch(tokens[:, 1:], config, mesh)


def make_loss_and_grad(model: Transformer, config: Config, mesh: Mesh) -> Callable[..., Any]:
  """Jitted f(params, others, inputs_BS, targets_BS) -> (loss, metrics, grads) for `model`'s structure."""
  graphdef, params, _ = nnx.split(model, nnx.Param, ...)
  grad_shardings = param_shardings(params, mesh, config.mesh.preset)

  def loss_and_grad(params, others, inputs_BS, targets_BS):
    def loss_of(params):
      with use_rules(mesh, config.mesh.preset, config.parallel):
        return lm_loss(nnx.merge(graphdef, params, others), inputs_BS, targets_BS)

    (loss, metrics), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
    return loss, metrics, grads

  return jax.jit(loss_and_grad)
