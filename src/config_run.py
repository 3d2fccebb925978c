"""The run sections of meshmoe.config: optimizer, train, data, checkpoint, sample and resilience.

Plain data, like the rest of meshmoe.config: it imports nothing of meshmoe but the config's own modules.
Import these names from meshmoe.config.
"""

import dataclasses
import math

from meshmoe.config_checks import (ConfigError, check_bool, check_choice, check_fraction, check_int,
                                   check_non_negative, check_positive_float, check_positive_int, is_number)
from meshmoe.config_model import ModelConfig

# Raw sources are tokenized into a cache on first use; "tokenized" reads experiments.tokenize's folders.
DATA_SOURCES = ("stdlib", "text", "jsonl", "parquet", "arrayrecord", "tokenized")
NAN_POLICIES = ("halt", "skip")
LR_SCHEDULES = ("cosine", "wsd", "constant")  # optimizer.schedule (training/optimizer.py)
LR_DECAY_SHAPES = ("linear", "cosine", "1-sqrt")  # optimizer.decay_shape
OPTIMIZERS = ("adamw", "muon", "adafactor", "lion")  # optimizer.name (training/optimizer.py)
MOMENTS_DTYPES = ("float32", "bfloat16")  # optimizer.moments_dtype
BFLOAT16_MOMENTS_MAX_BETA = 0.99  # the largest average decay bfloat16 statistics take (OptimizerConfig)


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
  """`name`'s update rule (optax's); the learning rate rises linearly over `warmup_steps` to `learning_rate`,
  then follows `schedule`."""

  # "adamw"; "muon" (Muon for the weight matrices, each layer's and each expert's orthogonalised on its own;
  # AdamW for the embedding and output tables, norms, the router and biases); "adafactor" (optax's defaults:
  # factored second moments, learning_rate a step size relative to each weight's RMS); "lion" (b1, b2 are
  # Lion's; it wants a rate 3-10x below AdamW's). Checkpoints record the name: a run resumes with the same.
  # Muon's cost across many devices (its matrices orthogonalised where the layout splits them): README.md.
  name: str = "adamw"
  learning_rate: float = 3e-3  # the peak
  # Update n (1, 2, ...) of the warmup runs at learning_rate * n / warmup_steps: the first is not 0.
  warmup_steps: int = 20
  # After the warmup (training/optimizer.py): "cosine" decays to learning_rate * min_learning_rate_ratio at
  # the last step (train.steps); "wsd" (warmup-stable-decay) holds the peak, then decays to the same end
  # over the last `decay_fraction` of the steps, shaped by `decay_shape`; "constant" holds the peak.
  schedule: str = "cosine"
  min_learning_rate_ratio: float = 0.1  # "cosine" and "wsd": the last step's rate over the peak
  decay_fraction: float = 0.2  # "wsd": the share of train.steps that decays (MiniCPM, DeepSeek-V3: 10-30%)
  # "wsd": "linear", "cosine" (half a cosine) or "1-sqrt" (1 - sqrt(progress), the shape Hägele et al.
  # 2024 found to match a cosine run's loss at the end).
  decay_shape: str = "1-sqrt"
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  # "muon": the momentum of its matrices, and the RMS its orthogonalised updates are scaled to (Moonlight's
  # 0.2: AdamW's typical update RMS, so AdamW's learning_rate and weight_decay carry over).
  muon_beta: float = 0.95
  muon_update_rms: float = 0.2
  weight_decay: float = 0.1  # multiplied by the learning rate, for every optimizer
  # Which parameters weight decay applies to besides matrices.
  decay_norms: bool = False
  decay_biases: bool = False
  decay_embeddings: bool = False
  grad_clip_norm: float = 1.0  # global-norm clipping; 0 disables it
  # The dtype the optimizer's statistics (Adam's moments, Lion's and Muon's momentum) are kept in between
  # steps: "float32", or "bfloat16" (DeepSeek-V3's recipe: 4 bytes per parameter less for AdamW; each update
  # computes in float32 and rounds the new statistics to nearest). bfloat16 keeps 8 significant bits, so an
  # average whose step-to-step change 1 - b is below 2^-7 would round back to itself: it needs b1, b2 (and
  # muon_beta) at most 0.99, and is refused for adafactor (whose second-moment decay approaches 1).
  moments_dtype: str = "float32"


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
  steps: int = 100
  seed: int = 0
  global_batch_size: int = 16  # sequences per optimizer step, over all devices and micro-batches
  seq_len: int = 128
  grad_accum_steps: int = 1  # micro-batches per step; each holds global_batch_size / grad_accum_steps
  log_every: int = 10
  eval_every: int = 50  # 0: evaluate only at the end
  eval_batches: int = 4
  # Peak dense FLOP/s of one device for MFU; 0 looks the device kind up (H100, H200, ...), unknown -> no MFU.
  peak_flops_per_device: float = 0.0
  # The share of each GPU's memory JAX's allocator takes (runtime/gpu_memory.py): the rest is left to the CUDA
  # context, cuBLAS/cuDNN workspaces and NCCL's buffers. The planner and the AOT report judge fits against it.
  gpu_memory_fraction: float = 0.9
  profile_steps: str = ""  # "START:STOP" writes a jax.profiler trace of those steps to <workdir>/profile
  # "hf:<folder>": start from a Hugging Face checkpoint folder (config.json + *.safetensors; Mixtral,
  # Qwen3-MoE, DeepSeek-V3; models/hf_checkpoint.py). The model comes from its config.json, except the
  # fields that change how it computes, not what: model.dtype, remat, logits_chunk_bytes and init_std, and
  # the MoE's capacity_factor, loss weights and expert_bias_update_rate stay yours (hf_checkpoint._RUN_FIELDS).
  # The tokenizer comes from its tokenizer.json while data.tokenizer is "byte". A workdir that holds
  # checkpoints resumes from them instead.
  init_from: str = ""
  # A folder that does not exist yet: at the end of training (not when preempted) the final parameters
  # are written there as a Hugging Face folder, bfloat16, with the tokenizer (models/hf_export.py; the
  # model must be one of the families it writes). Also: `python -m experiments.convert --to=hf`.
  export_hf: str = ""


@dataclasses.dataclass(kw_only=True)
class DataConfig:
  # "stdlib": bytes of this interpreter's standard-library source files (no download). Else files in `paths`:
  # "text" (each file a document), "jsonl" (a `text` field per line), "parquet" (a `text` column),
  # "arrayrecord" (UTF-8 text records); these are tokenized once into a cache ($MESHMOE_CACHE, default
  # ~/.cache/meshmoe). "tokenized": folders written by `python -m experiments.tokenize`, mixed by weight:
  # paths="[name=]folder[:weight],..." (weights summing to 1; one folder needs none). src/data/pipeline.py.
  source: str = "stdlib"
  paths: str = ""  # comma-separated files or glob patterns; for "tokenized", the dataset folders
  eval_paths: str = ""  # held-out files; empty: hold out `eval_fraction` of the documents, chosen by hash
  eval_fraction: float = 0.05
  # "byte" (vocabulary 256) or the path of a Hugging Face tokenizer.json; "tokenized" datasets name their own.
  tokenizer: str = "byte"
  packing: bool = True  # concatenate documents into full rows; else one document per row, padded
  # Packed rows: a token attends only to earlier tokens of its own document (documents end with the
  # tokenizer's end-of-document token; the batch carries each token's document start). Off: every token
  # attends to every earlier token of its row, from other documents too.
  document_mask: bool = False
  # With document_mask: rotary positions count from 0 in each document. Rotary attention depends only on
  # position differences, so this changes rounding, not the function; it matches recipes that restart them.
  restart_positions: bool = False
  loader_threads: int = 4  # background threads that read and assemble batches ahead; 0: in the train loop


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
  every_steps: int = 100  # 0: only at the end; -1: never (benchmark runs: a stopped run loses its steps)
  keep: int = 3  # newest checkpoints kept on disk
  async_save: bool = True


@dataclasses.dataclass(kw_only=True)
class SampleConfig:
  """Text generated at the end of training, greedy and with temperature sampling."""

  prompt: str = "def "
  max_new_tokens: int = 96
  temperature: float = 0.8


@dataclasses.dataclass(kw_only=True)
class ResilienceConfig:
  """What a run does when something goes wrong (src/runtime/resilience.py, nonfinite.py, stragglers.py)."""

  # A step whose loss or gradient norm is NaN/Inf never updates the state. "halt": stop with a diagnostic
  # naming the first parameter whose gradient is non-finite. "skip": go on with the next batch and count it.
  nan_policy: str = "halt"
  max_consecutive_skips: int = 5  # nan_policy="skip": halt anyway after this many non-finite steps in a row
  # A step, evaluation or checkpoint wait that makes no progress for this long (a collective waiting for a
  # process that died or hangs) ends the process with a clear error and exit status 3.
  watchdog_timeout_s: float = 300.0
  # Every this many steps the processes compare the time each spends on its own work per step (0: never);
  # one slower than the median process by `straggler_factor` is named in the logs and metrics.jsonl.
  straggler_every_steps: int = 50
  straggler_factor: float = 1.5
  # Every this many steps, one step runs under jax.profiler and each device's compute, transfer and waiting
  # are read from its own timeline (0: never; src/runtime/device_timeline.py, with its cost): a device
  # whose slow compute or transfers cost the step at least `timeline_min_cost` of its time, in 2 of the
  # last 3 samples, is named with what it costs per step.
  timeline_every_steps: int = 0
  timeline_min_cost: float = 0.05
  # Debugging and tests only (src/runtime/slow_device.py): device `debug_slow_device` (an id; -1: none)
  # sleeps `debug_slow_device_s` seconds inside every train step.
  debug_slow_device: int = -1
  debug_slow_device_s: float = 0.0


def validate_optimizer(o: OptimizerConfig) -> None:
  check_choice("optimizer.name", o.name, OPTIMIZERS)
  check_positive_float("optimizer.learning_rate", o.learning_rate)
  # Warmup longer than the run is allowed (a short trial run of a long recipe): the rate never peaks.
  check_int("optimizer.warmup_steps", o.warmup_steps, 0, "an integer >= 0")
  check_fraction("optimizer.min_learning_rate_ratio", o.min_learning_rate_ratio, "a number from 0 to 1")
  check_choice("optimizer.schedule", o.schedule, LR_SCHEDULES)
  if not is_number(o.decay_fraction) or not 0 < o.decay_fraction <= 1:
    raise ConfigError("optimizer.decay_fraction", o.decay_fraction, "a number in (0, 1]: the share of train.steps "
                      "that decays")
  check_choice("optimizer.decay_shape", o.decay_shape, LR_DECAY_SHAPES)
  for name in ("b1", "b2"):
    value = getattr(o, name)
    if not is_number(value) or not 0 <= value < 1:
      raise ConfigError(f"optimizer.{name}", value, "a number in [0, 1)")
  check_positive_float("optimizer.eps", o.eps)
  if not is_number(o.muon_beta) or not 0 <= o.muon_beta < 1:
    raise ConfigError("optimizer.muon_beta", o.muon_beta, "a number in [0, 1)")
  check_positive_float("optimizer.muon_update_rms", o.muon_update_rms)
  check_non_negative("optimizer.weight_decay", o.weight_decay)
  check_non_negative("optimizer.grad_clip_norm", o.grad_clip_norm, "a finite number >= 0 (0 disables clipping)")
  for name in ("decay_norms", "decay_biases", "decay_embeddings"):
    check_bool(f"optimizer.{name}", getattr(o, name))
  check_choice("optimizer.moments_dtype", o.moments_dtype, MOMENTS_DTYPES)
  if o.moments_dtype == "bfloat16":
    if o.name == "adafactor":
      raise ConfigError("optimizer.moments_dtype", o.moments_dtype, "'float32' with adafactor: its second-moment "
                        "decay approaches 1, and a bfloat16 average changing by less than 2^-7 a step stays put")
    used = {"adamw": ("b1", "b2"), "lion": ("b1", "b2"), "muon": ("b1", "b2", "muon_beta")}[o.name]
    for name in used:
      if getattr(o, name) > BFLOAT16_MOMENTS_MAX_BETA:
        raise ConfigError(f"optimizer.{name}", getattr(o, name), (
            f"at most {BFLOAT16_MOMENTS_MAX_BETA} with optimizer.moments_dtype='bfloat16' (a bfloat16 average "
            "changing by less than 2^-7 a step rounds back to itself), or moments_dtype='float32'"))


def validate_train(t: TrainConfig, m: ModelConfig) -> None:
  check_positive_int("train.steps", t.steps)
  check_positive_int("train.global_batch_size", t.global_batch_size)
  check_positive_int("train.seq_len", t.seq_len)
  if not isinstance(t.seed, int) or isinstance(t.seed, bool):
    raise ConfigError("train.seed", t.seed, "an integer")
  if t.seq_len > m.max_seq_len:
    raise ConfigError("train.seq_len", t.seq_len, f"at most model.max_seq_len={m.max_seq_len}")
  check_positive_int("train.grad_accum_steps", t.grad_accum_steps)
  if t.global_batch_size % t.grad_accum_steps:
    raise ConfigError("train.grad_accum_steps", t.grad_accum_steps,
                      f"a divisor of train.global_batch_size={t.global_batch_size}")
  check_positive_int("train.log_every", t.log_every)
  check_int("train.eval_every", t.eval_every, 0, "an integer >= 0 (0: evaluate only at the end)")
  check_positive_int("train.eval_batches", t.eval_batches)
  check_non_negative("train.peak_flops_per_device", t.peak_flops_per_device,
                     "a finite number >= 0 (0: look the device up)")
  if not is_number(t.gpu_memory_fraction) or not 0 < t.gpu_memory_fraction <= 1:
    raise ConfigError("train.gpu_memory_fraction", t.gpu_memory_fraction,
                      "a number in (0, 1]: the share of each GPU's memory JAX's allocator takes")
  if not isinstance(t.init_from, str) or (t.init_from and not (t.init_from.startswith("hf:") and t.init_from[3:])):
    raise ConfigError("train.init_from", t.init_from, "empty (random initialisation) or 'hf:<folder>', a Hugging "
                      "Face checkpoint folder")
  if not isinstance(t.export_hf, str):
    raise ConfigError("train.export_hf", t.export_hf, "empty (no export) or the path of a folder to create")
  if t.profile_steps or not isinstance(t.profile_steps, str):
    parts = t.profile_steps.split(":") if isinstance(t.profile_steps, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) >= int(parts[1]):
      raise ConfigError("train.profile_steps", t.profile_steps,
                        "empty (no trace) or 'START:STOP' with 0 <= START < STOP, e.g. '5:8'")


def profile_range(t: TrainConfig) -> range:
  """The steps `train.profile_steps` asks to trace (empty when none)."""
  if not t.profile_steps:
    return range(0)
  start, stop = (int(p) for p in t.profile_steps.split(":"))
  return range(start, stop)


def validate_data(d: DataConfig) -> None:
  check_choice("data.source", d.source, DATA_SOURCES)
  if not isinstance(d.paths, str) or not isinstance(d.eval_paths, str):
    bad = "data.paths" if not isinstance(d.paths, str) else "data.eval_paths"
    raise ConfigError(bad, getattr(d, bad.split(".")[1]), "a comma-separated string of files or glob patterns")
  if d.source != "stdlib" and not d.paths.strip():
    raise ConfigError("data.paths", d.paths, f"one or more files or glob patterns for data.source={d.source!r}")
  if d.source == "stdlib" and d.paths.strip():
    raise ConfigError("data.paths", d.paths, "empty for data.source='stdlib' (set data.source for your files)")
  if d.source == "tokenized":
    mixture_entries(d.paths)
    if d.eval_paths.strip():
      raise ConfigError("data.eval_paths", d.eval_paths, "empty for data.source='tokenized' (each dataset "
                        "folder holds its own eval split)")
  if not is_number(d.eval_fraction) or not 0 < d.eval_fraction < 1:
    raise ConfigError("data.eval_fraction", d.eval_fraction, "a number strictly between 0 and 1")
  if not isinstance(d.tokenizer, str) or not (d.tokenizer == "byte" or d.tokenizer.endswith(".json")):
    raise ConfigError("data.tokenizer", d.tokenizer, "'byte' or the path of a tokenizer.json file")
  check_bool("data.packing", d.packing)
  check_bool("data.document_mask", d.document_mask)
  check_bool("data.restart_positions", d.restart_positions)
  if d.restart_positions and not d.document_mask:
    raise ConfigError("data.restart_positions", d.restart_positions,
                      "False unless data.document_mask=True (positions restart where documents are masked apart)")
  check_int("data.loader_threads", d.loader_threads, 0, "an integer >= 0 (0: load in the train loop)")


def mixture_entries(paths: str) -> list[tuple[str, str, float]]:
  """(name, folder, weight) of each dataset in `data.paths` for data.source='tokenized'.

  Entries are "[name=]folder[:weight]"; the name defaults to the folder's last part. One dataset needs no
  weight; several need one each, positive, summing to 1 (within 0.001: weights are fractions of the rows,
  and a sum far from 1 is usually a forgotten or mistyped source)."""
  entries = []
  for item in (p.strip() for p in paths.split(",") if p.strip()):
    head, named, tail = item.partition("=")
    name, rest = (head, tail) if named and "/" not in head else ("", item)  # a folder may hold "=" too
    folder, _, weight_text = rest.rpartition(":") if ":" in rest else (rest, "", "")
    name = name or folder.rstrip("/").rsplit("/", 1)[-1]
    try:
      weight = float(weight_text) if weight_text else None
    except ValueError:
      raise ConfigError("data.paths", paths, f"weights as numbers; {weight_text!r} in {item!r} is not") from None
    if not name or not all(c.isalnum() or c in "_.-" for c in name):
      raise ConfigError("data.paths", paths, f"dataset names of letters, digits, '_', '.', '-'; {item!r} gives "
                        f"{name!r}")
    if weight is not None and not (math.isfinite(weight) and weight > 0):
      raise ConfigError("data.paths", paths, f"positive finite weights; {item!r} has {weight_text}")
    entries.append((name, folder, weight))
  names = [e[0] for e in entries]
  if len(set(names)) < len(names):
    raise ConfigError("data.paths", paths, f"distinct dataset names (name=folder:weight); {names} repeat one")
  if len(entries) == 1:
    return [(entries[0][0], entries[0][1], 1.0)]
  if any(e[2] is None for e in entries):
    raise ConfigError("data.paths", paths, "a weight for every dataset of a mixture (folder:weight)")
  total = sum(e[2] for e in entries)
  if abs(total - 1) > 1e-3:
    raise ConfigError("data.paths", paths, f"weights that sum to 1; these sum to {total:g}")
  return entries


def validate_checkpoint_and_sample(c: CheckpointConfig, s: SampleConfig) -> None:
  check_int("checkpoint.every_steps", c.every_steps, -1,
            "an integer >= -1 (0: save only at the end; -1: never, for benchmark runs)")
  check_positive_int("checkpoint.keep", c.keep)
  check_bool("checkpoint.async_save", c.async_save)
  if not isinstance(s.prompt, str) or not s.prompt:
    raise ConfigError("sample.prompt", s.prompt, "a non-empty string")
  check_int("sample.max_new_tokens", s.max_new_tokens, 0, "an integer >= 0")
  check_non_negative("sample.temperature", s.temperature, "a finite number >= 0 (0: greedy only)")


def validate_resilience(r: ResilienceConfig) -> None:
  check_choice("resilience.nan_policy", r.nan_policy, NAN_POLICIES)
  check_positive_int("resilience.max_consecutive_skips", r.max_consecutive_skips)
  check_positive_float("resilience.watchdog_timeout_s", r.watchdog_timeout_s, "a finite number of seconds > 0")
  check_int("resilience.straggler_every_steps", r.straggler_every_steps, 0, "an integer >= 0 (0: never compare)")
  if not is_number(r.straggler_factor) or not 1 < r.straggler_factor < math.inf:
    raise ConfigError("resilience.straggler_factor", r.straggler_factor, "a finite number > 1")
  check_int("resilience.timeline_every_steps", r.timeline_every_steps, 0, "an integer >= 0 (0: never sample)")
  if not is_number(r.timeline_min_cost) or not 0 < r.timeline_min_cost < 1:
    raise ConfigError("resilience.timeline_min_cost", r.timeline_min_cost, "a fraction of the step strictly between 0 and 1")
  check_int("resilience.debug_slow_device", r.debug_slow_device, -1, "a device id, or -1 (none)")
  check_non_negative("resilience.debug_slow_device_s", r.debug_slow_device_s, "a finite number of seconds >= 0")
