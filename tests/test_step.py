"""The jitted train step: optimizer and expert-bias updates, accumulation, remat, bf16 compute, ZeRO-1."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from meshmoe.training import model_state as step, train_step
from meshmoe.config import MeshConfig
from meshmoe.sharding.mesh import make_mesh
from tests.test_model_sharded import small_config
from tests.tolerances import FP32_MODEL_RTOL, assert_close


def _one_step(config, accum=1):
  config.train.grad_accum_steps = accum
  mesh = make_mesh(config.mesh)
  trainer, state = train_step.create(config, mesh)
  before = jax.tree.map(np.asarray, state)
  inputs, targets = step.synthetic_batch(config, mesh, seed=5)
  batch = {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}
  new_state, metrics = trainer.train_step(state, batch)
  return before, new_state, metrics


def test_train_step_updates_bias_from_load_and_params_by_the_optimizer():
  config = small_config(expert_bias=True, expert_bias_update_rate=0.01)
  config.mesh = MeshConfig(data=2, expert=4, preset="ep")
  before, after, metrics = _one_step(config)
  assert int(after.step) == 1
  load = np.asarray(metrics["expert_load"][0])
  expected_bias = 0.01 * np.sign(load.mean() - load)
  assert np.any(expected_bias != 0)
  np.testing.assert_allclose(np.asarray(after.others["moe_layers"]["layer"]["ffn"]["router"]["bias_E"][...][0]),
                             expected_bias, rtol=1e-6)
  assert "bias_E" not in str(jax.tree.structure(after.opt_state))
  changed = [not np.array_equal(a, np.asarray(b)) for a, b in
             zip(jax.tree.leaves(before.params), jax.tree.leaves(after.params), strict=True)]
  # Warmup starts at learning rate 0: the first update changes nothing but the optimizer moments.
  assert float(metrics["learning_rate"]) == 0.0 and not any(changed)
  assert not np.array_equal(np.asarray(after.rng), before.rng)


def test_gradient_accumulation_equals_one_big_batch():
  results = []
  for accum in (1, 4):
    config = small_config(aux_loss_weight=0.0, z_loss_weight=0.0)  # router losses are per micro-batch
    config.train.global_batch_size = 32
    config.mesh = MeshConfig(data=8, preset="dp")
    config.optimizer.warmup_steps = 0
    results.append(_one_step(config, accum))
  (_, one, m1), (_, four, m4) = results
  np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-5)
  np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(m4["expert_load"]), np.asarray(m1["expert_load"]))
  for a, b in zip(jax.tree.leaves(one.opt_state), jax.tree.leaves(four.opt_state), strict=True):
    assert_close(b, a, FP32_MODEL_RTOL, "optimizer state")


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_changes_memory_not_results(policy):
  config = small_config()
  # 256 tokens per device, so activations, not weight-sized buffers, dominate the temporaries.
  config.train.global_batch_size, config.train.seq_len, config.model.max_seq_len = 16, 128, 128
  config.mesh = MeshConfig(data=8, preset="dp")
  mesh = make_mesh(config.mesh)
  inputs, targets = step.synthetic_batch(config, mesh, seed=1)
  results, temp_bytes = {}, {}
  for name in ("none", policy):
    config.model.remat = name
    model = step.init_model(config, mesh)
    _, params, others = nnx.split(model, nnx.Param, ...)
    loss_and_grad = step.make_loss_and_grad(model, config, mesh)
    compiled = loss_and_grad.lower(params, others, inputs, targets).compile()
    temp_bytes[name] = compiled.memory_analysis().temp_size_in_bytes
    results[name] = loss_and_grad(params, others, inputs, targets)
  assert temp_bytes[policy] < temp_bytes["none"], temp_bytes
  assert_close(results[policy][0], results["none"][0], FP32_MODEL_RTOL, "loss")
  for a, b in zip(jax.tree.leaves(results["none"][2]), jax.tree.leaves(results[policy][2]), strict=True):
    assert_close(b, a, FP32_MODEL_RTOL, "grads")


def test_bfloat16_compute_tracks_float32():
  config = small_config()
  config.mesh = MeshConfig(data=8, preset="dp")
  mesh = make_mesh(config.mesh)
  losses = {}
  for dtype in ("float32", "bfloat16"):
    config.model.dtype = dtype
    model = step.init_model(config, mesh)
    _, params, others = nnx.split(model, nnx.Param, ...)
    inputs, targets = step.synthetic_batch(config, mesh, seed=5)
    loss, _, grads = step.make_loss_and_grad(model, config, mesh)(params, others, inputs, targets)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads)), "gradients must stay float32"
    losses[dtype] = float(loss)
  np.testing.assert_allclose(losses["bfloat16"], losses["float32"], rtol=2e-2)


def test_zero1_splits_optimizer_moments_but_not_parameters():
  config = small_config()
  config.mesh = MeshConfig(data=8, preset="zero1")
  mesh = make_mesh(config.mesh)
  _, params, _ = nnx.split(step.init_model(config, mesh), nnx.Param, ...)
  opt_state = step.init_optimizer_state(optax.adamw(1e-3), params, config, mesh)
  mu = opt_state[0].mu["moe_layers"]["layer"]["ffn"]["gate_EDF"][...]  # [layers, E, D, F]
  assert mu.sharding.spec[2] == ("data", "expert", "tensor", "sequence")  # the embed dimension
  assert params["moe_layers"]["layer"]["ffn"]["gate_EDF"][...].sharding.is_fully_replicated
  assert opt_state[0].count.sharding.is_fully_replicated
