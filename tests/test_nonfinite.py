"""NaN/Inf in training: caught at the step it appears, the update dropped on device, skipped and counted or
halted with a diagnostic naming the first non-finite parameter gradient; never trained on."""

import json
import re
import subprocess

import jax
import numpy as np
import pytest
from flax import nnx

from experiments.configs import tiny_moe
from meshmoe.config import MeshConfig, ResilienceConfig
from meshmoe.data import pipeline as data_lib
from meshmoe.runtime import nonfinite
from meshmoe.runtime.nonfinite import NonFiniteError
from meshmoe.training import model_state, trainer
from tests import runs
from tests.model_steps import plan_for
from tests.runs import REPO
from tests.test_model_sharded import small_config


def _monitor_and_params(policy="halt"):
  config = small_config()  # layer 0 dense, layer 1 MoE
  config.mesh = MeshConfig(data=2, expert=4, preset="ep")
  _, params, _ = nnx.split(model_state.init_model(config, plan_for(config)), nnx.Param, ...)
  return nonfinite.Monitor(ResilienceConfig(nan_policy=policy), config.model, params), params


def _metrics(params, bad: dict[str, int]) -> dict:
  """Step metrics whose per-layer gradient norms are finite except `bad` (leaf name -> layer)."""
  names, stacked = nonfinite.leaf_names(params), nonfinite.stacked_leaves(params)
  norms = []
  for name, leaf, is_stacked in zip(names, jax.tree.leaves(params), stacked, strict=True):
    value = np.ones(leaf.shape[0] if is_stacked else (), np.float32)
    if name in bad:
      value[bad[name]] = np.inf
    norms.append(value)
  return {"finite": np.bool_(not bad), "loss": np.float32(2.5), "grad_norm": np.float32(np.inf),
          "grad_sq_norms": norms}


def test_the_diagnostic_names_the_first_bad_gradient_in_forward_order():
  monitor, params = _monitor_and_params()
  bad = {"moe_layers/layer/ffn/gate_EDF": 0, "final_norm/scale": ..., "dense_layers/layer/attn/query_DNH": 0}
  with pytest.raises(NonFiniteError) as info:
    monitor.check(7, _metrics(params, bad), params)
  assert str(info.value) == (
      "step 7: non-finite training step (loss=2.5, grad_norm=inf); first non-finite gradient: "
      "dense_layers/layer/attn/query_DNH (layer 0) (3 parameter tensors or layers with non-finite gradients); "
      "non-finite parameters: none; stopped (resilience.nan_policy='halt'). The state was not updated at "
      "this step; the newest checkpoint holds the last good one")
  with pytest.raises(NonFiniteError, match=r"first non-finite gradient: moe_layers/layer/ffn/gate_EDF \(layer 1\)"):
    monitor.check(8, _metrics(params, {"moe_layers/layer/ffn/gate_EDF": 0, "final_norm/scale": ...}), params)


def test_a_non_finite_parameter_is_named_too():
  monitor, params = _monitor_and_params()
  router = params["moe_layers"]["layer"]["ffn"]["router"]["kernel_DE"]
  router[...] = router[...].at[0, 3, 1].set(np.nan)
  with pytest.raises(NonFiniteError, match=r"non-finite parameters: moe_layers/layer/ffn/router/kernel_DE "
                                           r"\(layer 1\); stopped"):
    monitor.check(3, _metrics(params, {"embed/table_VD": ...}), params)


def test_skip_counts_and_halts_after_too_many_in_a_row(capsys):
  monitor, params = _monitor_and_params("skip")
  monitor.cfg.max_consecutive_skips = 2
  good, bad = _metrics(params, {}), _metrics(params, {"embed/table_VD": ...})
  for step, metrics in enumerate([bad, good, bad, bad], start=1):
    monitor.check(step, metrics, params)
  assert monitor.skipped_steps == 3
  assert "warning: step 4: non-finite training step" in capsys.readouterr().out
  with pytest.raises(NonFiniteError, match=r"stopped \(3 non-finite steps in a row > "
                                           r"resilience.max_consecutive_skips=2\)"):
    monitor.check(5, bad, params)


class _Poisoned:
  """The training data with NaN in the loss mask of some batches: a corrupt batch, as a reader bug or a
  bad record would produce. Everything else is the real pipeline."""

  def __init__(self, inner, poisoned: set[int]):
    self.inner, self.poisoned, self.index = inner, poisoned, 0

  def __next__(self):
    batch = next(self.inner)
    self.index += 1
    if self.index in self.poisoned:  # the batch of step `index`
      batch = dict(batch, mask=batch["mask"].copy())
      batch["mask"][0, 0] = np.nan
    return batch

  def get_state(self):
    return self.inner.get_state()

  def source_token_counts(self):
    return self.inner.source_token_counts()

  def set_state(self, state):
    self.inner.set_state(state)


@pytest.mark.slow
def test_skip_drops_the_update_on_device_then_halts_when_told(tmp_path, monkeypatch, capsys):
  config = tiny_moe.get_config()
  config.model.num_layers = 2
  config.train.steps, config.train.seq_len, config.train.global_batch_size = 10, 32, 8
  config.train.log_every, config.train.eval_every, config.train.eval_batches = 1, 0, 1
  config.checkpoint.every_steps, config.checkpoint.keep = 1, 20
  config.resilience.nan_policy, config.resilience.max_consecutive_skips = "skip", 1
  build = data_lib.build_data
  monkeypatch.setattr(data_lib, "build_data", lambda *a, **k: _poison(build(*a, **k), {4, 6, 7}))

  with pytest.raises(NonFiniteError) as info:
    trainer.train(config, tmp_path)
  assert str(info.value).startswith("step 7: non-finite training step (loss=nan, grad_norm=nan); first "
                                    "non-finite gradient: embed/table_VD")
  assert "stopped (2 non-finite steps in a row > resilience.max_consecutive_skips=1)" in str(info.value)
  out = capsys.readouterr().out
  assert "warning: step 4: non-finite training step" in out and "(1 skipped so far" in out
  assert "warning: step 6: non-finite training step" in out and "(2 skipped so far" in out

  records = {r["step"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
  assert [records[s]["loss"] is None for s in range(1, 7)] == [False, False, False, True, False, True]
  assert [records[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 0, 1, 1, 2]
  # The logged rate is the one each update used: the skipped steps do not advance the warmup (update n of
  # it runs at peak * n / warmup_steps; steps 4 and 6 are skipped).
  peak, warmup = config.optimizer.learning_rate, config.optimizer.warmup_steps
  assert [records[s]["learning_rate"] for s in range(1, 7)] == pytest.approx(
      [peak * n / warmup for n in (1, 2, 3, 4, 4, 5)], rel=1e-6)
  saved = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
  assert saved == [1, 2, 3, 4, 5, 6]  # step 7 halted before its checkpoint
  learned = {s: {k: v for k, v in runs.checkpoint_arrays(tmp_path, s).items() if not k.startswith(("['step']",
                                                                                                   "['rng']"))}
             for s in (3, 4, 5, 6)}
  runs.assert_bitwise_equal(learned[3], learned[4])  # step 4's update was dropped
  runs.assert_bitwise_equal(learned[5], learned[6])
  assert any(not np.array_equal(learned[4][k], learned[5][k]) for k in learned[4])  # step 5 trained
  assert int(runs.checkpoint_arrays(tmp_path, 4)["['step']"]) == 4


def _poison(data, steps):
  data.train = _Poisoned(data.train, steps)
  return data


@pytest.mark.slow
def test_a_diverging_run_halts_with_a_clear_error(tmp_path):
  """A deliberately huge learning rate: step 1's update is finite but enormous, step 2 overflows."""
  flags = [*runs.SMALL_FLAGS, "--config.train.steps=5", "--config.checkpoint.every_steps=1",
           "--config.optimizer.learning_rate=1e30", "--config.optimizer.warmup_steps=0"]
  result = subprocess.run(runs.train_command(tmp_path, *flags), cwd=REPO, env=runs.env(processes=1),
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-2000:]
  assert re.search(r"error: step 2: non-finite training step \(loss=\S+, grad_norm=(nan|inf)\); first "
                   r"non-finite gradient: \S+", result.stderr), result.stderr[-3000:]
  assert "stopped (resilience.nan_policy='halt')" in result.stderr
  assert "Traceback" not in result.stderr
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1"]
