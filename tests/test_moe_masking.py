"""Masked tokens (padding: the loss mask's zeros) reach no MoE statistic (models/moe.py MoEBlock.route, the
router's statistics): on several layouts and tiers, a right-padded batch gives the expert loads (exactly),
the router losses and the cross-entropy of the same batch with the padding cut off, on one device. Also:
a masked token takes no capacity slot, and an all-masked batch gives zeros, not NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshmoe.config import MeshConfig, ParallelConfig
from meshmoe.models.capacity import _capacity_keep_sequence
from meshmoe.training import train_step
from tests.model_steps import init_model, plan_for
from tests.test_model_sharded import small_config
from tests.tolerances import FP32_MODEL_RTOL, assert_close

MESH_FIELDS = ("data", "expert", "tensor", "sequence")
PADDED_LEN, REAL_LEN = 16, 11  # every row: 11 counted tokens, then 5 masked ones
# (mesh sizes, preset, tier, layer schedule, context-parallel attention, capacity factor or "sequence": the
# sequence-wise balance loss). Capacity 0.5 gives each expert ceil(0.5 * S * 2 / 8) = 2 slots per sequence
# at S = 16 and at S = 11 alike, so the padded batch and the cut one drop the same assignments.
LAYOUTS = [((1, 1, 1, 1), "dp", "xla", "sequential", "allgather", None),
           ((2, 4, 1, 1), "ep", "xla", "sequential", "allgather", None),
           ((2, 4, 1, 1), "ep", "xla", "sequential", "allgather", 0.5),
           ((2, 2, 1, 2), "megascale", "reference", "two_halves", "ring", None),
           ((2, 2, 1, 2), "megascale", "reference", "two_halves", "ring", "sequence"),
           ((2, 2, 2, 1), "tp_sp", "xla", "sequential", "allgather", None)]


def _config(seq_len: int, variant=None):
  """small_config with three layers; `variant`: a capacity factor, or "sequence" (the sequence-wise loss)."""
  config = small_config(capacity_factor=None if variant in (None, "sequence") else variant)
  if variant == "sequence":
    config.model.moe.balance_loss = "sequence"
  config.model.num_layers = 3  # a dense layer, then two MoE layers: the second routes the first's outputs
  config.train.seq_len = seq_len
  return config


def _terms(config, devices, inputs, targets, mask):
  """train_step.loss_terms of one batch under `config`'s layout on `devices`."""
  plan = plan_for(config.validate(len(devices)), devices)
  graphdef, params, others = nnx.split(init_model(config, plan), nnx.Param, ...)
  sharding = plan.batch_sharding()
  batch = {"inputs": jax.device_put(inputs, sharding), "targets": jax.device_put(targets, sharding),
           "mask": jax.device_put(mask, sharding)}
  terms = jax.jit(lambda p, o, b: train_step.loss_terms(graphdef, p, o, b, plan))(params, others, batch)
  return jax.tree.map(np.asarray, terms)


def _batch():
  config = _config(PADDED_LEN)
  rng = np.random.default_rng(4)
  tokens = rng.integers(0, config.model.vocab_size, (config.train.global_batch_size, PADDED_LEN + 1), np.int32)
  tokens[:, REAL_LEN + 1:] = 0  # padding is token 0, as unpacked rows have it
  mask = (np.arange(PADDED_LEN) < REAL_LEN).astype(np.float32)[None].repeat(len(tokens), 0)
  return tokens[:, :-1], tokens[:, 1:], mask


_REFERENCES = {}


def _reference(capacity_factor):
  """The batch without its padding, unmasked, on one device."""
  if capacity_factor not in _REFERENCES:
    inputs, targets, _ = _batch()
    cut = lambda a: np.ascontiguousarray(a[:, :REAL_LEN])
    config = _config(REAL_LEN, capacity_factor)
    config.mesh = MeshConfig(data=1, preset="dp")
    _REFERENCES[capacity_factor] = _terms(config, jax.devices()[:1], cut(inputs), cut(targets),
                                          np.ones((len(inputs), REAL_LEN), np.float32))
  return _REFERENCES[capacity_factor]


@pytest.mark.parametrize("sizes,preset,impl,schedule,attention,capacity", LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, m))}-{i}-{s}-capacity_{c}" for m, p, i, s, _, c in LAYOUTS])
def test_padding_changes_no_routing_statistic_or_loss(sizes, preset, impl, schedule, attention, capacity):
  reference = _reference(capacity)
  config = _config(PADDED_LEN, capacity)
  config.mesh = MeshConfig(**dict(zip(MESH_FIELDS, sizes)), preset=preset)
  config.parallel = ParallelConfig(impl=impl, layer_schedule=schedule, attention=attention)
  devices = jax.devices()[:int(np.prod(sizes))]
  terms = _terms(config, devices, *_batch())
  assert terms["tokens"] == reference["tokens"] == 8 * REAL_LEN
  np.testing.assert_array_equal(terms["expert_load"], reference["expert_load"])  # counts: exact
  assert np.all(terms["expert_load"].sum(axis=-1) == 8 * REAL_LEN * config.model.moe.top_k)  # the choices
  for name in ("aux_loss", "z_loss", "ce_sum", "dropped_fraction"):
    assert_close(terms[name], reference[name], FP32_MODEL_RTOL, name)
  if capacity not in (None, "sequence"):
    assert terms["dropped_fraction"].min() > 0  # the capacity binds


def test_a_masked_token_takes_no_capacity_slot():
  """Capacity priority with masked tokens' assignments (id E) among the real ones keeps exactly what it
  keeps for the real tokens alone, at the same capacity."""
  rng = np.random.default_rng(0)
  num_experts, cap = 4, 3
  real_SK = rng.integers(0, num_experts, (10, 2))
  masked = np.array([1, 4, 5, 8])
  padded_SK = np.full((14, 2), num_experts)
  padded_SK[np.setdiff1d(np.arange(14), masked)] = real_SK
  kept_padded = np.asarray(_capacity_keep_sequence(jnp.asarray(padded_SK), num_experts, cap))
  kept_real = np.asarray(_capacity_keep_sequence(jnp.asarray(real_SK), num_experts, cap))
  np.testing.assert_array_equal(kept_padded[np.setdiff1d(np.arange(14), masked)], kept_real)
  assert not kept_real.all()  # the capacity binds


def test_an_all_masked_batch_gives_zero_statistics_not_nan():
  config = _config(PADDED_LEN)
  config.mesh = MeshConfig(data=1, preset="dp")
  inputs, targets, mask = _batch()
  terms = _terms(config, jax.devices()[:1], inputs, targets, np.zeros_like(mask))
  assert not terms["expert_load"].any()
  for name in ("aux_loss", "z_loss", "ce_sum", "tokens"):
    assert terms[name] == 0, name
