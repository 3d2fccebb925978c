"""Capped MoE receive buffers (`parallel.moe_buffer_factor`, sharding/expert_parallel.py "Receive buffers")
and their dropless fallback, on 8 CPU devices.

- The op: where routing fits the buffers, the capped exchange (padded on CPU, and the GPU's ragged one
  through an emulation of ragged_all_to_all) gives the one-device MoE's output and gradients; the use it
  reports is the fullest device's received rows over its buffer, counted here from the routing and the
  mesh alone; where a buffer overflows, the use is above 1.
- The train step: an overflowing step is not taken (state, step count and key unchanged), and its fallback
  is the dropless run's step bit for bit.
- A run: every overflowing step is redone by the fallback, logged, and the run ends where a run with
  worst-case buffers ends.
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshmoe.config import ConfigError, MeshConfig, ParallelConfig
from meshmoe.models.layers import swiglu_hidden
from meshmoe.sharding import expert_parallel
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.shardings import use_plan
from meshmoe.training import train_step
from tests import runs
from tests.model_steps import initial_variables, plan_for, synthetic_batch
from tests.test_expert_parallel import (K, _emulated_ragged_all_to_all, _inputs, _sharded, assert_matches,
                                        local_moe, output_and_grads)
from tests.test_model_sharded import small_config
from tests.tolerances import FP32_MODEL_RTOL, FP32_MODULE_RTOL, assert_close

# (mesh sizes, preset): the buffers are capped where f x T x K rows are fewer than the worst case,
# ep x T x min(K, E/ep): ep 8 and 4 with one and two local experts, megascale's ep 4 (expert x sequence).
CAPPED = [((1, 8, 1, 1), "ep"), ((2, 4, 1, 1), "ep"), ((1, 4, 1, 2), "megascale")]
_IDS = [f"{p}-{'x'.join(map(str, s))}" for s, p in CAPPED]


def _capped_op(sizes, preset, factor):
  """(the op returning (y, buffer use), place, plan) under the reference tier with capped buffers."""
  parallel = ParallelConfig(grouped_gemm="blocked", moe_buffer_factor=factor)
  _, place, mesh = _sharded(sizes, preset, parallel)
  plan = ParallelPlan.for_mesh(mesh, preset, parallel)

  def fn(x, experts, weights, w):
    with use_plan(plan):
      return expert_parallel.moe_ffn_and_buffer_use(x, experts, weights, w, swiglu_hidden)

  return fn, place, plan


def _reference_use(plan, experts, factor) -> float:
  """The fullest device's received rows over its buffer, from the mesh and the routing alone: device d
  (index i along the expert axes) receives every assignment to its experts [i*L, (i+1)*L) from the tokens
  of the devices that share its coordinates on the other axes; its buffer holds f x its tokens x K rows."""
  lay = plan.expert_layout()
  local = 8 // lay.ep
  sharding = plan.activation_sharding(("act_batch", "act_seq", None))
  held = {d: np.asarray(experts)[index] for d, index in sharding.devices_indices_map(experts.shape).items()}
  names, grid = plan.mesh.axis_names, plan.mesh.devices
  coords = {d: dict(zip(names, np.argwhere(grid == d)[0])) for d in grid.flat}
  uses = []
  for d in grid.flat:
    others = {a: c for a, c in coords[d].items() if a not in lay.expert_axes}
    group = [g for g in grid.flat if all(coords[g][a] == c for a, c in others.items())]
    i = np.ravel_multi_index([coords[d][a] for a in lay.expert_axes], [plan.mesh.shape[a] for a in lay.expert_axes])
    received = sum(int(np.sum((held[g] >= i * local) & (held[g] < (i + 1) * local))) for g in group)
    tokens = held[d].shape[0] * held[d].shape[1]
    uses.append(received / expert_parallel.receive_rows(tokens, K, local, lay.ep, factor))
  return max(uses)


@pytest.mark.parametrize("exchange", ["padded", "ragged"])
@pytest.mark.parametrize("sizes,preset", CAPPED, ids=_IDS)
def test_capped_buffers_give_the_one_device_result_where_routing_fits(sizes, preset, exchange, monkeypatch):
  if exchange == "ragged":
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    monkeypatch.setitem(expert_parallel._EXCHANGES, "padded_all_to_all",
                        expert_parallel._EXCHANGES["ragged_all_to_all"])
  x, experts, weights, w = _inputs("dropped")
  fn, place, plan = _capped_op(sizes, preset, 2.0)
  lay = plan.expert_layout()
  tokens = 64 // plan.axis_size(lay.expert_axes) // (8 // plan.axis_size(lay.expert_axes))
  assert expert_parallel.receive_rows(tokens, K, 8 // lay.ep, lay.ep, 2.0) < lay.ep * expert_parallel.peer_slot(
      tokens, K, 8 // lay.ep)  # capped indeed
  _, use = jax.jit(fn)(*place(x, experts, weights, w))
  assert float(use) == pytest.approx(_reference_use(plan, experts, 2.0)) and 0 < float(use) <= 1
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  assert_matches(output_and_grads(lambda *a: fn(*a)[0], *place(x, experts, weights, w), cotangent),
                 output_and_grads(local_moe, x, experts, weights, w, cotangent))


@pytest.mark.parametrize("sizes,preset", CAPPED[:2], ids=_IDS[:2])
def test_an_overflowing_buffer_reports_a_use_above_one(sizes, preset):
  """70% of the first choices go to expert 0: its device is sent more rows than 2x balanced routing."""
  x, experts, weights, w = _inputs("uneven")
  fn, place, plan = _capped_op(sizes, preset, 2.0)
  y, use = jax.jit(fn)(*place(x, experts, weights, w))
  assert float(use) == pytest.approx(_reference_use(plan, experts, 2.0)) and float(use) > 1
  # Rows were left out: the output is wrong, which is why the train step redoes such a step.
  assert not np.allclose(np.asarray(y), np.asarray(local_moe(x, experts, weights, w)), atol=1e-3)


@pytest.mark.parametrize("exchange", ["padded", "ragged"])
def test_an_overflowing_buffer_keeps_its_first_rows_and_returns_zeros_for_the_rest(exchange, monkeypatch):
  """ep over 8 (device d holds expert d and batch row d), 70% of the first choices to expert 0: device 0's
  buffer of 2x the balanced rows keeps the first rows in peer order (each peer's in its own order) and the
  rest never come back. The op then equals the one-device op with exactly those assignments dropped,
  counted here from the routing: nothing is written past a buffer's end, nothing read back from there."""
  if exchange == "ragged":
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    monkeypatch.setitem(expert_parallel._EXCHANGES, "padded_all_to_all",
                        expert_parallel._EXCHANGES["ragged_all_to_all"])
  x, experts, weights, w = _inputs("uneven")
  fn, place, _ = _capped_op((1, 8, 1, 1), "ep", 2.0)
  y, use = jax.jit(fn)(*place(x, experts, weights, w))
  held = expert_parallel.receive_rows(8, K, 1, 8, 2.0)
  routed = np.asarray(experts)  # [B = sender device, S, K]
  kept = routed.copy()
  for expert in range(8):  # the receiver's rows: senders in order, each sender's assignments in order
    rows = [(b, s, k) for b in range(routed.shape[0]) for s, k in np.ndindex(routed.shape[1:])
            if routed[b, s, k] == expert]
    for b, s, k in rows[held:]:
      kept[b, s, k] = 8  # left out: as if dropped
  assert float(use) > 1 and (kept != routed).any()
  want = local_moe(x, jnp.asarray(kept), weights, w)
  assert_close(y, want, FP32_MODULE_RTOL, "output of the kept rows")


def test_worst_case_buffers_report_no_use_and_add_no_collective():
  """factor 0 (the default) is the dropless worst case: no use is reported and nothing is reduced for it
  (with capped buffers, one float32 max over the devices per layer)."""
  x, experts, weights, w = _inputs("balanced")
  for factor, reductions in ((0.0, 0), (2.0, 1)):
    fn, place, _ = _capped_op((1, 8, 1, 1), "ep", factor)
    _, use = jax.jit(fn)(*place(x, experts, weights, w))
    assert (float(use) == 0.0) == (factor == 0.0)
    hlo = jax.jit(fn).lower(*place(x, experts, weights, w)).compile().as_text()
    assert hlo.count("all-reduce(") == reductions, hlo.count("all-reduce(")


def _step_config(factor: float):
  config = small_config()
  config.mesh = MeshConfig(data=1, expert=8, preset="ep")
  config.train.grad_accum_steps = 2
  config.train.global_batch_size = 16  # each micro-batch: one sequence of 16 tokens per device
  config.parallel.moe_buffer_factor = factor
  return config


def _first_step(config):
  plan = plan_for(config)
  trainer, state = train_step.create(config, plan, initial_variables(config, plan))
  inputs, targets = synthetic_batch(config, plan, seed=5)
  return trainer, state, {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def test_an_overflowing_step_is_not_taken_and_its_fallback_is_the_dropless_step():
  """Buffers of exactly the balanced rows (factor 1): the random router sends some device more, so the step
  keeps its state, step count and key; the fallback then takes the step a run with worst-case buffers
  takes, bit for bit."""
  trainer, state, batch = _first_step(_step_config(1.0))
  assert trainer.fallback_step is not None
  before = _host(state)
  kept, metrics = trainer.train_step(state, batch)
  assert bool(metrics["overflowed"]) and float(np.max(metrics["moe_buffer_use"])) > 1
  assert_bitwise(_host(kept), before)
  after, fallback_metrics = trainer.fallback_step(kept, batch)
  dropless, state, batch = _first_step(_step_config(0.0))
  assert dropless.fallback_step is None
  want, want_metrics = dropless.train_step(state, batch)
  assert_bitwise(_host(after), _host(want))
  assert float(fallback_metrics["loss"]) == float(want_metrics["loss"]) and int(after.step) == 1


def test_a_step_whose_routing_fits_is_the_dropless_step_within_rounding():
  trainer, state, batch = _first_step(_step_config(3.0))
  got, metrics = trainer.train_step(state, batch)
  assert not bool(metrics["overflowed"]) and 0 < float(np.max(metrics["moe_buffer_use"])) <= 1
  dropless, state, batch = _first_step(_step_config(0.0))
  want, want_metrics = dropless.train_step(state, batch)
  assert_close(metrics["loss"], want_metrics["loss"], FP32_MODEL_RTOL, "loss")
  for got_leaf, want_leaf in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
    assert_close(got_leaf, want_leaf, FP32_MODEL_RTOL, "parameters after the step")
  assert int(got.step) == 1


def assert_bitwise(got, want) -> None:
  for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(got_leaf, want_leaf)


@pytest.mark.slow
def test_a_run_redoes_every_overflowing_step_and_ends_as_the_dropless_run(tmp_path):
  """experiments.train with buffers of the balanced rows (every step of tiny_moe's routing overflows one):
  each step is logged as redone by the fallback, metrics.jsonl counts them, and the run's losses and final
  state are those of the run with worst-case buffers, bit for bit."""
  flags = [*runs.SMALL_FLAGS, "--config.train.steps=4", "--config.checkpoint.every_steps=4"]
  dropless, capped = tmp_path / "dropless", tmp_path / "capped"
  runs.run(runs.train_command(dropless, *flags))
  result = runs.run(runs.train_command(capped, *flags, "--config.parallel.moe_buffer_factor=1"))
  redone = re.findall(r"^warning: step (\d+): routing sent MoE layer \d+'s fullest receive buffer ([\d.]+)x the rows "
                      r"it holds \(parallel.moe_buffer_factor=1\): the step runs again with worst-case buffers",
                      result.stdout, re.MULTILINE)
  assert [int(step) for step, _ in redone] == [1, 2, 3, 4] and all(float(use) > 1 for _, use in redone), result.stdout
  records = [json.loads(line) for line in (capped / "metrics.jsonl").read_text().splitlines()]
  train = [r for r in records if r["kind"] == "train"]
  assert [r["moe_fallback_steps"] for r in train] == [1, 2, 3, 4]
  assert all(max(r["moe_buffer_use"]) > 1 for r in train)
  assert runs.records(capped) == runs.records(dropless)
  runs.assert_bitwise_equal(runs.checkpoint_arrays(capped, 4), runs.checkpoint_arrays(dropless, 4))
  assert "receive buffers for 1x balanced routing" in (capped / "plan.json").read_text()


def test_a_fallback_the_layout_cannot_split_is_one_config_error_before_anything_compiles():
  """4 fallback micro-batches of 4 sequences cannot split over ep's 8 devices: building the steps refuses
  it, naming the fallback's field (not the batch size it was checked through)."""
  config = _step_config(2.0)
  config.parallel.moe_fallback_grad_accum_steps = 4
  with pytest.raises(ConfigError, match=r"parallel.moe_fallback_grad_accum_steps=4 is invalid: micro-batches "
                                        r"this layout can split the batch into \(.*a multiple of 8"):
    train_step.create(config, plan_for(config))
