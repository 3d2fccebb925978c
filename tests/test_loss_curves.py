"""Twenty training steps give the same loss curve on every preset (and ring attention) as on one device.

The full train step runs (AdamW, clipping, the expert-bias update, grad accumulation on one layout), so a
wrong gradient anywhere shows up as a curve that drifts away from the single-device one.
"""

import jax
import numpy as np
import pytest

from meshmoe.config import MeshConfig, ParallelConfig
from meshmoe.training import train_step
from tests.model_steps import initial_variables, plan_for
from tests.test_model_sharded import small_config
from tests.tolerances import FP32_MODEL_RTOL, assert_close

STEPS = 20


def _config(**overrides):
  config = small_config(expert_bias=True)
  config.train.steps = STEPS
  config.optimizer.warmup_steps = 2
  for name, value in overrides.items():
    setattr(config.train, name, value)
  return config


def _batches(config):
  rng = np.random.default_rng(11)
  b, s = config.train.global_batch_size, config.train.seq_len
  for _ in range(STEPS):
    tokens = rng.integers(0, config.model.vocab_size, (b, s + 1), dtype=np.int32)
    yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((b, s), np.float32)}


def _loss_curve(config, devices) -> np.ndarray:
  config.validate(len(devices))
  plan = plan_for(config, devices)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  losses = []
  for batch in _batches(config):
    state, metrics = trainer.train_step(state, train_step.place_batch(batch, config, plan))
    losses.append(float(metrics["loss"]))
  return np.array(losses)


_REFERENCE = {}


def _reference(accum: int) -> np.ndarray:
  if accum not in _REFERENCE:
    config = _config(grad_accum_steps=accum)
    config.mesh = MeshConfig(data=1, preset="dp")
    _REFERENCE[accum] = _loss_curve(config, jax.devices()[:1])
  return _REFERENCE[accum]


# One layout per preset (the optimizer state is sharded per preset) plus ring attention: test_model_sharded
# checks every layout's gradients; this checks what only whole steps do (AdamW on sharded state, clipping
# with a global norm, the expert-bias update). One megascale layout accumulates 2 micro-batches per step
# (against a one-device run that accumulates them too).
CURVE_LAYOUTS = [((8, 1, 1, 1), "dp", "allgather", 1), ((8, 1, 1, 1), "fsdp", "allgather", 1),
                 ((4, 2, 1, 1), "zero1", "allgather", 1), ((2, 4, 1, 1), "ep", "allgather", 1),
                 ((2, 1, 2, 2), "tp_sp", "ring", 1), ((1, 2, 2, 2), "megascale", "allgather", 2),
                 ((2, 2, 1, 2), "megascale", "ring", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,attention,accum", CURVE_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}-{a}" + ("-accum2" if n > 1 else "")
                              for s, p, a, n in CURVE_LAYOUTS])
def test_loss_curve_matches_single_device(sizes, preset, attention, accum):
  reference = _reference(accum)
  assert reference[-1] < reference[0] - 0.1, "the reference run must learn for the comparison to mean much"
  config = _config(grad_accum_steps=accum)
  data, expert, tensor, sequence = sizes
  config.mesh = MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset)
  config.parallel = ParallelConfig(attention=attention)
  assert_close(_loss_curve(config, jax.devices()), reference, FP32_MODEL_RTOL, "loss curve")
