"""The training loop: data -> jitted step -> metrics, eval, checkpoints; at the end a plot and a sample.

`train(config, workdir)` is what `python -m experiments.train` and notebooks call. A workdir that holds
checkpoints is resumed from the newest one (state, optimizer, step, PRNG key and data position), so the
remaining steps are exactly those of an uninterrupted run.

Host-side work stays off the critical path: the loop only waits for the device when it logs (every
`train.log_every` steps), so data loading for the next step overlaps the current one.
"""

import dataclasses
import json
import pathlib
import time

import jax
import numpy as np

from meshmoe import cost_model, data as data_lib, metrics as metrics_lib, report, sampling, train_step
from meshmoe.checkpointing import Checkpointer
from meshmoe.config import Config, profile_range
from meshmoe.sharding.mesh import make_mesh


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


def train(config: Config, workdir: str | pathlib.Path) -> RunSummary:
  start_time = time.perf_counter()
  workdir = pathlib.Path(workdir)
  config.validate(jax.device_count())
  is_primary = jax.process_index() == 0
  if is_primary:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1) + "\n")
  mesh = make_mesh(config.mesh)
  data = data_lib.build_data(config, jax.process_index(), jax.process_count())
  trainer, state = train_step.create(config, mesh)
  checkpointer = Checkpointer(workdir, config.checkpoint)
  resumed_from = checkpointer.latest_step()
  if resumed_from is not None:
    state, data_state = checkpointer.restore(resumed_from, state)
    data.train.set_state(data_state)
    print(f"resuming from the checkpoint of step {resumed_from} in {checkpointer.directory}")
  first_step = int(state.step)
  eval_batches = [train_step.place_batch(b, config, mesh) for b in data.eval_batches]
  b, s = config.train.global_batch_size, config.train.seq_len
  flops_per_step = cost_model.train_step_flops(config.model, b, s)
  peak = config.train.peak_flops_per_device or metrics_lib.peak_flops_per_device(
      jax.devices()[0].device_kind, jax.default_backend())
  profile = profile_range(config.train)
  compile_start = time.perf_counter()
  step_fn = trainer.train_step.lower(state, train_step.abstract_batch(config, mesh)).compile()
  if is_primary:
    print(f"{config.train.steps - first_step} steps to go on mesh {dict(mesh.shape)} ({config.mesh.preset}); "
          f"train step compiled in {time.perf_counter() - compile_start:.1f}s; "
          f"{data.train_tokens:,} train / {data.eval_tokens:,} eval tokens")

  with metrics_lib.MetricsLogger(workdir, total_steps=config.train.steps, is_primary=is_primary,
                                 resume_step=first_step) as logger:
    last_log_time, last_log_step, metrics, eval_loss = time.perf_counter(), first_step, None, None
    tracing = False
    for step in range(first_step, config.train.steps):
      if step in profile and not tracing and is_primary:  # also when a resumed run starts inside the range
        jax.profiler.start_trace(str(workdir / "profile"))
        tracing = True
      batch = train_step.place_batch(next(data.train), config, mesh)
      state, metrics = step_fn(state, batch)
      done = step + 1
      if tracing and (done == profile.stop or done == config.train.steps):
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
        tracing = False
      if done % config.train.log_every == 0 or done == config.train.steps:
        step_time = (time.perf_counter() - last_log_time) / (done - last_log_step)
        logger.log_train(done, _train_record(metrics, step_time, b * s, flops_per_step, peak))
        last_log_time, last_log_step = time.perf_counter(), done
      if (config.train.eval_every and done % config.train.eval_every == 0) or done == config.train.steps:
        eval_loss = evaluate(trainer, state, eval_batches)
        logger.log_eval(done, {"loss": eval_loss})
        last_log_time = time.perf_counter()  # evaluation time is not step time
      if done == config.train.steps or (config.checkpoint.every_steps
                                        and done % config.checkpoint.every_steps == 0):
        checkpointer.save(done, state, data.train.get_state())
    final_loss = float(metrics["loss"]) if metrics is not None else float("nan")
    if eval_loss is None:  # resumed a run that had already finished
      eval_loss = evaluate(trainer, state, eval_batches)
  checkpointer.wait()
  checkpointer.close()

  samples, plot = {}, None
  if is_primary:
    samples = _samples(config, trainer, state, data.tokenizer)
    (workdir / "sample.txt").write_text("".join(f"--- {k} ---\n{v}\n\n" for k, v in samples.items()))
    plot = report.plot_training(workdir / "metrics.jsonl", workdir / "training.png",
                                reference_loss=data.unigram_entropy_nats, reference_label="unigram entropy")
  return RunSummary(config.train.steps, final_loss, eval_loss, data.unigram_entropy_nats,
                    time.perf_counter() - start_time, resumed_from, samples, plot)


def evaluate(trainer: train_step.Trainer, state: train_step.TrainState, batches) -> float:
  """Mean cross-entropy per unmasked token over the fixed eval batches."""
  ce_sum, tokens = 0.0, 0.0
  for batch in batches:
    out = trainer.eval_step(state.params, state.others, batch)
    ce_sum, tokens = ce_sum + float(out["ce_sum"]), tokens + float(out["tokens"])
  return ce_sum / max(tokens, 1.0)


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


def _samples(config: Config, trainer, state, tokenizer) -> dict[str, str]:
  """Greedy and temperature samples from `sample.prompt`."""
  temperatures = {"greedy": 0.0}
  if config.sample.temperature > 0:
    temperatures[f"temperature {config.sample.temperature:g}"] = config.sample.temperature
  params, others, rng = state.params, state.others, state.rng
  if sum(x.nbytes for x in jax.tree.leaves(params)) < _SAMPLE_ON_ONE_DEVICE_BYTES:
    # A small model samples faster on one device than spread over many (no per-token collectives).
    params, others, rng = jax.device_put((params, others, rng), jax.local_devices()[0])
  ids = sampling.generate(trainer.graphdef, params, others, tokenizer.encode(config.sample.prompt),
                          temperatures=list(temperatures.values()), max_new_tokens=config.sample.max_new_tokens,
                          max_len=config.model.max_seq_len, rng=rng)
  return {name: tokenizer.decode(row) for name, row in zip(temperatures, ids, strict=True)}
