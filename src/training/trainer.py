"""The training loop: data -> jitted step -> metrics, eval, checkpoints; at the end a plot and a sample.

`train(config, workdir)` is what `python -m experiments.train` and notebooks call. A workdir that holds
checkpoints is resumed from the newest usable one (state, optimizer, step, PRNG key and data position), so
the remaining steps are exactly those of an uninterrupted run.

Host-side work stays off the critical path: the loop reads each step's small health flag one step late,
while the next step runs, and otherwise waits for the device only when it logs, evaluates or saves, so
data loading for the next step overlaps the current one.

Between steps the loop applies the resilience policies (config.resilience; README.md, "Multi-host runs and faults"): a
SIGTERM stops every process at the same step with a checkpoint (meshmoe.runtime.resilience.Preemption); a
non-finite step is skipped or halts the run (meshmoe.runtime.nonfinite); a watchdog ends the process when a
step, evaluation or checkpoint wait hangs (meshmoe.runtime.resilience.Watchdog); processes compare their step
times to name stragglers (meshmoe.runtime.stragglers).
"""

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshmoe.analysis import cost_model
from meshmoe.config import Config, ConfigError, profile_range
from meshmoe.data import pipeline as data_lib
from meshmoe.models import hf_checkpoint, hf_export
from meshmoe.runtime import device_timeline, distributed, gpu_memory, nonfinite, resilience, slow_device, stragglers
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.training import hf_convert, metrics as metrics_lib, model_state, report, sampling, train_step
from meshmoe.training.checkpointing import Checkpointer


_SAMPLE_ON_ONE_DEVICE_BYTES = 1 << 30


@dataclasses.dataclass
class RunSummary:
  steps: int
  final_loss: float
  eval_loss: float
  unigram_entropy: float
  wall_time_s: float
  resumed_from: int | None
  samples: dict[str, str]
  plot: pathlib.Path | None
  preempted_at: int | None = None  # the step a SIGTERM stopped the run at (its checkpoint is saved)
  skipped_steps: int = 0  # non-finite steps skipped (resilience.nan_policy="skip"), over the whole run


def train(config: Config, workdir: str | pathlib.Path, *, step_delay_s: float = 0.0) -> RunSummary:
  """Trains `config` in `workdir`, resuming from its newest usable checkpoint.

  `step_delay_s` makes this process sleep that long in every step: a debugging aid to watch the straggler
  detector at work (experiments.train --debug_straggler), never set in a real run."""
  start_time = time.perf_counter()
  workdir = pathlib.Path(workdir)
  config = hf_checkpoint.with_checkpoint_model(config)
  config.validate(jax.device_count())
  mesh = make_mesh(config.mesh)
  plan = ParallelPlan.build(config, mesh)  # checks the sharding divisibility; decides every parallel op
  if config.train.export_hf:  # before hours of training, not after them
    _check_export(config)
  is_primary = jax.process_index() == 0
  if is_primary:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1) + "\n")
    plan.write_json(workdir / "plan.json")
    print(plan.table(), flush=True)
    if (memory := gpu_memory.describe(config.train.gpu_memory_fraction)) is not None:
      print(memory, flush=True)
  data = data_lib.build_data(config, train_step.process_rows(config, plan), log=print if is_primary else _quiet)
  checkpointer = Checkpointer(workdir, config.checkpoint, config.optimizer.name, config.optimizer.moments_dtype)
  variables = None
  if config.train.init_from and checkpointer.latest_step() is None:
    load_start, loaded = time.perf_counter(), {}
    variables = model_state.checkpoint_variables(config, plan, loaded)
    print(f"parameters from {config.train.init_from[3:]} in {time.perf_counter() - load_start:.1f}s "
          f"({loaded['bytes_read'] / 1e6:,.3f} MB read by process {jax.process_index()})", flush=True)
  trainer, state = train_step.create(config, plan, variables)
  if config.resilience.debug_slow_device >= 0:  # tests and demonstrations only (slow_device.py)
    trainer = dataclasses.replace(trainer, train_step=slow_device.slowed(
        trainer.train_step, plan, config.resilience.debug_slow_device, config.resilience.debug_slow_device_s,
        trainer.state_shardings))
  restored = checkpointer.restore_latest(state)
  skipped_steps = 0
  if restored is not None:
    state, skipped_steps = restored.state, restored.skipped_steps
    data.train.set_state(restored.data_state)
    print(f"resuming from the checkpoint of step {restored.step} in {checkpointer.directory}", flush=True)
  first_step = int(state.step)
  eval_batches = {name: [train_step.place_batch(b, config, plan) for b in batches]
                  for name, batches in data.eval_batches.items()}
  step_fn = None  # a run resumed after its last step trains nothing: no train step to compile
  if first_step < config.train.steps:
    compile_start = time.perf_counter()
    step_fn = trainer.train_step.lower(state, train_step.abstract_batch(config, plan)).compile()
    if is_primary:
      o, d = config.optimizer, config.data
      documents = ("; documents masked apart" + (", positions restarting" if d.restart_positions else "")
                   if d.document_mask else "")
      print(f"{config.train.steps - first_step} steps to go ({o.name}, peak learning rate {o.learning_rate:g}, "
            f"{o.schedule} schedule{documents}); train step compiled in {time.perf_counter() - compile_start:.1f}s; "
            f"{data.train_tokens:,} train / {data.eval_tokens:,} eval tokens", flush=True)
  elif is_primary:
    print(f"the run has already trained its {config.train.steps} steps (train.steps): evaluating and sampling "
          "only; raise --config.train.steps to train on", flush=True)

  # The eval step is compiled here too, not at the first evaluation: the watchdog does not watch compiling
  # (a large model's takes minutes), and the processes meet below once all of it is done.
  first_eval = next(iter(eval_batches.values()))[0]
  eval_fn = trainer.eval_step.lower(state.params, state.others, first_eval).compile()

  if jax.process_count() > 1:
    # Processes finish compiling at different times (or load the step from the compilation cache); without
    # meeting here, the first step's collectives would wait for the slowest inside the watchdog's watch.
    distributed.barrier("meshmoe: steps compiled")

  loop = _Loop(config, workdir, step_fn, eval_fn, data, eval_batches, checkpointer, plan, step_delay_s,
               nonfinite.Monitor(config.resilience, config.model, state.params, skipped_steps),
               trainer.fallback_step)
  with resilience.Watchdog(config.resilience.watchdog_timeout_s, jax.process_index()) as watchdog:
    try:
      state, preempted_at = loop.run(state, first_step, watchdog)
    except jax.errors.JaxRuntimeError as e:
      if jax.process_count() > 1:  # no waiting for the checkpoint: its writers may be gone
        raise resilience.ProcessLostError(watchdog.what, e) from None
      raise
    except BaseException:  # a halt (NaN) or Ctrl-C: a checkpoint being written is a good one
      _finish_checkpoints(checkpointer, watchdog)
      raise
    _finish_checkpoints(checkpointer, watchdog)
    if config.train.export_hf and preempted_at is None:
      watchdog.beat("exporting the parameters to train.export_hf")
      _export(config, state)
    watchdog.beat("sampling")
    samples = {} if preempted_at is not None else _samples(config, trainer, state, data.tokenizer, is_primary)
    watchdog.beat(None)

  plot = None
  if is_primary:
    if samples:
      (workdir / "sample.txt").write_text("".join(f"--- {k} ---\n{v}\n\n" for k, v in samples.items()))
    plot = report.plot_training(workdir / "metrics.jsonl", workdir / "training.png",
                                reference_loss=data.unigram_entropy_nats, reference_label="unigram entropy")
  return RunSummary(config.train.steps, loop.final_loss, loop.eval_loss, data.unigram_entropy_nats,
                    time.perf_counter() - start_time, None if restored is None else restored.step, samples, plot,
                    preempted_at, loop.nonfinite.skipped_steps)


class _Loop:
  """The steps of one run, with metrics, eval and checkpoints, and the resilience checks between steps."""

  def __init__(self, config: Config, workdir: pathlib.Path, step_fn, eval_fn, data, eval_batches,
               checkpointer: Checkpointer, plan: ParallelPlan, step_delay_s: float,
               nonfinite_monitor: nonfinite.Monitor, fallback_step=None):
    self.config, self.workdir, self.step_fn, self.eval_fn = config, workdir, step_fn, eval_fn
    self.data, self.eval_batches, self.checkpointer, self.plan = data, eval_batches, checkpointer, plan
    self.step_delay_s, self.nonfinite = step_delay_s, nonfinite_monitor
    # The dropless fallback (train_step.dropless_fallback), compiled when a step first needs it.
    self._fallback_step, self._fallback_fn, self.fallback_steps = fallback_step, None, 0
    self.stragglers = stragglers.Monitor(config.resilience, jax.process_count(), jax.process_index())
    self.timelines = device_timeline.Sampler(config.resilience)
    if self.timelines.every and step_fn is not None:  # which of the step's instructions are collectives
      self.timelines.ops = device_timeline.program_ops(step_fn.as_text())
    self._step_s = None  # the newest logged step time (measured, untraced steps)
    self.final_loss, self.eval_loss = float("nan"), None
    self._checked = self._saved = -1  # the newest step whose health was read, and the newest saved

  def run(self, state, first_step: int, watchdog: resilience.Watchdog):
    """Runs the remaining steps; returns (state, the step a SIGTERM stopped it at, or None)."""
    c, is_primary = self.config, jax.process_index() == 0
    tokens_per_step = c.train.global_batch_size * c.train.seq_len
    flops_per_step = cost_model.train_step_flops(c.model, c.train.global_batch_size, c.train.seq_len)
    peak = c.train.peak_flops_per_device or metrics_lib.peak_flops_per_device(
        jax.devices()[0].device_kind, jax.default_backend())
    profile, tracing, pending = profile_range(c.train), False, None
    if self.checkpointer.latest_step() == first_step:
      self._saved = first_step  # resumed from it: a stop before the first step has nothing new to save
    preemption = resilience.Preemption()
    with preemption, metrics_lib.MetricsLogger(self.workdir, total_steps=c.train.steps, is_primary=is_primary,
                                               resume_step=first_step) as logger:
      last_log_time, last_log_step = time.perf_counter(), first_step
      for step in range(first_step, c.train.steps):
        if preemption.reached(step):
          self._check(pending, state, watchdog)
          if c.checkpoint.every_steps >= 0:
            self._save(step, state, watchdog)
          return state, step
        done = step + 1
        watchdog.beat(f"train step {done}")
        self.stragglers.step_started()
        if self.step_delay_s:
          time.sleep(self.step_delay_s)
        if step in profile and not tracing and is_primary:  # also when a resumed run starts inside the range
          jax.profiler.start_trace(str(self.workdir / "profile"))
          tracing = True
        batch = train_step.place_batch(next(self.data.train), c, self.plan)
        # The same decision on every process (the sample ends in collectives): never inside the profiled
        # steps (one trace at a time), nor at a start or before a step time is known.
        sampled = self.timelines.due(done) and step not in profile and step > first_step and self._step_s is not None
        if sampled:  # this step alone in the trace: the steps before it finish first
          jax.block_until_ready(state)
          self.timelines.start()
          traced_from = time.perf_counter()
        state, metrics = self.step_fn(state, batch)
        if self._fallback_step is not None and bool(metrics["overflowed"]):  # waits for the step
          state, metrics = self._run_fallback(done, state, batch, metrics, watchdog)
        if sampled:
          watchdog.beat(f"device timeline of step {done}")
          jax.block_until_ready(state)
          self.timelines.stop(done, time.perf_counter() - traced_from)
        if self.timelines.ready(done, last=done == c.train.steps):
          watchdog.beat(f"device timeline of step {done}, judged")
          self._judge_timelines(*self.timelines.take(), logger)
        self._check(pending, state, watchdog)  # the previous step, while this one runs
        pending = (done, metrics)
        if tracing and (done == profile.stop or done == c.train.steps):
          jax.block_until_ready(state)
          jax.profiler.stop_trace()
          tracing = False
        if done % c.train.log_every == 0 or done == c.train.steps:
          self._check(pending, state, watchdog)
          step_time = (time.perf_counter() - last_log_time) / (done - last_log_step)
          logger.log_train(done, _train_record(metrics, step_time, tokens_per_step, flops_per_step, peak)
                           | {"skipped_steps": self.nonfinite.skipped_steps}
                           | self._buffer_record(metrics)
                           | {f"tokens/{name}": n for name, n in self.data.train.source_token_counts().items()})
          if not sampled:
            self._step_s = step_time
          last_log_time, last_log_step = time.perf_counter(), done
        self.stragglers.step_finished()
        if (c.train.eval_every and done % c.train.eval_every == 0) or done == c.train.steps:
          self._check(pending, state, watchdog)
          watchdog.beat(f"evaluation at step {done}")
          losses = evaluate_sources(self.eval_fn, state, self.eval_batches, self.data.weights)
          self.eval_loss = losses["loss"]
          logger.log_eval(done, losses)
          last_log_time = time.perf_counter()  # evaluation time is not step time
        every = c.checkpoint.every_steps
        if every >= 0 and (done == c.train.steps or (every and done % every == 0)):
          self._check(pending, state, watchdog)
          self._save(done, state, watchdog)
        watchdog.beat(f"straggler comparison at step {done}")
        comparison = self.stragglers.compare(done)
        if comparison is not None:
          logger.log_processes(done, comparison.record())
          if comparison.stragglers:
            print(self.stragglers.describe(done, comparison), flush=True)
      self._check(pending, state, watchdog)
      if pending is not None:
        self.final_loss = float(pending[1]["loss"])
      elif is_primary:  # no step left to train: the newest logged one's
        self.final_loss = metrics_lib.last_train_loss(self.workdir / "metrics.jsonl")
      if self.eval_loss is None:  # resumed a run that had already finished
        watchdog.beat("evaluation")
        self.eval_loss = evaluate_sources(self.eval_fn, state, self.eval_batches, self.data.weights)["loss"]
    return state, None

  def _run_fallback(self, step: int, state, batch, capped_metrics: dict, watchdog: resilience.Watchdog):
    """Step `step` again (`state` is as it started: the capped step was not taken) with worst-case MoE
    receive buffers; its metrics keep the capped attempt's buffer use."""
    use = np.asarray(capped_metrics["moe_buffer_use"])
    if self._fallback_fn is None:
      watchdog.beat(None)  # compiling: not watched
      started = time.perf_counter()
      self._fallback_fn = self._fallback_step.lower(state, train_step.abstract_batch(self.config, self.plan)).compile()
      if jax.process_count() > 1:
        distributed.barrier("meshmoe: dropless fallback compiled")
      compiled = f"; its step compiled in {time.perf_counter() - started:.1f}s"
    else:
      compiled = ""
    self.fallback_steps += 1
    if jax.process_index() == 0:
      p = self.config.parallel
      print(f"warning: step {step}: routing sent MoE layer {int(np.argmax(use))}'s fullest receive buffer "
            f"{float(use.max()):.2f}x the rows it holds (parallel.moe_buffer_factor={p.moe_buffer_factor:g}): "
            f"the step runs again with worst-case buffers (the dropless fallback, "
            f"{self.fallback_steps} so far){compiled}", flush=True)
    watchdog.beat(f"train step {step}, the dropless fallback")
    state, metrics = self._fallback_fn(state, batch)
    return state, {**metrics, "moe_buffer_use": capped_metrics["moe_buffer_use"]}

  def _buffer_record(self, metrics: dict) -> dict:
    """The capped MoE receive buffers' fullest use per layer and the fallback steps (with capped buffers)."""
    if self._fallback_step is None:
      return {}
    return {"moe_buffer_use": np.asarray(metrics["moe_buffer_use"]).tolist(), "moe_fallback_steps": self.fallback_steps}

  def _judge_timelines(self, step: int, traced_s: float, local: list[device_timeline.DeviceTimeline],
                       logger) -> None:
    """Gathers every process's device timelines of sampled step `step` (traced in `traced_s` measured
    seconds), attributes, logs and records it."""
    # Every process must hold timelines of one length (the same collectives) before they are gathered.
    lengths = {len(t.compute_s) for t in local}
    length = np.array([lengths.pop() if len(lengths) == 1 else -1])
    if jax.process_count() > 1:
      length = np.asarray(multihost_utils.process_allgather(length)).ravel()
    if length.min() < 0 or len(set(length.tolist())) > 1:
      if jax.process_index() == 0:
        print(f"warning: step {step}: device timelines skipped: the trace holds different numbers of "
              f"collectives per device ({sorted(set(length.tolist()))}; an incomplete trace)", flush=True)
      return
    rows = device_timeline.pack(local)
    if jax.process_count() > 1:
      rows = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, rows.shape[-1])
    timelines = sorted(device_timeline.unpack(rows), key=lambda t: t.device)
    reading, named = self.timelines.judge(timelines)
    owner = {d.id: d.process_index for d in jax.devices()}
    hosts = self.stragglers.hosts()  # every process calls it: a collective the first time
    record = {"device": reading.devices, "process": [owner[d] for d in reading.devices],
              "compute_s": reading.compute_s, "transfer_s": reading.transfer_s, "wait_s": reading.wait_s,
              "flagged": -1 if reading.flagged is None else reading.flagged, "flagged_kind": reading.kind or "",
              "named": -1 if named is None else named[0], "named_kind": "" if named is None else named[1],
              "step_s_measured": self._step_s, "traced_step_s_measured": traced_s,
              "step_s_modelled": reading.modelled_step_s,
              "cost_s_modelled": reading.cost_s, "worst_s": reading.worst_s, "worst_median_s": reading.worst_median_s,
              "step_without_s_modelled": reading.modelled_without_s}
    logger.log_devices(step, record)
    if named is not None and jax.process_index() == 0:
      device, kind = named
      what = "computes slowly" if kind == "compute" else "transfers slowly in its collectives"
      print(f"warning: step {step}: device {device} (process {owner[device]}, "
            f"{hosts[owner[device]]}) {what}: {device_timeline.describe(reading, self._step_s, traced_s)}", flush=True)

  def _check(self, pending, state, watchdog: resilience.Watchdog) -> None:
    """Reads the health of step `pending[0]` once (blocking until it has run) and applies the NaN policy."""
    if pending is None or pending[0] <= self._checked:
      return
    watchdog.beat(f"train step {pending[0]}, waiting for its result")
    self.stragglers.waiting()
    self.nonfinite.check(pending[0], pending[1], state.params)
    self.stragglers.done_waiting()
    self._checked = pending[0]

  def _save(self, step: int, state, watchdog: resilience.Watchdog) -> None:
    if step == self._saved:
      return
    watchdog.beat(f"checkpoint save of step {step}")
    self.checkpointer.save(step, state, self.data.train.get_state(), self.nonfinite.skipped_steps)
    self._saved = step


def _finish_checkpoints(checkpointer: Checkpointer, watchdog: resilience.Watchdog) -> None:
  watchdog.beat("waiting for the last checkpoint to be written")
  checkpointer.wait()
  checkpointer.close()


def evaluate(eval_fn, state: train_step.TrainState, batches) -> float:
  """Mean cross-entropy per unmasked token over the fixed eval batches; eval_fn: the compiled eval step."""
  ce_sum, tokens = 0.0, 0.0
  for batch in batches:
    out = eval_fn(state.params, state.others, batch)
    ce_sum, tokens = ce_sum + float(out["ce_sum"]), tokens + float(out["tokens"])
  return ce_sum / max(tokens, 1.0)


def evaluate_sources(eval_fn, state: train_step.TrainState, batches: dict[str, list], weights: list[float]) -> dict:
  """{"loss": the mixture's eval loss (the datasets' losses weighted like their rows), "loss/<dataset>": each
  dataset's} for a mixture; {"loss": ...} for one dataset."""
  losses = {name: evaluate(eval_fn, state, dataset_batches) for name, dataset_batches in batches.items()}
  record = {"loss": float(sum(w * loss for w, loss in zip(weights, losses.values())))}
  return record | ({f"loss/{name}": loss for name, loss in losses.items()} if len(losses) > 1 else {})


def _quiet(_: str) -> None:
  pass


def _train_record(metrics: dict, step_time: float, tokens_per_step: int, flops_per_step: float,
                  peak: float | None) -> dict:
  load = np.asarray(metrics["expert_load"])
  return {
      "loss": float(metrics["loss"]), "cross_entropy": float(metrics["cross_entropy"]),
      "aux_loss": float(metrics["aux_loss"]), "z_loss": float(metrics["z_loss"]),
      "grad_norm": float(metrics["grad_norm"]), "learning_rate": float(metrics["learning_rate"]),
      "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
      "mfu": metrics_lib.mfu(flops_per_step, step_time, jax.device_count(), peak),
      "expert_load_imbalance": metrics_lib.expert_load_imbalance(load),
      "dropped_fraction": np.asarray(metrics["dropped_fraction"]).tolist(),
  }


def _check_export(config: Config) -> None:
  folder = pathlib.Path(config.train.export_hf)
  if folder.exists():
    raise ConfigError("train.export_hf", config.train.export_hf, "a folder that does not exist yet (export "
                      "never overwrites one)")
  hf_export.hf_config(config.model, "bfloat16")  # a model its family does not compute fails here, not at the end


def _export(config: Config, state) -> None:
  hf_export.save(state.params, config.model, config.train.export_hf, others=state.others,
                 **hf_convert.export_options(config))
  if jax.process_index() == 0:
    print(f"exported the final parameters to {config.train.export_hf}", flush=True)


def _samples(config: Config, trainer, state, tokenizer, is_primary: bool) -> dict[str, str]:
  """Greedy and temperature samples from `sample.prompt` (the primary process's; {} on the others)."""
  temperatures = {"greedy": 0.0}
  if config.sample.temperature > 0:
    temperatures[f"temperature {config.sample.temperature:g}"] = config.sample.temperature
  params, others, rng = state.params, state.others, state.rng
  if sum(x.nbytes for x in jax.tree.leaves(params)) < _SAMPLE_ON_ONE_DEVICE_BYTES:
    # A small model samples faster on one device than spread over many (no per-token collectives). With
    # several processes every one takes part in gathering it; then only the primary samples.
    if jax.process_count() > 1:
      params, others, rng = multihost_utils.process_allgather((params, others, rng), tiled=True)
    if not is_primary:
      return {}
    params, others, rng = jax.device_put((params, others, rng), jax.local_devices()[0])
  ids = sampling.generate(trainer.graphdef, params, others, tokenizer.encode(config.sample.prompt),
                          temperatures=list(temperatures.values()), max_new_tokens=config.sample.max_new_tokens,
                          max_len=config.model.max_seq_len, rng=rng)
  if not is_primary:
    return {}
  return {name: tokenizer.decode(row) for name, row in zip(temperatures, ids, strict=True)}
