"""The jitted train step: optimizer and expert-bias updates, accumulation, remat, bf16 compute, ZeRO-1."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from meshmoe.config import MeshConfig
from meshmoe.training import model_state, train_step
from tests.model_steps import init_model, initial_variables, make_loss_and_grad, plan_for, synthetic_batch
from tests.test_model_sharded import small_config
from tests.tolerances import BF16_LOSS_RTOL, BF16_MODEL_RTOL, FP32_MODEL_RTOL, assert_close


def _one_step(config, accum=1):
  config.train.grad_accum_steps = accum
  plan = plan_for(config)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  before = jax.tree.map(np.asarray, state)
  inputs, targets = synthetic_batch(config, plan, seed=5)
  batch = {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}
  new_state, metrics = trainer.train_step(state, batch)
  return before, new_state, metrics


def _flat(params) -> dict[str, np.ndarray]:
  return {"/".join(map(str, path)): np.asarray(v, np.float64) for path, v in nnx.to_flat_state(params)}


def test_train_step_moves_the_expert_bias_by_the_load():
  config = small_config(expert_bias=True, expert_bias_update_rate=0.01)
  config.mesh = MeshConfig(data=2, expert=4, preset="ep")
  before, after, metrics = _one_step(config)
  assert int(after.step) == 1
  load = np.asarray(metrics["expert_load"][0])
  expected_bias = 0.01 * np.sign(load.mean() - load)
  assert np.any(expected_bias != 0)
  np.testing.assert_allclose(np.asarray(after.others["moe_layers"]["layer"]["ffn"]["router"]["bias_E"][...][0]),
                             expected_bias, rtol=1e-6)
  assert "bias_E" not in str(jax.tree.structure(after.opt_state))  # the optimizer never sees the bias
  assert not np.array_equal(np.asarray(after.rng), before.rng)


def test_the_first_warmup_update_moves_the_parameters():
  """The first step of a warmup runs at learning_rate / warmup_steps (not 0), and logs that rate."""
  config = small_config()
  config.mesh = MeshConfig(data=8, preset="dp")
  before, after, metrics = _one_step(config)
  opt = config.optimizer
  assert float(metrics["learning_rate"]) == pytest.approx(opt.learning_rate / opt.warmup_steps, rel=1e-6)
  assert any(not np.array_equal(np.asarray(b), a)
             for a, b in zip(jax.tree.leaves(before.params), jax.tree.leaves(after.params), strict=True))


def test_first_update_is_clipped_adamw_with_the_decay_mask():
  """One step's parameter change equals AdamW's first step worked out in NumPy from the step's gradients:
  clipped to the global norm, m and v bias-corrected to g and g^2, so the update is g / (|g| + eps), plus
  weight decay on everything but the norms and the embedding tables."""
  config = small_config()
  config.mesh = MeshConfig(data=2, expert=4, preset="ep")
  opt = config.optimizer
  opt.warmup_steps, opt.grad_clip_norm, opt.weight_decay = 0, 0.25, 0.1
  opt.eps = 1e-3  # keeps g / (|g| + eps) well-conditioned for gradients near zero
  plan = plan_for(config)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  inputs, targets = synthetic_batch(config, plan, seed=5)
  model = nnx.merge(trainer.graphdef, state.params, state.others)
  _, _, grads = make_loss_and_grad(model, config, plan)(state.params, state.others, inputs, targets)
  params, grads = _flat(state.params), _flat(grads)
  batch = {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}
  after, metrics = trainer.train_step(state, batch)  # donates `state`: read above

  norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
  assert norm > opt.grad_clip_norm, "the clipping must bind for this test to check it"
  np.testing.assert_allclose(float(metrics["grad_norm"]), norm, rtol=FP32_MODEL_RTOL)
  assert float(metrics["learning_rate"]) == pytest.approx(opt.learning_rate)
  not_decayed = ("scale", "table_VD", "unembed_DV")  # norms and the embedding tables
  for name, new in _flat(after.params).items():
    g = grads[name] * opt.grad_clip_norm / norm
    decay = 0.0 if name.endswith(not_decayed) else opt.weight_decay
    expected = -opt.learning_rate * (g / (np.abs(g) + opt.eps) + decay * params[name])
    assert_close(new - params[name], expected, FP32_MODEL_RTOL, f"update of {name}")


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


@functools.cache
def _remat_run(policy: str):
  """(loss, terms, grads) of one batch and the compiled program's temporary bytes under `policy`; cached, so
  that both policies compare with one run without rematerialisation."""
  config = small_config()
  # 256 tokens per device, so activations, not weight-sized buffers, dominate the temporaries.
  config.train.global_batch_size, config.train.seq_len, config.model.max_seq_len = 16, 128, 128
  config.mesh = MeshConfig(data=8, preset="dp")
  config.model.remat = policy
  plan = plan_for(config)
  inputs, targets = synthetic_batch(config, plan, seed=1)
  model = init_model(config, plan)
  _, params, others = nnx.split(model, nnx.Param, ...)
  loss_and_grad = make_loss_and_grad(model, config, plan)
  compiled = loss_and_grad.lower(params, others, inputs, targets).compile()
  return compiled(params, others, inputs, targets), compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_remat_changes_memory_not_results(policy):
  (loss, _, grads), temp_bytes = _remat_run(policy)
  (loss_none, _, grads_none), temp_bytes_none = _remat_run("none")
  assert temp_bytes < temp_bytes_none, (temp_bytes, temp_bytes_none)
  assert_close(loss, loss_none, FP32_MODEL_RTOL, "loss")
  for a, b in zip(jax.tree.leaves(grads_none), jax.tree.leaves(grads), strict=True):
    assert_close(b, a, FP32_MODEL_RTOL, "grads")


def _loss_and_grads(config, dtype: str, seed: int):
  config.model.dtype = dtype
  plan = plan_for(config)
  model = init_model(config, plan)
  _, params, others = nnx.split(model, nnx.Param, ...)
  inputs, targets = synthetic_batch(config, plan, seed=seed)
  loss, _, grads = make_loss_and_grad(model, config, plan)(params, others, inputs, targets)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads)), "gradients must stay float32"
  return float(loss), _flat(grads)


def test_bfloat16_gradients_track_float32():
  """Every parameter's gradient under bfloat16 compute against float32, from the same parameters and batch.
  Each token takes all experts (top_k = num_experts): with a top-2 choice, bfloat16 rounding may flip a
  near-tie and send a token to another expert, a discrete difference no tolerance describes."""
  config = small_config()
  config.model.moe.top_k = config.model.moe.num_experts
  config.mesh = MeshConfig(data=8, preset="dp")
  loss_32, grads_32 = _loss_and_grads(config, "float32", seed=5)
  loss_16, grads_16 = _loss_and_grads(config, "bfloat16", seed=5)
  assert_close(loss_16, loss_32, BF16_LOSS_RTOL, "loss")
  for name, grad in grads_32.items():
    assert_close(grads_16[name], grad, BF16_MODEL_RTOL, f"grad {name}")


def test_bfloat16_training_tracks_float32():
  """Thirty steps (top-2 routing, AdamW) on sequences that count up: a learnable pattern, so the loss falls
  far and a bfloat16 path that trains differently (a gradient lost to a cast) shows as a diverging curve."""
  curves = {}
  for dtype in ("float32", "bfloat16"):
    config = small_config()
    config.mesh = MeshConfig(data=8, preset="dp")
    config.model.dtype = dtype
    config.train.steps, config.optimizer.warmup_steps = 30, 2
    plan = plan_for(config)
    trainer, state = train_step.create(config, plan, initial_variables(config, plan))
    rng, b, s, v = np.random.default_rng(0), config.train.global_batch_size, config.train.seq_len, 64
    losses = []
    for _ in range(config.train.steps):
      tokens = ((rng.integers(0, v, (b, 1)) + np.arange(s + 1)[None]) % v).astype(np.int32)
      batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((b, s), np.float32)}
      state, metrics = trainer.train_step(state, train_step.place_batch(batch, config, plan))
      losses.append(float(metrics["loss"]))
    curves[dtype] = np.array(losses)
  assert curves["float32"][-1] < 0.6 * curves["float32"][0], curves["float32"]
  for step, (got, want) in enumerate(zip(curves["bfloat16"], curves["float32"])):
    assert_close(got, want, BF16_LOSS_RTOL, f"loss at step {step + 1}")


def test_zero1_splits_optimizer_moments_but_not_parameters():
  config = small_config()
  config.mesh = MeshConfig(data=8, preset="zero1")
  plan = plan_for(config)
  _, params, _ = nnx.split(model_state.init_model(config, plan), nnx.Param, ...)
  opt_state = model_state.init_optimizer_state(optax.adamw(1e-3), params, plan)
  mu = opt_state[0].mu["moe_layers"]["layer"]["ffn"]["gate_EDF"][...]  # [layers, E, D, F]
  assert mu.sharding.spec[2] == ("data", "expert", "tensor", "sequence")  # the embed dimension
  assert params["moe_layers"]["layer"]["ffn"]["gate_EDF"][...].sharding.is_fully_replicated
  assert opt_state[0].count.sharding.is_fully_replicated


def _step_on(config, devices):
  """One train step of `config` on `devices` from the seed's initial state: its loss and gradient norm, the
  parameters after it and AdamW's moments, by path."""
  plan = plan_for(config, devices)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  inputs, targets = synthetic_batch(config, plan, seed=5)
  batch = {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}
  after, metrics = trainer.train_step(state, batch)
  moments = {name: _flat(optax.tree_utils.tree_get(after.opt_state, name)) for name in ("mu", "nu")}
  return {k: float(metrics[k]) for k in ("loss", "grad_norm")}, _flat(after.params), moments


def _storage_step_config(mesh: MeshConfig, remat: str):
  config = small_config()
  config.mesh, config.model.remat = mesh, remat
  opt = config.optimizer
  opt.warmup_steps, opt.eps = 0, 1e-3  # a full-size first step; g / (|g| + eps) well-conditioned near g = 0
  return config


@functools.cache
def _one_device_step():
  """The storage tests' reference: the same step on one device, without remat (which changes no result:
  test_remat_changes_memory_not_results), computed once per process."""
  return _step_on(_storage_step_config(MeshConfig(data=1, preset="dp"), "none"), jax.devices()[:1])


# (mesh sizes, preset, weight storage, remat)
STORAGE_STEPS = [((2, 2, 1, 2), "megascale", "data", "none"), ((2, 2, 2, 1), "tp_sp", "all", "full"),
                 ((2, 2, 1, 2), "megascale", "all", "full"), ((2, 2, 2, 1), "tp_sp", "data", "none")]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,storage,remat", STORAGE_STEPS,
                         ids=[f"{p}-{w}-remat_{r}" for _, p, w, r in STORAGE_STEPS])
def test_weight_storage_step_matches_single_device(sizes, preset, storage, remat):
  """A whole optimizer step with the weights and AdamW moments stored split over `data` (or every axis the
  preset leaves them on): the loss, the updated parameters and both moments equal one device's step."""
  config = _storage_step_config(MeshConfig(**dict(zip(("data", "expert", "tensor", "sequence"), sizes)),
                                           preset=preset, weight_storage=storage), remat)
  metrics, params, moments = _step_on(config, jax.devices())
  ref_metrics, ref_params, ref_moments = _one_device_step()
  assert_close(metrics["loss"], ref_metrics["loss"], FP32_MODEL_RTOL, "loss")
  assert_close(metrics["grad_norm"], ref_metrics["grad_norm"], FP32_MODEL_RTOL, "grad_norm")
  assert params.keys() == ref_params.keys()
  for name in ref_params:
    assert_close(params[name], ref_params[name], FP32_MODEL_RTOL, f"parameter {name}")
    for moment in ("mu", "nu"):
      assert_close(moments[moment][name], ref_moments[moment][name], FP32_MODEL_RTOL, f"{moment} of {name}")


def test_weight_storage_splits_parameters_and_moments_over_data():
  """megascale on data=2 x expert=2 x sequence=2 with weight_storage="data": the experts' [layers, E, D, F]
  weights and their AdamW moments are D over `data`, and every weight with a model dimension takes half
  the bytes per device it takes as the preset stores it (the norms and biases, which have none, the same)."""
  stored = {}
  for storage in ("preset", "data"):
    config = small_config()
    config.mesh = MeshConfig(data=2, expert=2, sequence=2, preset="megascale", weight_storage=storage)
    plan = plan_for(config)
    _, params, _ = nnx.split(model_state.init_model(config, plan), nnx.Param, ...)
    opt_state = model_state.init_optimizer_state(optax.adamw(1e-3), params, plan)
    gate, mu = (tree["moe_layers"]["layer"]["ffn"]["gate_EDF"][...] for tree in (params, opt_state[0].mu))
    stored[storage] = {"/".join(map(str, path)): (v.get_metadata()["logical_axes"], _bytes_on_device(v[...]))
                       for path, v in nnx.to_flat_state(params)}
    if storage == "data":
      assert gate.sharding.spec[1:3] == ("expert", "data") and mu.sharding.spec[1:3] == ("expert", "data")
  for name, (logical, nbytes) in stored["preset"].items():
    assert stored["data"][name][1] * (2 if "embed" in logical else 1) == nbytes, name


def _bytes_on_device(array, device=None) -> int:
  device = device or jax.devices()[0]
  return sum(shard.data.nbytes for shard in array.addressable_shards if shard.device == device)
