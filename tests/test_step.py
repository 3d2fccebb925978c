"""The jitted train step: the optimizer trains parameters, the expert bias follows the load, bf16 compute."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from meshmoe import step
from meshmoe.config import MeshConfig
from meshmoe.sharding.mesh import make_mesh
from tests.test_model_sharded import small_config


def test_train_step_updates_bias_from_load_and_params_from_gradients():
  config = small_config(expert_bias=True, expert_bias_update_rate=0.01)
  config.mesh = MeshConfig(data=2, expert=4, preset="ep")
  mesh = make_mesh(config.mesh)
  model = step.init_model(config, mesh)
  optimizer = optax.sgd(0.1)
  _, params, others = nnx.split(model, nnx.Param, ...)
  opt_state = optimizer.init(params)
  params_before = jax.tree.map(np.asarray, params)
  inputs, targets = step.synthetic_batch(config, mesh, seed=5)
  loss, metrics, grads = step.make_loss_and_grad(model, config, mesh)(params, others, inputs, targets)
  train_step = step.make_train_step(model, optimizer, config, mesh)
  new_params, new_others, _, step_metrics = train_step(params, others, opt_state, inputs, targets)

  np.testing.assert_allclose(float(step_metrics["loss"]), float(loss), rtol=1e-6)
  for (path, before), (_, after), (_, grad) in zip(nnx.to_flat_state(params_before),
                                                   nnx.to_flat_state(new_params),
                                                   nnx.to_flat_state(grads), strict=True):
    np.testing.assert_allclose(np.asarray(after), np.asarray(before) - 0.1 * np.asarray(grad),
                               rtol=1e-5, atol=1e-7, err_msg=str(path))
  load = np.asarray(metrics["expert_load"][0])
  expected_bias = 0.01 * np.sign(load.mean() - load)
  assert np.any(expected_bias != 0)
  np.testing.assert_allclose(np.asarray(new_others["layers"][1]["ffn"]["router"]["bias_E"][...]),
                             expected_bias, rtol=1e-6)
  assert "bias_E" not in str(jax.tree.structure(opt_state))


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
  mu = opt_state[0].mu["layers"][1]["ffn"]["gate_EDF"][...]
  assert mu.sharding.spec[1] == ("data", "expert", "tensor", "sequence")  # the embed dimension
  assert params["layers"][1]["ffn"]["gate_EDF"][...].sharding.is_fully_replicated
  assert opt_state[0].count.sharding.is_fully_replicated
