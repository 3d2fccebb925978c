"""Compressed gradient sums over `data` with error feedback (sharding/gradient_sync.py), on 8 CPU devices.

References, all computed here independently of the module: the exact float32 sum over the replicas, the
scaled-sign compressor written out in numpy, and the exact model's gradients. Bounds (derived in the
module docstring): int8 loses at most half a quantisation step, max|block| / 254, per element and phase;
the sign compressor sends sign(v) * mean|block|; bfloat16 rounds to 2^-9 relative per addition. With error
feedback, nothing is lost: the compressed sum plus the new residuals equals the exact sum plus the old
residuals, up to the second phase's rounding.
"""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from experiments.configs import tiny_moe
from meshmoe.config import ConfigError, MeshConfig, ParallelConfig
from meshmoe.models.decoder import combine_loss_terms
from meshmoe.sharding import gradient_sync
from meshmoe.sharding.gradient_sync import BLOCK
from meshmoe.training import train_step
from meshmoe.training.model_state import abstract_gradient_residual
from tests import runs
from tests.model_steps import initial_variables, plan_for, synthetic_batch

SHAPE = (3, 200)  # 600 values per device: padded to R x 2 blocks of 128 (R x 1 for 8 replicas)


def _per_device(compression, g_RX, e_RX, axes=("data",)):
  """compressed_sum over mesh `axes` of a data=4 x expert=2 mesh: replica r's values are row r of g_RX
  (and of the residual; replicated over the other axis)."""
  mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def body(g, e):
    total, lost = gradient_sync.compressed_sum(g[0], e[0], compression, axes, len(g_RX))
    return total[None], lost[None]

  spec = PartitionSpec(axes)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False))
  totals, lost = f(g_RX, e_RX)
  return np.asarray(totals), np.asarray(lost)


def _inputs(replicas, seed=0):
  g = jax.random.normal(jax.random.key(seed), (replicas, *SHAPE)) * jnp.linspace(0.01, 3.0, SHAPE[1])
  e = 0.05 * jax.random.normal(jax.random.key(seed + 1), (replicas, *SHAPE))
  return np.asarray(g), np.asarray(e)


def _per_block(x_X, reduce):
  """reduce(|x|) over each value's block, in the module's blocking (the values in order, zero-padded; the
  padding is a multiple of BLOCK, so it never shares a block with a value)."""
  flat = np.abs(x_X.reshape(-1))
  padded = np.pad(flat, (0, -flat.size % BLOCK))
  return np.repeat(reduce(padded.reshape(-1, BLOCK), axis=1), BLOCK)[:flat.size].reshape(x_X.shape)


@pytest.mark.parametrize("compression,axes", [("bfloat16", ("data",)), ("int8", ("data",)), ("sign", ("data",)),
                                              ("int8", ("data", "expert")), ("sign", ("data", "expert"))])
def test_compressed_sum_within_its_bound(compression, axes):
  g, e = _inputs(4 * len(axes))
  totals, lost = _per_device(compression, g, e, axes)
  v = g + e
  sent = v - lost  # what each replica's compression kept
  assert all(np.array_equal(totals[0], t) for t in totals)  # the same sum on every replica
  if compression == "bfloat16":
    np.testing.assert_array_equal(sent, v.astype(jnp.bfloat16).astype(np.float32))
    bound = len(g) * 2.0**-8 * np.abs(sent).sum(axis=0)  # each bfloat16 addition rounds its partial sum
  else:
    if compression == "int8":
      assert np.all(np.abs(lost) <= np.stack([_per_block(x, np.max) for x in v]) / 254 * (1 + 1e-6))
    else:
      np.testing.assert_allclose(sent, np.sign(v + (v == 0)) * np.stack([_per_block(x, np.mean) for x in v]),
                                 rtol=1e-6)
    bound = _per_block(sent.sum(axis=0), np.max) / 254 * (1 + 1e-6) + 1e-6  # the second phase: the sum as int8
  assert np.all(np.abs(totals[0] - sent.sum(axis=0)) <= bound)
  # Error feedback loses nothing: the sum plus the new residuals is the exact sum plus the old ones.
  assert np.all(np.abs(totals[0] + lost.sum(axis=0) - v.sum(axis=0)) <= bound + 1e-5)


def test_int8_error_is_what_its_step_allows_and_no_more():
  """The int8 bound is tight: a value half a step from its neighbours loses the whole half step."""
  g = np.zeros((4, *SHAPE), np.float32)
  g[:, 0, 0] = 127.0  # block max: a step of exactly 1
  g[:, 0, 1] = 0.5 + 1e-3  # rounds up: loses 0.5 - 1e-3
  totals, lost = _per_device("int8", g, np.zeros_like(g))
  np.testing.assert_allclose(lost[:, 0, 1], -(0.5 - 1e-3), rtol=1e-4)
  np.testing.assert_allclose(totals[0, 0, :2], [4 * 127.0, 4.0], rtol=1e-6)


# (data, expert, tensor, sequence), preset, tier, layer schedule, compression
MODEL_LAYOUTS = [((2, 4, 1, 1), "ep", "xla", "sequential", "int8"),
                 ((2, 2, 1, 2), "megascale", "xla", "two_halves", "sign"),
                 ((2, 2, 2, 1), "tp_sp", "reference", "sequential", "int8"),
                 ((4, 2, 1, 1), "ep", "reference", "sequential", "bfloat16")]


def _config(sizes, preset, impl, schedule, compression):
  config = tiny_moe.get_config()
  data, expert, tensor, sequence = sizes
  config.mesh = MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset)
  config.parallel = ParallelConfig(impl=impl, layer_schedule=schedule, gradient_compression=compression,
                                   gradient_error_feedback=True)
  return config.validate(8)


def _loss_and_grads(config, plan, model_state, residual, inputs, targets):
  graphdef, params, others = model_state

  def loss_of(params, residual):
    batch = {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}
    terms = train_step.loss_terms(graphdef, params, others, batch, plan, residual)
    return combine_loss_terms(terms, config.model.moe, terms["tokens"], num_microbatches=1)

  return jax.jit(jax.grad(loss_of, argnums=(0, 1)))(params, residual)


def _random_residual(config, plan, scale, seed=3):
  abstract = abstract_gradient_residual(config, plan)
  keys = iter(jax.random.split(jax.random.key(seed), 3))
  return jax.tree.map(lambda a: jax.device_put(scale * jax.random.normal(next(keys), a.shape), a.sharding),
                      abstract)


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,impl,schedule,compression", MODEL_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}-{i}-{l}-{c}" for s, p, i, l, c in MODEL_LAYOUTS])
def test_model_gradients_with_compressed_expert_sums(sizes, preset, impl, schedule, compression):
  """Every gradient but the routed experts' equals the exact run's; the experts' are the compressed sums:
  with error feedback, exact plus the old residuals minus the new, to the second phase's rounding (under
  two halves too: both halves' gradients add up before the one sum)."""
  config = _config(sizes, preset, impl, schedule, compression)
  exact_config = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, gradient_compression="none"))
  plan, exact_plan = plan_for(config), plan_for(exact_config)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  model_state = (trainer.graphdef, state.params, state.others)
  inputs, targets = synthetic_batch(config, plan)
  exact, _ = _loss_and_grads(exact_config, exact_plan, model_state, None, inputs, targets)
  experts = lambda tree: {k: v for k, v in _flat(tree).items() if k.rsplit("/", 1)[-1].endswith(("EDF", "EFD"))}
  scale = max(float(jnp.max(jnp.abs(g))) for g in experts(exact).values())
  residual = _random_residual(config, plan, 3 * scale) if plan.gradient_feedback else None
  grads, new_residual = _loss_and_grads(config, plan, model_state, residual, inputs, targets)

  others = {k: v for k, v in _flat(grads).items() if k not in experts(grads)}
  assert others
  for name, g in others.items():
    np.testing.assert_allclose(g, _flat(exact)[name], rtol=1e-5, atol=1e-7, err_msg=name)
  old = {"gate_EDF": 0, "up_EDF": 0, "down_EFD": 0}
  new = dict(old)
  if residual is not None:
    old = {k: np.asarray(v).sum(axis=1) for k, v in zip(("gate_EDF", "up_EDF", "down_EFD"), jax.tree.leaves(residual))}
    new = {k: np.asarray(v).sum(axis=1) for k, v in zip(("gate_EDF", "up_EDF", "down_EFD"),
                                                          jax.tree.leaves(new_residual))}
  for name, g in experts(grads).items():
    weight = name.rsplit("/", 1)[-1]
    exact_g = np.asarray(_flat(exact)[name])
    sent = exact_g + old[weight] - new[weight]  # what the replicas' compressions kept, summed
    if compression == "bfloat16":  # no feedback; each bfloat16 addition rounds its partial sum (2^-9), and a
      # replica's part is taken at most twice the whole's magnitude
      atol = plan.axis_size(plan.gradient_replica_axes) * 2.0**-8 * 2 * np.abs(exact_g).max()
    else:  # one sum of all layers per step: the second phase's half step, at most max|sent| / 254
      atol = np.abs(sent).max() / 254 * (1 + 1e-5) + 1e-7
    np.testing.assert_allclose(g, sent, rtol=0, atol=atol, err_msg=name)
    if residual is not None:  # the check is far tighter than the residual it accounts for
      assert atol < 0.05 * np.abs(old[weight]).max()


def _flat(tree):
  leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  value = lambda v: np.asarray(v.get_value() if isinstance(v, nnx.Variable) else v)
  return {jax.tree_util.keystr(p, simple=True, separator="/"): value(v) for p, v in leaves}


@pytest.mark.slow
def test_train_step_feeds_each_micro_batch_what_the_previous_one_lost():
  """With two micro-batches each one's compressed sum is a round of error feedback: the first takes the old
  residual, the second what the first lost, and the step keeps what the second lost. Against the two
  micro-batches' gradients taken one by one."""
  config = _config((2, 4, 1, 1), "ep", "xla", "sequential", "sign")
  config.train.global_batch_size, config.train.grad_accum_steps = 32, 2
  config = config.validate(8)
  plan = plan_for(config)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  state.grad_residual = _random_residual(config, plan, 1e-3)
  inputs, targets = synthetic_batch(config, plan)
  batch = {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}
  old = state.grad_residual

  @jax.jit  # one program for both micro-batches (arguments, not constants)
  def residual_gradient(micro, residual):
    def loss_of(residual):
      terms = train_step.loss_terms(trainer.graphdef, state.params, state.others, micro, plan, residual)
      return combine_loss_terms(terms, config.model.moe, jnp.sum(batch["mask"]), 2)
    return jax.grad(loss_of)(residual)

  micro = [{k: v[i::2] for k, v in batch.items()} for i in range(2)]  # rows i, i + 2, ...: the step's split
  expected = residual_gradient(micro[1], residual_gradient(micro[0], old))
  new_state, metrics = trainer.train_step(state, batch)
  assert bool(metrics["finite"])
  for got, want in zip(jax.tree.leaves(new_state.grad_residual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_plan_names_the_compression_and_refuses_where_nothing_is_summed_over_data():
  plan = plan_for(_config((2, 4, 1, 1), "ep", "xla", "sequential", "int8"))
  assert plan.ops["gradients"].implementation == "int8" and plan.gradient_feedback
  assert "error feedback" in plan.table() and plan.gradient_replica_axes == ("data",)
  # megascale splits the tokens over `sequence` too: those devices are replicas of the same experts.
  assert plan_for(_config((2, 2, 1, 2), "megascale", "xla", "sequential", "int8")).gradient_replica_axes == (
      "data", "sequence")
  assert not plan_for(_config((2, 4, 1, 1), "ep", "xla", "sequential", "bfloat16")).gradient_feedback
  with pytest.raises(ConfigError, match="there are no replicas to sum over"):
    plan_for(_config((1, 8, 1, 1), "ep", "xla", "sequential", "int8"))
  dense = _config((8, 1, 1, 1), "dp", "reference", "sequential", "sign")
  dense.model.num_dense_layers = dense.model.num_layers
  with pytest.raises(ConfigError, match="no MoE layers"):
    plan_for(dense)
  with pytest.raises(ConfigError, match="gradient_compression='zstd' is invalid"):
    _config((8, 1, 1, 1), "dp", "reference", "sequential", "zstd")


def test_residual_is_float32_split_over_data_and_the_experts():
  config = _config((2, 4, 1, 1), "ep", "xla", "sequential", "int8")
  plan = plan_for(config)
  gate = abstract_gradient_residual(config, plan).gate_EDF
  m = config.model
  assert gate.shape == (m.num_layers - m.num_dense_layers, 2, m.moe.num_experts, m.embed_dim, m.moe.expert_mlp_dim)
  assert gate.dtype == jnp.float32
  assert gate.sharding.is_equivalent_to(NamedSharding(plan.mesh, PartitionSpec(None, "data", "expert")), gate.ndim)


@pytest.mark.slow
def test_killed_run_resumes_bitwise_with_its_residual(tmp_path):
  """The residual is checkpointed with the state: a run resumed from the step-3 checkpoint of an uninterrupted
  run (what a run stopped after it finds; copied rather than made again by a second process) ends with
  bitwise the same parameters, optimizer state and residual as the uninterrupted run; a run resumed without
  compression leaves the residual on disk, and one resumed with it from a checkpoint without (or on another
  number of data replicas) starts it from zero."""
  flags = [*runs.SMALL_FLAGS, "--config.mesh.data=2", "--config.mesh.expert=4", "--config.parallel.impl=xla",
           "--config.train.global_batch_size=16", "--config.train.grad_accum_steps=2",
           "--config.checkpoint.every_steps=3", "--config.parallel.gradient_compression=sign",
           "--config.parallel.gradient_error_feedback=true"]
  runs.run(runs.train_command(tmp_path / "whole", *flags, "--config.train.steps=6"))
  shutil.copytree(tmp_path / "whole" / "checkpoints" / "3", tmp_path / "resumed" / "checkpoints" / "3")
  result = runs.run(runs.train_command(tmp_path / "resumed", *flags, "--config.train.steps=6"))
  assert "resuming from the checkpoint of step 3" in result.stdout
  whole, resumed = runs.checkpoint_arrays(tmp_path / "whole", 6), runs.checkpoint_arrays(tmp_path / "resumed", 6)
  assert any(name.startswith("grad_residual") for name in whole)
  assert any(np.abs(v).max() > 0 for name, v in whole.items() if name.startswith("grad_residual"))
  runs.assert_bitwise_equal(whole, resumed)
  exact = [flag for flag in flags if "gradient_compression" not in flag]
  runs.run(runs.train_command(tmp_path / "whole", *exact, "--config.train.steps=7"))
  assert not any(name.startswith("grad_residual") for name in runs.checkpoint_arrays(tmp_path / "whole", 7))
  result = runs.run(runs.train_command(tmp_path / "whole", *flags, "--config.train.steps=8"))
  assert "checkpoint 7 holds none (saved without" in result.stdout
  assert "resuming from the checkpoint of step 7" in result.stdout
  other_mesh = [flag.replace("data=2", "data=4").replace("expert=4", "expert=2") for flag in flags]
  result = runs.run(runs.train_command(tmp_path / "whole", *other_mesh, "--config.train.steps=9"))
  assert "(another mesh)" in result.stdout and "resuming from the checkpoint of step 8" in result.stdout
