"""Test helpers: the plan of a config on some devices, a random batch, a jitted loss-and-gradient function
(the train step's loss, without the optimizer), and meshes of GPUs compiled for without one."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshmoe.analysis import deviceless
from meshmoe.config import Config
from meshmoe.models.decoder import Transformer, combine_loss_terms
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.training import train_step


def plan_for(config: Config, devices: Sequence[jax.Device] | None = None) -> ParallelPlan:
  """The plan of `config` on `devices` (default: all), its mesh built from `config.mesh`."""
  return ParallelPlan.build(config, make_mesh(config.mesh, devices))


# One model state per model config and seed, created on one device (see `init_model`).
_INITIAL_STATES: dict[str, Any] = {}


def init_model(config: Config, plan: ParallelPlan) -> Transformer:
  """model_state.init_model's model with the same values, created once per model config and seed on one
  device and then placed as `plan` says. The random initialisation does not depend on the sharding, so the
  tests that run one model on many layouts skip compiling its sharded initialiser for each (2-3 s apiece);
  test_model_sharded.py checks the sharded initialiser itself against this."""
  create = lambda: Transformer(config.model, rngs=nnx.Rngs(config.train.seed))
  abstract = nnx.eval_shape(create)
  key = repr((config.model, config.train.seed))
  if key not in _INITIAL_STATES:
    # Kept in host memory: each placement makes new device buffers, which a step may donate.
    _INITIAL_STATES[key] = jax.tree.map(np.asarray, jax.jit(lambda: nnx.state(create()))())
  placed = jax.device_put(_INITIAL_STATES[key], plan.param_shardings(nnx.state(abstract)))
  return nnx.merge(nnx.graphdef(abstract), placed)


def initial_variables(config: Config, plan: ParallelPlan) -> tuple[Any, Any]:
  """(parameters, other variables) of `init_model`'s model: train_step.create's `variables`, so that a
  test's train step starts from the placed one-device state too."""
  _, params, others = nnx.split(init_model(config, plan), nnx.Param, ...)
  return params, others


def synthetic_batch(config: Config, plan: ParallelPlan, seed: int = 0) -> tuple[jax.Array, jax.Array]:
  """Uniformly random (inputs_BS, targets_BS) of the config's batch shape, placed as the plan says."""
  b, s = config.train.global_batch_size, config.train.seq_len
  tokens = jax.random.randint(jax.random.key(seed), (b, s + 1), 0, config.model.vocab_size)
  sharding = plan.batch_sharding()
  return jax.device_put(tokens[:, :-1], sharding), jax.device_put(tokens[:, 1:], sharding)


def make_loss_and_grad(model: Transformer, config: Config, plan: ParallelPlan) -> Callable[..., Any]:
  """Jitted f(params, others, inputs_BS, targets_BS) -> (loss, terms, grads): the train step's loss of one
  unmasked batch (train_step.loss_terms) and its gradient, placed like the parameters."""
  graphdef, params, _ = nnx.split(model, nnx.Param, ...)
  grad_shardings = plan.param_shardings(params)

  def loss_and_grad(params, others, inputs_BS, targets_BS):
    def loss_of(params):
      batch = {"inputs": inputs_BS, "targets": targets_BS, "mask": jnp.ones(inputs_BS.shape, jnp.float32)}
      terms = train_step.loss_terms(graphdef, params, others, batch, plan)
      return combine_loss_terms(terms, config.model.moe, terms["tokens"], num_microbatches=1), terms

    (loss, terms), grads = jax.value_and_grad(loss_of, has_aux=True)(params)
    return loss, terms, jax.lax.with_sharding_constraint(grads, grad_shardings)

  return jax.jit(loss_and_grad)


def gpu_mesh(shape: Sequence[int], axis_names: Sequence[str], target: str = "h100_sxm", num_hosts: int = 1) -> Mesh:
  """A mesh of prod(shape) deviceless GPUs of `target` spread over `num_hosts` hosts, with Auto axis types;
  devices in id order (row-major over `shape`)."""
  devices = np.array(deviceless.gpu_devices(math.prod(shape), target, num_hosts), dtype=object)
  return Mesh(devices.reshape(tuple(shape)), tuple(axis_names), axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
