"""The global-batch load-balancing loss (`model.moe.balance_loss="global_batch"`, models/decoder.py
global_batch_balance_loss): a train step's logged aux loss, its loss and its gradient equal a NumPy reference
built from each micro-batch's loads and scores (micro-batch k's scores weighed by the loads of micro-batches
1..k, summed over the data replicas), on a layout of 8 devices against terms computed on one; with one
micro-batch it is the batch loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshmoe.config import MeshConfig
from meshmoe.training import train_step
from tests.model_steps import initial_variables, plan_for, synthetic_batch
from tests.test_model_sharded import small_config
from tests.tolerances import FP32_MODEL_RTOL, FP32_MODULE_RTOL, assert_close

COUNT = 4  # micro-batches


def _config(balance_loss: str, mesh: MeshConfig, count: int = COUNT):
  config = small_config()
  config.model.num_layers = 3  # two MoE layers
  config.model.moe.balance_loss = balance_loss
  config.model.moe.aux_loss_weight = 0.5  # large enough that the loss's gradient shows in the step's
  config.mesh = mesh
  config.train.grad_accum_steps = count
  config.train.global_batch_size = 8 * count  # `ep` splits each micro-batch's rows over all 8 devices
  config.optimizer.grad_clip_norm = 0.0
  return config


def _batch(config, plan):
  inputs, targets = synthetic_batch(config, plan, seed=11)
  return {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}


def _step(config):
  plan = plan_for(config)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  _, metrics = trainer.train_step(state, _batch(config, plan))
  return jax.tree.map(np.asarray, metrics)


def _reference(config):
  """(loss, aux loss logged, gradient norm) of the step, from each micro-batch's terms on one device: the
  global-batch loss written out with NumPy's cumulative loads as constants."""
  config.mesh = MeshConfig(data=1, preset="dp")
  plan = plan_for(config, jax.devices()[:1])
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  micro = train_step._microbatches(_batch(config, plan), COUNT)
  terms_of = jax.jit(lambda params, b: train_step.loss_terms(trainer.graphdef, params, state.others, b, plan))
  loads = np.stack([np.asarray(terms_of(state.params, jax.tree.map(lambda x: x[k], micro))["expert_load"],
                               np.float64) for k in range(COUNT)])  # [k, L, E]
  cumulative = np.cumsum(loads, axis=0)
  fractions = cumulative / cumulative.sum(axis=-1, keepdims=True)
  moe, total = config.model.moe, float(COUNT * micro["mask"][0].size)

  def loss(params):
    parts = []
    for k in range(COUNT):
      terms = terms_of(params, jax.tree.map(lambda x: x[k], micro))
      aux = jnp.mean(moe.num_experts * jnp.sum(jnp.asarray(fractions[k], jnp.float32) * terms["score_mean"], -1))
      parts.append((terms["ce_sum"] / total + (moe.aux_loss_weight * aux + moe.z_loss_weight * terms["z_loss"]) / COUNT,
                    aux))
    return sum(p for p, _ in parts), jnp.mean(jnp.stack([a for _, a in parts]))

  (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
  norm = np.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in jax.tree.leaves(grads)))
  return float(value), float(aux), norm


@pytest.mark.slow
def test_global_batch_loss_and_gradient_equal_the_reference():
  config = _config("global_batch", MeshConfig(data=2, expert=4, preset="ep"))
  metrics = _step(config)
  loss, aux, grad_norm = _reference(_config("global_batch", MeshConfig(data=1, preset="dp")))
  assert_close(metrics["aux_loss"], aux, FP32_MODULE_RTOL, "aux loss")
  assert_close(metrics["loss"], loss, FP32_MODEL_RTOL, "loss")
  assert_close(metrics["grad_norm"], grad_norm, FP32_MODEL_RTOL, "gradient norm")
  batch = _step(_config("batch", MeshConfig(data=2, expert=4, preset="ep")))
  assert abs(float(batch["aux_loss"]) - aux) > 100 * FP32_MODULE_RTOL * aux  # the reference tells them apart


def test_one_micro_batch_is_the_batch_loss():
  mesh = MeshConfig(data=2, expert=4, preset="ep")
  global_batch, batch = (_step(_config(name, mesh, count=1)) for name in ("global_batch", "batch"))
  for name in ("loss", "aux_loss", "grad_norm"):
    assert float(global_batch[name]) == float(batch[name]), name
