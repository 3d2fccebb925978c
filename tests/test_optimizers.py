"""The optimizers (`optimizer.name`, training/optimizer.py): each update equals optax's own rule applied by
hand to every parameter (Muon to every layer's and every expert's matrix on its own), on one device and on
the layouts of every preset and storage; a run resumes from a checkpoint bit for bit with each, and a
checkpoint written by one optimizer is one clear error for another."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments.configs import tiny_moe
from meshmoe.analysis import cost_memory
from meshmoe.config import OPTIMIZERS, CheckpointConfig, ConfigError, MeshConfig
from meshmoe.models.decoder import Transformer
from meshmoe.training import optimizer as optimizer_lib
from meshmoe.training import train_step
from meshmoe.training.checkpointing import Checkpointer
from tests.model_steps import initial_variables, plan_for
from tests.test_master_weights import _two_step_run
from tests.tolerances import BF16_ROUNDING_RTOL, FP32_MODEL_RTOL, FP32_MODULE_RTOL, assert_close

STEPS = 3  # updates per check: the moments' second and third updates use what the first left
TOTAL_STEPS = 10

# Muon's view of each weight, written out by hand from the model's weights (models/): for every parameter
# Muon updates, which of its axes (after the stacked layer axis and the experts' axis) form the rows of the
# matrix it orthogonalises; the other axes form the columns. Every other parameter takes AdamW.
MUON_ROWS = {"query_DNH": 1, "key_DGH": 1, "value_DGH": 1, "out_NHD": 2, "gate_DF": 1, "up_DF": 1, "down_FD": 1,
             "gate_EDF": 1, "up_EDF": 1, "down_EFD": 1, "query_down_DR": 1, "query_up_RNH": 1, "kv_down_DC": 1,
             "kv_up_CNH": 1}
ADAMW_ONLY = {"table_VD", "unembed_DV", "scale", "kernel_DE"}  # tables, norms, the router
# Whether weight decay applies (OptimizerConfig's defaults: not to norms, biases or tables).
DECAYS = {"table_VD": False, "unembed_DV": False, "scale": False}


def _config(name: str, attention: str = "gqa"):
  config = tiny_moe.get_config()  # widths of 128 and more: Adafactor factors its second moments
  config.optimizer = dataclasses.replace(config.optimizer, name=name, warmup_steps=2, learning_rate=1e-2)
  config.train.steps = TOTAL_STEPS
  if attention == "mla":
    config.model = dataclasses.replace(config.model, attention="mla", num_kv_heads=4, q_lora_rank=32,
                                       kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                                       head_dim=32, tie_embeddings=False)
  return config


def _gradients(params, step: int):
  """Made-up gradients of the parameters' shapes, different for every step, of a size that clipping cuts."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(100 + step), len(leaves))
  return jax.tree.unflatten(tree, [0.05 * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def _by_hand(name: str, cfg, flat_params: dict, flat_grads: list[dict]) -> dict:
  """The parameters after len(flat_grads) updates, each parameter (each matrix, for Muon) updated by its own
  optax rule, after clipping every step's gradients to the global norm worked out here."""
  schedule = optimizer_lib.learning_rate_schedule(cfg, TOTAL_STEPS)
  wd = cfg.weight_decay

  def rule_for(param_name: str):
    decay = wd if DECAYS.get(param_name, True) else 0.0
    if name == "lion":
      return optax.lion(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=decay)
    if name == "adafactor":
      return optax.adafactor(schedule, weight_decay_rate=(lambda count: decay * schedule(count)) if decay else None)
    if name == "muon" and param_name in MUON_ROWS:
      return optax.contrib.muon(schedule, beta=cfg.muon_beta, weight_decay=decay, consistent_rms=cfg.muon_update_rms)
    return optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=decay)

  def matrices(path: str, x: np.ndarray) -> tuple[np.ndarray, tuple]:
    """x as a stack of the 2-D matrices Muon sees (or itself, one "matrix", for the others)."""
    param_name = path.split("/")[-1]
    if not (name == "muon" and param_name in MUON_ROWS):
      return x[None], x.shape
    batch = 2 if "_E" in param_name else 1  # the layer axis, and the experts' axis
    rows = math.prod(x.shape[batch:batch + MUON_ROWS[param_name]])
    return x.reshape(-1, rows, x[(0,) * batch].size // rows), x.shape

  updated = {}
  for path, param in flat_params.items():
    param_name = path.split("/")[-1]
    assert param_name in MUON_ROWS or param_name in ADAMW_ONLY, f"{path}: a parameter this test does not know"
    rule = rule_for(param_name)
    update = jax.jit(rule.update)
    stacked, shape = matrices(path, param)
    states = [rule.init(jnp.asarray(m)) for m in stacked]
    for grads in flat_grads:
      norm = math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads.values()))
      scale = min(1.0, cfg.grad_clip_norm / norm)
      grad_stack, _ = matrices(path, grads[path] * np.float32(scale))
      new = []
      for i, (m, g) in enumerate(zip(stacked, grad_stack)):
        u, states[i] = update(jnp.asarray(g), states[i], jnp.asarray(m))
        new.append(np.asarray(optax.apply_updates(jnp.asarray(m), u)))
      stacked = np.stack(new)
    updated[path] = stacked.reshape(shape)
  return updated


def _flat_arrays(params) -> dict[str, np.ndarray]:
  return {"/".join(map(str, path)): np.asarray(v, np.float32) for path, v in nnx.to_flat_state(params)}


@pytest.mark.parametrize("name,attention", [(n, "gqa") for n in OPTIMIZERS] + [("muon", "mla")])
def test_each_update_equals_optax_applied_to_every_parameter_by_hand(name, attention):
  """Three clipped updates of tiny_moe's parameters (MLA's too, for Muon) with made-up gradients: the
  parameters' change equals the change that optax's rule for each parameter, applied to it alone, makes:
  AdamW, Lion and Adafactor per parameter; Muon per layer's and expert's matrix, AdamW for the rest."""
  config = _config(name, attention)
  params = nnx.state(Transformer(config.model, rngs=nnx.Rngs(0)), nnx.Param)
  optimizer = optimizer_lib.make_optimizer(config.optimizer, TOTAL_STEPS, params)
  state, new_params, grads_seen = optimizer.init(params), params, []
  update = jax.jit(optimizer.update)
  for step in range(STEPS):
    grads = _gradients(params, step)
    grads_seen.append(_flat_arrays(grads))
    updates, state = update(grads, state, new_params)
    new_params = optax.apply_updates(new_params, updates)
  assert int(optimizer_lib.applied_updates(state)) == STEPS
  before, got = _flat_arrays(params), _flat_arrays(new_params)
  want = _by_hand(name, config.optimizer, before, grads_seen)
  assert got.keys() == want.keys()
  for path in want:
    assert_close(got[path] - before[path], want[path] - before[path], FP32_MODULE_RTOL, path)


def test_muon_orthogonalises_each_matrix():
  """What makes Muon Muon, checked without optax: one update of a [layers, experts, D, F] weight (no
  momentum history, no decay) is, per layer and expert, close to a matrix with equal singular values: the
  five steps of the quintic Newton-Schulz iteration land them in about [0.68, 1.13] (a ratio under 2), where
  the gradient's (a random 128 x 256 matrix) spread over a ratio of about 6."""
  config = _config("muon")
  config.optimizer = dataclasses.replace(config.optimizer, weight_decay=0.0, grad_clip_norm=0.0)
  params = nnx.state(Transformer(config.model, rngs=nnx.Rngs(0)), nnx.Param)
  optimizer = optimizer_lib.make_optimizer(config.optimizer, TOTAL_STEPS, params)
  grads = _gradients(params, 0)
  updates, _ = optimizer.update(grads, optimizer.init(params), params)
  gate = np.asarray(updates["moe_layers"]["layer"]["ffn"]["gate_EDF"][...], np.float64)
  grad = np.asarray(grads["moe_layers"]["layer"]["ffn"]["gate_EDF"][...], np.float64)
  for layer in range(gate.shape[0]):
    for expert in range(gate.shape[1]):
      s = np.linalg.svd(gate[layer, expert], compute_uv=False)
      assert s.max() / s.min() < 2, (layer, expert, s.min(), s.max())
      g = np.linalg.svd(grad[layer, expert], compute_uv=False)
      assert g.max() / g.min() > 4  # the gradient's spectrum is not flat: the check above can fail


# (mesh sizes (data, expert, tensor, sequence), preset, weight storage, optimizer storage): every preset,
# every weight storage and every optimizer storage at least once.
LAYOUTS = [((8, 1, 1, 1), "dp", "preset", "weights"), ((2, 2, 2, 1), "fsdp", "preset", "weights"),
           ((4, 2, 1, 1), "zero1", "preset", "weights"), ((2, 4, 1, 1), "ep", "data", "weights"),
           ((2, 2, 2, 1), "tp_sp", "all", "all"), ((2, 2, 1, 2), "megascale", "preset", "data")]
_ONE_DEVICE: dict[str, dict] = {}


def _sharded_updates(config, devices) -> tuple[dict, dict, int]:
  """(parameters before, after STEPS updates, bytes of the optimizer state on the first device) on `devices`,
  with the state placed as the layout places it. Checks the cost model's count of that state on the way."""
  plan = plan_for(config, devices)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  shardings = trainer.state_shardings

  def step(params, opt_state, grads):
    updates, opt_state = trainer.optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  update = jax.jit(step, in_shardings=(shardings.params, shardings.opt_state, shardings.params),
                   out_shardings=(shardings.params, shardings.opt_state))
  params, opt_state = state.params, state.opt_state
  before = _flat_arrays(params)
  for step in range(STEPS):
    params, opt_state = update(params, opt_state, _gradients(params, step))
  on_first = lambda tree: sum(shard.data.nbytes for leaf in jax.tree.leaves(tree) for shard in leaf.addressable_shards
                              if shard.device == devices[0])
  state_bytes = on_first(opt_state)
  modelled = cost_memory.memory_per_device(config, plan).optimizer
  if plan.distributed_optimizer:  # the model counts the float32 master (the state's parameters) with it
    modelled -= on_first(params)
  # Exact but for the counts and Muon's coefficients (replicated scalars the model leaves out).
  assert abs(modelled - state_bytes) <= 64, (modelled, state_bytes)
  return before, _flat_arrays(params), state_bytes


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("sizes,preset,weights,storage", LAYOUTS, ids=[f"{p}-{w}-{o}" for _, p, w, o in LAYOUTS])
def test_each_update_on_every_layout_equals_one_device(name, sizes, preset, weights, storage):
  """Three updates with the optimizer's state placed by the layout (split over `data` or every axis where
  the storage says so; Adafactor's factored statistics split like their weights) equal the same updates on
  one device; where the optimizer's state is split over all 8 devices, each holds at most a quarter of it."""
  config = _config(name)
  if name not in _ONE_DEVICE:
    config.mesh = MeshConfig(data=1, preset="dp")
    _ONE_DEVICE[name] = _sharded_updates(config, jax.devices()[:1])
  config.mesh = MeshConfig(**dict(zip(("data", "expert", "tensor", "sequence"), sizes)), preset=preset,
                           weight_storage=weights, optimizer_storage=storage)
  before, after, state_bytes = _sharded_updates(config, jax.devices())
  ref_before, ref_after, ref_bytes = _ONE_DEVICE[name]
  for path in ref_after:
    np.testing.assert_array_equal(before[path], ref_before[path], err_msg=path)
    assert_close(after[path] - before[path], ref_after[path] - ref_before[path], FP32_MODEL_RTOL, path)
  if storage == "all":
    assert state_bytes <= ref_bytes / 4, (state_bytes, ref_bytes)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_resumed_run_continues_bit_for_bit_with_each_optimizer(tmp_path, name):
  """Save after step 1, restore into a fresh run and take step 2: the loss and every parameter are the
  uninterrupted run's, bit for bit. Restoring that checkpoint with another optimizer is one ConfigError
  naming both, before anything is read."""
  config = _config(name)
  config.mesh = MeshConfig(data=2, expert=4, preset="ep")
  uninterrupted = _two_step_run(config, tmp_path=tmp_path)
  checkpointer = Checkpointer(tmp_path, CheckpointConfig(), name)
  loss, params = _two_step_run(config, resume_from=checkpointer)
  checkpointer.close()
  assert loss == uninterrupted[0]
  for path, value in uninterrupted[1].items():
    np.testing.assert_array_equal(params[path], value, err_msg=path)

  other = OPTIMIZERS[(OPTIMIZERS.index(name) + 1) % len(OPTIMIZERS)]
  mismatched = Checkpointer(tmp_path, CheckpointConfig(), other)
  with pytest.raises(ConfigError, match=f"optimizer.name='{other}'.*'{name}', the optimizer whose state checkpoint 1"):
    mismatched.restore_latest(None)  # refused before the state (here none) is looked at
  mismatched.close()


def test_bad_optimizer_settings_are_one_config_error_each():
  config = _config("adamw")
  for field, value, allowed in [("name", "sgd", "'adamw', 'muon', 'adafactor', 'lion'"),
                                ("muon_beta", 1.0, r"\[0, 1\)"), ("muon_update_rms", 0.0, "")]:
    bad = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, **{field: value}))
    with pytest.raises(ConfigError, match=f"optimizer.{field}=.*{allowed}"):
      bad.validate(8)


def _adamw_rounding_moments(cfg, flat_params: dict, flat_grads: list[dict]) -> tuple[dict, dict, dict]:
  """(parameters, first and second moments) after AdamW's updates written out in NumPy (float32), the moments
  rounded to bfloat16 after each (optimizer.moments_dtype); every update computes with the unrounded new
  moments, as optax does, and no clipping."""
  import ml_dtypes

  schedule = optimizer_lib.learning_rate_schedule(cfg, TOTAL_STEPS)
  b1, b2, eps = np.float32(cfg.b1), np.float32(cfg.b2), np.float32(cfg.eps)
  params = {p: v.copy() for p, v in flat_params.items()}
  mu = {p: np.zeros_like(v) for p, v in params.items()}
  nu = {p: np.zeros_like(v) for p, v in params.items()}
  for t, grads in enumerate(flat_grads, 1):
    rate = np.float32(schedule(t - 1))
    for path, g in grads.items():
      m = b1 * mu[path] + (1 - b1) * g
      v = b2 * nu[path] + (1 - b2) * g * g
      update = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
      if DECAYS.get(path.split("/")[-1], True):
        update = update + np.float32(cfg.weight_decay) * params[path]
      params[path] = params[path] - rate * update
      mu[path], nu[path] = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (m, v))
  return params, mu, nu


def test_bfloat16_moments_are_adamw_with_its_moments_rounded_each_update():
  """optimizer.moments_dtype="bfloat16" (DeepSeek-V3's recipe): three AdamW updates of tiny_moe's parameters
  equal AdamW written out here with its moments rounded to bfloat16 after each update; the state holds them
  in bfloat16, the cost model counts 2 bytes each (half of float32's), and it differs from float32 moments."""
  config = _config("adamw")
  config.optimizer = dataclasses.replace(config.optimizer, grad_clip_norm=0.0, moments_dtype="bfloat16")
  params = nnx.state(Transformer(config.model, rngs=nnx.Rngs(0)), nnx.Param)
  results = {}
  for dtype in ("bfloat16", "float32"):
    cfg = dataclasses.replace(config.optimizer, moments_dtype=dtype)
    optimizer = optimizer_lib.make_optimizer(cfg, TOTAL_STEPS, params)
    state, new_params, grads_seen = optimizer.init(params), params, []
    for step in range(STEPS):
      grads = _gradients(params, step)
      grads_seen.append(_flat_arrays(grads))
      updates, state = jax.jit(optimizer.update)(grads, state, new_params)
      new_params = optax.apply_updates(new_params, updates)
    results[dtype] = state, _flat_arrays(new_params)
  state, got = results["bfloat16"]
  before = _flat_arrays(params)
  want, mu, nu = _adamw_rounding_moments(config.optimizer, before, grads_seen)
  for path in want:
    assert_close(got[path] - before[path], want[path] - before[path], BF16_ROUNDING_RTOL, path)
  adam = state[0]  # optax.adamw's ScaleByAdamState
  for name, moments in (("mu", adam.mu), ("nu", adam.nu)):
    flat = _flat_arrays(moments)
    assert {x.dtype for x in jax.tree.leaves(moments)} == {jnp.dtype(jnp.bfloat16)}
    reference = mu if name == "mu" else nu
    for path in want:
      assert_close(flat[path], reference[path], BF16_ROUNDING_RTOL, f"{name} {path}")
    # Rounded alike but for the rare value that float32 arithmetic in another order puts across a boundary.
    differing = sum(int(np.sum(flat[p] != reference[p])) for p in want)
    assert differing <= 1e-3 * sum(v.size for v in reference.values()), (name, differing)
  assert any(not np.allclose(got[p], results["float32"][1][p], rtol=0, atol=0) for p in got)
  plan = plan_for(config, jax.devices()[:1])
  bf16 = cost_memory.memory_per_device(config, plan).optimizer
  config.optimizer = dataclasses.replace(config.optimizer, moments_dtype="float32")
  assert bf16 == pytest.approx(cost_memory.memory_per_device(config, plan).optimizer / 2)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_bfloat16_moments_are_placed_counted_and_resumed_bit_for_bit(tmp_path, name):
  """On tp_sp with the distributed optimizer, the bfloat16 statistics lie where float32 ones would and the
  cost model counts the state to the byte (`_sharded_updates`); a run resumes bit for bit, and a
  checkpoint of float32 statistics is one ConfigError for it, before anything is read."""
  config = _config(name)
  config.optimizer = dataclasses.replace(config.optimizer, moments_dtype="bfloat16")
  config.mesh = MeshConfig(data=2, expert=2, tensor=2, preset="tp_sp", weight_storage="all", optimizer_storage="all")
  _sharded_updates(config, jax.devices())
  config.mesh = MeshConfig(data=2, expert=4, preset="ep")
  uninterrupted = _two_step_run(config, tmp_path=tmp_path)
  checkpointer = Checkpointer(tmp_path, CheckpointConfig(), name, "bfloat16")
  loss, params = _two_step_run(config, resume_from=checkpointer)
  checkpointer.close()
  assert loss == uninterrupted[0]
  for path, value in uninterrupted[1].items():
    np.testing.assert_array_equal(params[path], value, err_msg=path)
  mismatched = Checkpointer(tmp_path, CheckpointConfig(), name, "float32")
  with pytest.raises(ConfigError, match="optimizer.moments_dtype='float32'.*'bfloat16', the dtype checkpoint 1"):
    mismatched.restore_latest(None)
  mismatched.close()


def test_bfloat16_moments_refuse_averages_too_slow_for_bfloat16():
  config = _config("adamw")
  for name, field, value in [("adamw", "b2", 0.999), ("lion", "b2", 0.995), ("muon", "muon_beta", 0.999)]:
    bad = dataclasses.replace(config, optimizer=dataclasses.replace(
        config.optimizer, name=name, moments_dtype="bfloat16", **{field: value}))
    with pytest.raises(ConfigError, match=rf"optimizer.{field}={value}.*at most 0.99 with optimizer.moments_dtype"):
      bad.validate(8)
  bad = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, name="adafactor",
                                                                  moments_dtype="bfloat16"))
  with pytest.raises(ConfigError, match="optimizer.moments_dtype='bfloat16'.*'float32' with adafactor"):
    bad.validate(8)
