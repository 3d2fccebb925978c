"""Device timelines (src/runtime/device_timeline.py): reading a trace into per-device segments, attributing a
slow device with the what-if estimate, confirming it over samples; and, in training runs, a device slowed
on purpose (src/runtime/slow_device.py) named with its kind and cost, and none named without one."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshmoe.config import ResilienceConfig
from meshmoe.runtime import device_timeline as dt
from tests import runs

# Reading


def _op(device, op, ts, dur, tid=1, module="jit_train_step.7", pid=1, ordinal=True):
  args = {"hlo_op": op, "hlo_module": module} | ({"device_ordinal": str(device)} if ordinal else {})
  return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": op, "args": args}


def test_a_trace_becomes_segments_between_collectives_with_their_waiting():
  events = [
      {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
      {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:1 (stream 7)"}},
      # device 0 (CPU: device_ordinal): fusion, a while loop holding a fusion and an all-reduce that waits
      # 10 us of its 15 at a rendezvous, then a fusion after the last collective
      _op(0, "fusion.1", 0, 10), _op(0, "while.3", 10, 30), _op(0, "fusion.2", 12, 5),
      _op(0, "all-reduce.4", 20, 15), {"ph": "X", "pid": 1, "tid": 1, "ts": 22, "dur": 10, "name": "Rendezvous"},
      _op(0, "fusion.5", 40, 4, tid=2),  # another thread of the same device
      _op(0, "fusion.9", 50, 100, module="jit_eval_step.2"),  # another program: not this step's
      {"ph": "X", "pid": 1, "tid": 1, "ts": 60, "dur": 5, "name": "ThreadpoolListener::Region", "args": {}},
      # device 1 (GPU: named by its process), an all-gather without a rendezvous: all transfer
      _op(1, "fusion.1", 0, 8, pid=2, ordinal=False), _op(1, "all-gather-start.2", 8, 6, pid=2, ordinal=False),
      _op(1, "fusion.3", 14, 2, pid=2, ordinal=False),
  ]
  ops = dt.ProgramOps(frozenset({"all-reduce.4", "all-gather-start.2"}), frozenset({"while.3"}))
  timelines = dt.device_timelines(events, "jit_train_step", ops)
  assert sorted(timelines) == [0, 1]
  zero, one = timelines[0], timelines[1]
  np.testing.assert_allclose(zero.compute_s, [20e-6, 9e-6])  # wall time: 0 to the all-reduce, its end to 44
  np.testing.assert_allclose(zero.transfer_s, [5e-6])
  np.testing.assert_allclose(zero.wait_s, [10e-6])
  np.testing.assert_allclose(one.compute_s, [8e-6, 2e-6])
  np.testing.assert_allclose(one.transfer_s, [6e-6])
  np.testing.assert_allclose(one.wait_s, [0.0])


def test_a_real_trace_is_read_for_every_device():
  """jax.profiler on 8 CPU devices, read from jax.profiler.ProfileData: each device's two all-reduces, its
  compute and its waiting, under the jitted function's module name."""
  mesh = Mesh(np.array(jax.devices()), ("d",))
  x = jax.device_put(jnp.ones((8 * 64, 64)), NamedSharding(mesh, P("d")))

  def body(x):  # two all-reduces, the second depending on the first
    y = jax.lax.psum(jnp.tanh(x @ x.T).sum(axis=0), "d")
    return jax.lax.psum(jnp.tanh(y).sum(), "d")

  @jax.jit
  def probe(x):  # the program's module: jit_probe
    return jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P())(x)

  jax.block_until_ready(probe(x))
  sampler = dt.Sampler(ResilienceConfig(timeline_every_steps=1), module_prefix="jit_probe")
  sampler.ops = dt.program_ops(probe.lower(x).compile().as_text())
  assert len(sampler.ops.collectives) == 2  # named after the psums, not "all-reduce"
  sampler.start()
  jax.block_until_ready(probe(x))
  sampler.stop(1, 0.0)
  _, _, timelines = sampler.take()
  assert sorted(t.device for t in timelines) == [d.id for d in jax.devices()]
  for t in timelines:
    assert len(t.transfer_s) == 2 and len(t.compute_s) == 3
    assert t.compute_s.sum() > 0 and np.all(t.wait_s >= 0) and np.all(t.transfer_s >= 0)


# Attribution and the what-if estimate


def _timelines(compute, transfer, wait=0.0):
  """Devices 0, 1, ... with these segments and transfers; `wait`: every collective's waiting on every device
  (0: a trace that shows none, whose waiting `attribute` infers)."""
  return [dt.DeviceTimeline(d, np.asarray(c, float), np.asarray(t, float), np.full(len(t), wait))
          for d, (c, t) in enumerate(zip(compute, transfer))]


def test_a_device_whose_compute_is_slow_is_flagged_with_its_cost():
  compute = [[1.0, 2.0, 1.0]] * 8
  compute[5] = [2.0, 4.0, 2.0]  # every segment twice as long
  transfer = [[0.5, 0.5]] * 8
  reading = dt.attribute(_timelines(compute, transfer), min_cost=0.1)
  assert (reading.flagged, reading.kind) == (5, "compute")
  assert reading.modelled_step_s == pytest.approx(2 + (0.5 + 4) + (0.5 + 2))  # the slowest device, per phase
  assert reading.modelled_without_s == pytest.approx(1 + 2 + 1 + 0.5 + 0.5)
  assert reading.cost_s == pytest.approx(4.0)


def test_a_device_whose_links_are_slow_is_flagged_as_communication():
  compute = [[1.0, 1.0, 1.0]] * 8
  transfer = [[0.5, 0.5]] * 8
  transfer[2] = [1.5, 1.5]
  reading = dt.attribute(_timelines(compute, transfer, wait=0.01), min_cost=0.1)  # waiting seen (a CPU trace)
  assert (reading.flagged, reading.kind) == (2, "communication")
  assert reading.cost_s == pytest.approx(2.0)


def test_a_phase_lasts_as_long_as_its_slowest_device_transfer_and_segment_together():
  """One device slow in a collective's transfer and another in the segment after it: each phase waits for
  one of them at a time, so their delays do not add up (the slowest per phase, not per part)."""
  compute, transfer = [[1.0, 1.0]] * 8, [[0.5]] * 8
  transfer = [t if d != 1 else [1.5] for d, t in enumerate(transfer)]
  compute = [c if d != 2 else [1.0, 2.0] for d, c in enumerate(compute)]
  assert dt.modelled_step_s(np.array(compute), np.array(transfer)) == pytest.approx(1.0 + 2.5)
  reading = dt.attribute(_timelines(compute, transfer, wait=0.01), min_cost=0.0)
  assert reading.cost_s == pytest.approx(0.0)  # either device alone at the median's speed: the other still holds the phase


def test_waiting_a_trace_does_not_show_is_inferred_from_the_collectives_ends():
  """gloo and NCCL: a collective's whole time reads as transfer. Device 3 computes 1 s longer before the
  first collective, which the others spend inside it. Ends aligned, their excess over device 3's 0.2 s is
  waiting, and device 3 is the slow one, as slow compute, costing that second."""
  compute = [[1.0, 1.0]] * 4
  compute[3] = [2.0, 1.0]
  transfer = [[1.2]] * 3 + [[0.2]]
  reading = dt.attribute(_timelines(compute, transfer), min_cost=0.1)
  assert (reading.flagged, reading.kind) == (3, "compute") and reading.cost_s == pytest.approx(1.0)
  np.testing.assert_allclose(reading.transfer_s, [0.2] * 4)
  np.testing.assert_allclose(reading.wait_s, [1.0, 1.0, 1.0, 0.0])
  assert reading.modelled_step_s == pytest.approx(2.0 + (0.2 + 1.0))


def test_waiting_a_trace_shows_is_read_as_it_is():
  transfer_DK, wait_DK = np.array([[0.5], [0.7]]), np.array([[0.3], [0.0]])  # a CPU rendezvous: waiting seen
  transfer, wait = dt.end_aligned(transfer_DK, wait_DK)
  np.testing.assert_array_equal(transfer, transfer_DK)
  np.testing.assert_array_equal(wait, wait_DK)


def test_a_device_held_up_in_one_segment_is_flagged_though_its_total_is_the_median():
  """An oversubscribed CPU: the held-up device runs its other segments faster while the others wait."""
  compute = [[1.0, 1.0, 1.0]] * 8
  compute[6] = [1.6, 0.7, 0.7]  # total 3.0, as every other device's
  reading = dt.attribute(_timelines(compute, [[0.1, 0.1]] * 8), min_cost=0.1)
  assert (reading.flagged, reading.kind) == (6, "compute") and reading.cost_s == pytest.approx(0.6)
  assert (reading.worst_s, reading.worst_median_s) == (1.6, 1.0)


@pytest.mark.parametrize("slow,flagged", [(1.4, None), (1.6, 3)])
def test_a_device_is_flagged_only_when_it_costs_the_least_share_of_the_step(slow, flagged):
  compute = [[1.0, 1.0]] * 8
  compute[3] = [slow, 1.0]  # saves slow - 1 of a modelled step of slow + 1 + 0.1: 0.4 / 2.5 = 16%, 0.6 / 2.7 = 22%
  reading = dt.attribute(_timelines(compute, [[0.1]] * 8), min_cost=0.2)
  assert reading.flagged == flagged and (reading.cost_s > 0) == (flagged is not None)


def test_timelines_of_different_lengths_are_an_incomplete_trace():
  with pytest.raises(ValueError, match="incomplete trace"):
    dt.attribute(_timelines([[1.0, 1.0], [1.0]], [[0.1], []]), min_cost=0.1)


def test_pack_and_unpack_round_trip():
  timelines = _timelines([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [[0.1, 0.2], [0.3, 0.4]])
  back = dt.unpack(dt.pack(timelines))
  for a, b in zip(timelines, back):
    assert a.device == b.device
    for field in ("compute_s", "transfer_s", "wait_s"):
      np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def test_a_device_is_named_once_flagged_in_two_of_three_samples():
  sampler = dt.Sampler(ResilienceConfig(timeline_every_steps=1))
  even = [[1.0, 1.0]] * 8

  def slow(device):
    return [c if d != device else [3.0, 3.0] for d, c in enumerate(even)]

  named = [sampler.judge(_timelines(c, [[0.1]] * 8))[1]
           for c in (slow(3), even, slow(4), slow(3), slow(3), even, even, slow(3))]
  # 3, nobody, 4, 3 (once in the last 3), 3 again (twice: named), then nobody flagged twice (nobody
  # named), and 3 once in its last 3 samples (not named)
  assert named == [None, None, None, None, (3, "compute"), None, None, None]


def test_a_sample_is_read_in_a_thread_and_judged_lag_steps_later():
  """start/stop around a traced step, then `ready` only `lag` steps after it (or at the run's last step),
  and no new sample while one is pending."""
  mesh = Mesh(np.array(jax.devices()), ("d",))
  x = jax.device_put(jnp.ones((8 * 16, 16)), NamedSharding(mesh, P("d")))
  probe = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x.sum(), "d"), mesh=mesh, in_specs=P("d"), out_specs=P()))
  jax.block_until_ready(probe(x))
  sampler = dt.Sampler(ResilienceConfig(timeline_every_steps=10), module_prefix="jit_")
  sampler.ops = dt.program_ops(probe.lower(x).compile().as_text())
  assert sampler.lag == 5 and sampler.due(10) and not sampler.due(11) and not sampler.ready(10, last=False)
  sampler.start()
  jax.block_until_ready(probe(x))
  sampler.stop(10, 0.25)
  assert not sampler.due(20)  # judged first
  assert [sampler.ready(s, last=False) for s in (11, 14, 15)] == [False, False, True]
  assert sampler.ready(12, last=True)
  step, traced_s, timelines = sampler.take()
  assert (step, traced_s) == (10, 0.25) and sorted(t.device for t in timelines) == [d.id for d in jax.devices()]
  assert all(len(t.transfer_s) == 1 for t in timelines)
  assert not sampler.ready(15, last=True) and sampler.due(20)


# A training run with a device slowed on purpose (resilience.debug_slow_device). How reliably smaller
# slowdowns are found, against how often noise names a device, is a benchmark, not a test (timing on 2
# shared cores): experiments/benchmarks/device_timeline.py and RESULTS.md.

SLOW_DEVICE, SLEEP_S = 5, 0.5


@pytest.mark.slow
def test_a_much_slower_device_is_named_as_slow_compute_with_its_cost(tmp_path):
  """Device 5 sleeps 0.5 s in every step (the small model's steps compute about 10 ms per device): named as
  slow compute by the second sample (flagged twice in a row), in the log and in metrics.jsonl, its modelled cost close to
  the sleep; every sample holds every device's figures."""
  result = runs.run(runs.train_command(
      tmp_path, *runs.SMALL_FLAGS, "--config.train.steps=7", "--config.checkpoint.every_steps=-1",
      "--config.sample.max_new_tokens=0", "--config.resilience.timeline_every_steps=2",
      f"--config.resilience.debug_slow_device={SLOW_DEVICE}", f"--config.resilience.debug_slow_device_s={SLEEP_S}"))
  samples = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "devices"]
  assert [r["step"] for r in samples] == [2, 4, 6]
  for r in samples:
    assert r["device"] == list(range(8)) and r["process"] == [0] * 8
    assert len(r["compute_s"]) == len(r["transfer_s"]) == len(r["wait_s"]) == 8
    assert (r["flagged"], r["flagged_kind"]) == (SLOW_DEVICE, "compute")
    assert 0.7 * SLEEP_S <= r["cost_s_modelled"] <= 1.3 * SLEEP_S, r["cost_s_modelled"]
    assert r["step_without_s_modelled"] == pytest.approx(r["step_s_modelled"] - r["cost_s_modelled"])
    assert r["traced_step_s_measured"] >= SLEEP_S  # the sampled step's own measured time, the sleep in it
  assert [r["named"] for r in samples] == [-1, SLOW_DEVICE, SLOW_DEVICE]
  assert f"warning: step 4: device {SLOW_DEVICE} (process 0, " in result.stdout
  assert "computes slowly" in result.stdout


@pytest.mark.slow
def test_two_processes_exchange_their_devices_timelines(tmp_path):
  """2 processes x 4 devices (gloo): the processes exchange their devices' figures, and process 1's device
  slowed on purpose is named with its process."""
  slow = 2049  # process 1's second device (JAX numbers a CPU process's devices from 2048 x its index)
  result = runs.run(runs.launch_command(
      tmp_path, *runs.SMALL_FLAGS, "--config.train.steps=5", "--config.checkpoint.every_steps=-1",
      "--config.sample.max_new_tokens=0", "--config.resilience.timeline_every_steps=2",
      f"--config.resilience.debug_slow_device={slow}", f"--config.resilience.debug_slow_device_s={SLEEP_S}",
      processes=2, devices=4))
  samples = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "devices"]
  assert [r["step"] for r in samples] == [2, 4]
  assert samples[0]["device"] == [0, 1, 2, 3, 2048, 2049, 2050, 2051]
  assert samples[0]["process"] == [0] * 4 + [1] * 4
  assert [r["named"] for r in samples] == [-1, slow]
  assert f"warning: step 4: device {slow} (process 1, " in result.stdout
