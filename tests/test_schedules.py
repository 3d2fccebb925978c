"""Learning-rate schedules (training/optimizer.py, `optimizer.schedule`): every update's rate equals a NumPy
reference written from the OptimizerConfig docstring, the first update's is not 0, and bad settings are one
ConfigError each."""

import math

import numpy as np
import pytest

from meshmoe.config import Config, ConfigError, OptimizerConfig
from meshmoe.training.optimizer import learning_rate_schedule

PEAK, RATIO = 2e-3, 0.1


def reference_rate(cfg: OptimizerConfig, total: int, count: int) -> float:
  """The rate of update n = count + 1 of `total`: peak * n / warmup during the warmup; then for "cosine"
  half a cosine from the peak (first update after the warmup) to peak * ratio (the last update); for "wsd"
  the peak until the last round(decay_fraction * total) updates (at least one), which fall from the peak to
  the end in the decay shape; "constant" the peak. A decay of one update runs at the end rate."""
  warmup, end = cfg.warmup_steps, PEAK * cfg.min_learning_rate_ratio
  if count < warmup:
    return PEAK * (count + 1) / warmup
  if cfg.schedule == "constant":
    return PEAK
  if cfg.schedule == "cosine":
    progress = (count - warmup) / (total - warmup - 1) if total - warmup > 1 else 1.0
    return end + (PEAK - end) * 0.5 * (1 + math.cos(math.pi * progress))
  start = max(total - max(1, round(cfg.decay_fraction * total)), warmup)
  if count < start:
    return PEAK
  progress = (count - start) / (total - start - 1) if total - start > 1 else 1.0
  factor = {"linear": 1 - progress, "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
            "1-sqrt": 1 - math.sqrt(progress)}[cfg.decay_shape]
  return end + (PEAK - end) * factor


CASES = [  # (schedule, warmup, total, decay fraction, decay shape)
    ("cosine", 5, 40, 0.2, "1-sqrt"), ("cosine", 0, 7, 0.2, "1-sqrt"), ("cosine", 50, 20, 0.2, "1-sqrt"),
    ("wsd", 5, 40, 0.25, "1-sqrt"), ("wsd", 5, 40, 0.25, "linear"), ("wsd", 3, 31, 0.3, "cosine"),
    ("wsd", 0, 10, 1.0, "linear"), ("wsd", 8, 10, 0.5, "1-sqrt"), ("wsd", 4, 20, 0.01, "cosine"),
    ("cosine", 6, 7, 0.2, "linear"),
    ("constant", 5, 12, 0.2, "1-sqrt"), ("constant", 0, 3, 0.2, "1-sqrt"),
]


@pytest.mark.parametrize("schedule,warmup,total,fraction,shape", CASES,
                         ids=[f"{s}-w{w}-t{t}-{f}-{d}" for s, w, t, f, d in CASES])
def test_every_update_rate_matches_the_reference(schedule, warmup, total, fraction, shape):
  cfg = OptimizerConfig(learning_rate=PEAK, warmup_steps=warmup, min_learning_rate_ratio=RATIO, schedule=schedule,
                        decay_fraction=fraction, decay_shape=shape)
  rate = learning_rate_schedule(cfg, total)
  got = np.array([float(rate(count)) for count in range(total)])
  want = np.array([reference_rate(cfg, total, count) for count in range(total)])
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
  assert got[0] > 0  # the first update moves the parameters
  if schedule != "constant" and total > warmup:
    assert got[-1] == pytest.approx(PEAK * RATIO, rel=1e-6)  # the last update runs at the end rate


@pytest.mark.parametrize("field,value,message", [
    ("schedule", "linear", "one of 'cosine', 'wsd', 'constant'"),
    ("decay_fraction", 0.0, r"a number in \(0, 1\]"),
    ("decay_fraction", 1.5, r"a number in \(0, 1\]"),
    ("decay_shape", "exp", "one of 'linear', 'cosine', '1-sqrt'"),
])
def test_bad_schedule_settings_are_one_clear_error(field, value, message):
  config = Config()
  setattr(config.optimizer, field, value)
  with pytest.raises(ConfigError, match=f"optimizer.{field}=.*is invalid: {message}"):
    config.validate(1)
