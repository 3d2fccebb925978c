"""The distributed optimizer (`mesh.optimizer_storage`, training/master_weights.py): a step equals one
device's AdamW step on any layout; the master, the moments and the resident weights lie and are typed as the
docstring says; a bfloat16 model computes what it computes from float32 weights; checkpoints move between
optimizer storages and a resumed run continues bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from experiments.configs import tiny_moe
from meshmoe.analysis import aot
from meshmoe.config import CheckpointConfig, ConfigError, MeshConfig, ParallelConfig
from meshmoe.training import master_weights, train_step
from meshmoe.training.checkpointing import Checkpointer
from tests.model_steps import initial_variables, plan_for, synthetic_batch
from tests.test_model_sharded import small_config
from tests.test_step import _flat, _step_on, _storage_step_config
from tests.tolerances import FP32_MODEL_RTOL, assert_close

MESH_FIELDS = ("data", "expert", "tensor", "sequence")
# (mesh sizes, preset, weight storage, optimizer storage, micro-batches): each adds a layout to the storage
# tests' (test_step.py) with the optimizer's state split further than the weights.
MASTER_STEPS = [((2, 4, 1, 1), "ep", "preset", "data", 1), ((2, 2, 2, 1), "tp_sp", "preset", "all", 2),
                ((2, 2, 1, 2), "megascale", "data", "all", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,weights,optimizer,accum", MASTER_STEPS,
                         ids=[f"{p}-{w}-{o}-accum_{a}" for _, p, w, o, a in MASTER_STEPS])
def test_distributed_optimizer_step_matches_single_device(sizes, preset, weights, optimizer, accum):
  """One optimizer step with float32 master weights and AdamW moments split over `data` (or every axis)
  while the model computes with the weights as the preset (and weight storage) places them: the loss, the
  updated parameters and both moments equal the same step on one device with no distributed optimizer."""
  mesh = MeshConfig(**dict(zip(MESH_FIELDS, sizes)), preset=preset, weight_storage=weights,
                    optimizer_storage=optimizer)
  config = _storage_step_config(mesh, "none")
  config.train.grad_accum_steps = accum
  reference = _storage_step_config(MeshConfig(data=1, preset="dp"), "none")
  reference.train.grad_accum_steps = accum
  (metrics, params, moments), (ref_metrics, ref_params, ref_moments) = (
      _step_on(config, jax.devices()), _step_on(reference, jax.devices()[:1]))
  for name in ("loss", "grad_norm"):
    assert_close(metrics[name], ref_metrics[name], FP32_MODEL_RTOL, name)
  assert params.keys() == ref_params.keys()
  for name in ref_params:
    assert_close(params[name], ref_params[name], FP32_MODEL_RTOL, f"parameter {name}")
    for moment in ("mu", "nu"):
      assert_close(moments[moment][name], ref_moments[moment][name], FP32_MODEL_RTOL, f"{moment} of {name}")


def _bfloat16_config(optimizer_storage: str, mesh_sizes=(2, 4, 1, 1)):
  config = small_config()
  config.model.dtype = "bfloat16"
  config.mesh = MeshConfig(**dict(zip(MESH_FIELDS, mesh_sizes)), preset="ep", optimizer_storage=optimizer_storage)
  return config


def test_master_weights_moments_and_resident_weights_lie_as_documented():
  """ep on data=2 x expert=4, optimizer storage "data", bfloat16: the master weights and the moments are
  float32 with `embed` split over `data`; the weights the model computes with are the preset's placement,
  bfloat16 for the matrices and float32 for the norms, the router and the vocabulary tables."""
  config = _bfloat16_config("data")
  plan = plan_for(config)
  _, state = train_step.create(config, plan)
  gate = state.params["moe_layers"]["layer"]["ffn"]["gate_EDF"][...]
  mu = optax.tree_utils.tree_get(state.opt_state, "mu")["moe_layers"]["layer"]["ffn"]["gate_EDF"][...]
  for array in (gate, mu):
    assert array.dtype == jnp.float32 and tuple(array.sharding.spec)[1:3] == ("expert", "data")

  weight_shardings = plan.weight_shardings(state.params)
  dtypes = master_weights.compute_dtypes(state.params, config.model.dtype)
  resident = jax.jit(lambda p: master_weights.resident(p, dtypes, weight_shardings))(state.params)
  expected = {"gate_EDF": jnp.bfloat16, "query_DNH": jnp.bfloat16, "down_FD": jnp.bfloat16,
              "kernel_DE": jnp.float32, "scale": jnp.float32, "table_VD": jnp.float32}
  seen = set()
  for path, variable in nnx.to_flat_state(resident):
    name = str(path[-1])
    if name in expected:
      seen.add(name)
      assert variable[...].dtype == expected[name], path
  assert seen == set(expected)
  resident_gate = resident["moe_layers"]["layer"]["ffn"]["gate_EDF"][...]
  preset_placement = NamedSharding(plan.mesh, plan.param_spec(("layers", "exp", "embed", "exp_mlp")))
  assert resident_gate.sharding.is_equivalent_to(preset_placement, resident_gate.ndim)
  np.testing.assert_array_equal(np.asarray(resident_gate, np.float32),
                                np.asarray(gate.astype(jnp.bfloat16), np.float32))


def test_bfloat16_model_computes_what_it_computes_from_float32_weights():
  """A bfloat16 model's first step on one device is the same bit for bit (loss, gradient norm, updated
  parameters, both moments) whether the model reads the float32 parameters (and casts them in each layer) or
  the distributed optimizer's resident copy: each weight's compute dtype (master_weights.compute_dtype) is
  the one its layer computes with (cast the router's kernel to bfloat16 and the loss differs)."""
  results = {}
  for storage in ("weights", "data"):
    config = _bfloat16_config(storage, (1, 1, 1, 1))
    config.optimizer.warmup_steps = 0
    results[storage] = _step_on(config, jax.devices()[:1])
  (metrics, params, moments), (ref_metrics, ref_params, ref_moments) = results["data"], results["weights"]
  assert metrics == ref_metrics
  assert params.keys() == ref_params.keys()
  for name in ref_params:
    np.testing.assert_array_equal(params[name], ref_params[name], err_msg=name)
    for moment in ("mu", "nu"):
      np.testing.assert_array_equal(moments[moment][name], ref_moments[moment][name], err_msg=f"{moment} {name}")


def test_optimizer_storage_refuses_gradient_compression():
  config = small_config()
  config.mesh = MeshConfig(data=2, expert=4, preset="ep", optimizer_storage="data")
  config.parallel.gradient_compression = "int8"
  with pytest.raises(ConfigError, match="mesh.optimizer_storage='data'"):
    config.validate()
  config.parallel.gradient_compression = "none"
  config.mesh.optimizer_storage = "everything"
  with pytest.raises(ConfigError, match="mesh.optimizer_storage.*'weights', 'data', 'all'"):
    config.validate()


def _two_step_run(config, tmp_path=None, resume_from=None):
  """Two train steps of `config` from its seed's state; with `tmp_path`, the state after step 1 is saved
  there; with `resume_from` (a checkpointer holding step 1), step 2 starts from the restored state."""
  plan = plan_for(config)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  batches = []
  for seed in (5, 6):
    inputs, targets = synthetic_batch(config, plan, seed=seed)
    batches.append({"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)})
  if resume_from is not None:
    state = resume_from.restore(1, state).state
  else:
    state, _ = trainer.train_step(state, batches[0])
    if tmp_path is not None:
      checkpointer = Checkpointer(tmp_path, CheckpointConfig(), config.optimizer.name, config.optimizer.moments_dtype)
      checkpointer.save(1, state, {"next_index": 1})
      checkpointer.wait()
      checkpointer.close()
  state, metrics = trainer.train_step(state, batches[1])
  return float(metrics["loss"]), _flat(state.params)


@pytest.mark.parametrize("saved,resumed", [("data", "data"), ("weights", "all"), ("all", "weights")])
def test_checkpoints_move_between_optimizer_storages_and_resume_exactly(tmp_path, saved, resumed):
  """A state saved after one step under one optimizer storage, restored under another (or the same) and
  stepped once more: the same storage continues bit for bit as the uninterrupted run; another storage
  continues the same run (equal to float32 rounding: only the summation order of the gradients changes)."""
  sizes = (2, 2, 1, 2)
  config_of = lambda storage: _storage_step_config(
      MeshConfig(**dict(zip(MESH_FIELDS, sizes)), preset="megascale", optimizer_storage=storage), "none")
  uninterrupted = _two_step_run(config_of(resumed))
  _two_step_run(config_of(saved), tmp_path=tmp_path)
  checkpointer = Checkpointer(tmp_path, CheckpointConfig())
  loss, params = _two_step_run(config_of(resumed), resume_from=checkpointer)
  checkpointer.close()
  if saved == resumed:
    assert loss == uninterrupted[0]
    for name, value in uninterrupted[1].items():
      np.testing.assert_array_equal(params[name], value, err_msg=name)
  else:
    assert_close(loss, uninterrupted[0], FP32_MODEL_RTOL, "loss")
    for name, value in uninterrupted[1].items():
      assert_close(params[name], value, FP32_MODEL_RTOL, name)


@pytest.mark.slow
def test_gpu_compile_sums_each_micro_batch_into_the_master_slices():
  """tiny_moe under tp_sp 2x2x2x1 with the optimizer over every axis, bfloat16, two micro-batches, compiled
  deviceless for 8 H100s: each kind of collective moves what the cost model says within 10% (the layers'
  gradients reduce-scattered into the master's slices per micro-batch, the weights gathered once per step,
  the embedding lookup's gradient gathered over `tensor` and its partial sums reduce-scattered: no whole
  table is all-reduced, sharding/embedding_lookup.py), and the peak memory is within 20% of the model's.
  (The all-reduce that remains is a few KB of small sums; it is held to 64 KB absolute, as test_cost_model
  holds such sums.)"""
  config = tiny_moe.get_config()
  config.mesh = MeshConfig(data=2, expert=2, tensor=2, sequence=1, preset="tp_sp", optimizer_storage="all")
  config.parallel = ParallelConfig(impl="xla")
  config.model.dtype, config.model.tie_embeddings = "bfloat16", False
  config.train.global_batch_size, config.train.grad_accum_steps = 32, 2
  report = aot.analyze(config.validate(8), "h100", 8).data
  by_kind = report["collective_bytes_by_kind"]
  assert by_kind["reduce-scatter"]["compiled"] > by_kind["all-reduce"]["compiled"]
  table_bytes = config.model.vocab_size * config.model.embed_dim * 4
  assert by_kind["all-reduce"]["compiled"] < table_bytes / 10, by_kind["all-reduce"]
  for kind in ("all-gather", "reduce-scatter"):
    assert by_kind[kind]["compiled"] == pytest.approx(by_kind[kind]["cost_model"], rel=0.10), (kind, by_kind[kind])
  all_reduce = by_kind["all-reduce"]
  assert all_reduce["compiled"] == pytest.approx(all_reduce["cost_model"], rel=0.10, abs=64e3), all_reduce
  memory = report["memory"]
  assert memory["peak_bytes_per_device"] == pytest.approx(memory["cost_model"]["total"], rel=0.20), memory


@pytest.mark.slow
def test_gpu_compile_of_folded_experts_moves_what_the_cost_model_says_per_kind():
  """tiny_moe under tp_sp 2x2x2x1 with every expert on its own device (mesh.expert_axes over data, expert
  and tensor: DeepSeek-V3's folding), the optimizer over every axis and the output layer's logits in chunks,
  compiled deviceless for 8 H100s: every kind of collective moves what the cost model says within 10%. What
  this layout adds to the test above, each a term the cost model once missed (DeepSeek-V3's compile: 1.77x
  its reduce-scatters, 1.56x its all-reduces): the router's gradient reduce-scattered per micro-batch and
  layer, the output table's formed whole, reduce-scattered over `tensor` and all-reduced over the rest per
  micro-batch (its chunk loop sums it first), and the ragged exchanges' int32 offsets."""
  config = tiny_moe.get_config()
  config.mesh = MeshConfig(data=2, expert=2, tensor=2, sequence=1, preset="tp_sp", optimizer_storage="all",
                           expert_axes="data,expert,tensor")
  config.parallel = ParallelConfig(impl="xla")
  config.model.dtype, config.model.tie_embeddings = "bfloat16", False
  config.model.logits_chunk_bytes = 64 * 1024  # each device's logits in 4 chunks
  config.train.global_batch_size, config.train.grad_accum_steps = 32, 2
  report = aot.analyze(config.validate(8), "h100", 8).data
  by_kind = report["collective_bytes_by_kind"]
  assert set(by_kind) >= {"all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all"}
  table_bytes = config.model.vocab_size * config.model.embed_dim * 4
  assert by_kind["all-reduce"]["compiled"] > table_bytes, by_kind["all-reduce"]  # the output table's sum
  for kind, row in by_kind.items():
    assert row["compiled"] == pytest.approx(row["cost_model"], rel=0.10), (kind, row)
