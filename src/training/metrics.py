"""Training metrics: one JSON line per logged step, TensorBoard scalars and a progress display.

`MetricsLogger` is the single sink the trainer hands its metrics to. Each `log_train`/`log_eval` call
1. appends one JSON object (`step`, `kind` and the metrics) to `<workdir>/metrics.jsonl` and flushes it, so a
   killed process loses at most the line it was writing;
2. writes every numeric metric to TensorBoard (`<workdir>/tensorboard`) as `train/<name>` or `eval/<name>`,
   and per-layer lists as `train/<name>/layer_<i>`;
3. advances a tqdm bar (interactive terminals) or prints one concise line (CI logs, pipes).

Values may be Python numbers, numpy scalars/arrays or JAX arrays (fully addressable, e.g. the replicated
metrics a train step returns); they become plain JSON, with non-finite floats written as `null` because
JSON has no NaN/Infinity and strict readers reject those tokens.

Resuming: a run killed after its last checkpoint has written lines for steps it will run again. Opening the
logger with `resume_step=N` rewrites metrics.jsonl to the records with `step <= N` (byte for byte as they
were), dropping a torn last line, so the finished file reads exactly like an uninterrupted run's;
`resume_step=0` (no checkpoint) starts the file afresh. TensorBoard gets the same treatment through its
purge marker: events of the old run from the first re-run step on are hidden.

Only the primary process writes anything; on the others every method returns at once. Besides `train` and
`eval` records, multi-process runs write `processes` records (per-process step times and stragglers).

Also here: per-layer expert load imbalance, a table of accelerator peak FLOP/s and model FLOPs utilisation
(MFU, from the cost model's useful FLOPs).
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from meshmoe.analysis import gpus

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("step", "kind")


class MetricsLogger:
  """Writes train/eval metrics to metrics.jsonl, TensorBoard and the console (primary process only)."""

  def __init__(self, workdir: str | Path, *, total_steps: int, is_primary: bool = True, resume_step: int = 0,
               use_progress_bar: bool | None = None):
    self.workdir = Path(workdir)
    self.total_steps = total_steps
    self.is_primary = is_primary
    self._last_eval_loss: float | None = None
    self._file = self._writer = self._bar = None
    if not is_primary:
      return
    self.workdir.mkdir(parents=True, exist_ok=True)
    path = self.workdir / METRICS_FILE
    if resume_step > 0 and path.exists():
      truncate_metrics(path, resume_step)
      self._file = path.open("a", encoding="utf-8")
    else:
      self._file = path.open("w", encoding="utf-8")  # a fresh run: nothing before it counts
    self._writer = _summary_writer(self.workdir / TENSORBOARD_DIR, resume_step)
    if use_progress_bar is None:
      use_progress_bar = sys.stdout.isatty()
    if use_progress_bar:
      from tqdm import tqdm

      # The bar goes to stdout because that is the stream whose terminal decided to show it.
      self._bar = tqdm(total=total_steps, initial=resume_step, file=sys.stdout, unit="step", dynamic_ncols=True)

  def log_train(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.is_primary:
      return
    record = self._write("train", step, metrics)
    if self._bar is not None:
      self._bar.update(max(0, step - self._bar.n))
      loss, tokens = _number(record, "loss"), _number(record, "tokens_per_s")
      self._bar.set_postfix_str(_join([_format("loss {:.3f}", loss), _format("{} tok/s", tokens, _short)]))
    else:
      print(self._step_prefix(step) + _join(_train_fields(record, self._last_eval_loss)), flush=True)

  def log_eval(self, step: int, metrics: Mapping[str, Any]) -> None:
    if not self.is_primary:
      return
    record = self._write("eval", step, metrics)
    if _number(record, "loss") is not None:
      self._last_eval_loss = _number(record, "loss")  # shown on the train lines until the next eval
    line = self._step_prefix(step) + _join(_eval_fields(record))
    if self._bar is not None:
      self._bar.write(line, file=sys.stdout)  # above the bar, so eval results stay in the scrollback
    else:
      print(line, flush=True)

  def log_processes(self, step: int, metrics: Mapping[str, Any]) -> None:
    """A comparison of the processes (meshmoe.runtime.stragglers): JSON and TensorBoard, per-process lists."""
    if self.is_primary:
      self._write("processes", step, metrics, list_item="process")

  def log_devices(self, step: int, metrics: Mapping[str, Any]) -> None:
    """A device-timeline sample (meshmoe.runtime.device_timeline): JSON and TensorBoard, per-device lists."""
    if self.is_primary:
      self._write("devices", step, metrics, list_item="device")

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
    if self._writer is not None:
      self._writer.close()
      self._writer = None
    if self._file is not None:
      self._file.close()
      self._file = None

  def __enter__(self) -> MetricsLogger:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()

  def _write(self, kind: str, step: int, metrics: Mapping[str, Any], list_item: str = "layer") -> dict[str, Any]:
    if self._file is None:
      raise ValueError("MetricsLogger is closed")
    clash = [key for key in _RESERVED if key in metrics]
    if clash:
      raise ValueError(f"metric names {clash} are reserved for the record itself")
    record = {"step": int(step), "kind": kind, **{name: to_json(value) for name, value in metrics.items()}}
    # allow_nan=False: a non-finite float that slipped past to_json fails here instead of corrupting the file.
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()
    _write_scalars(self._writer, kind, record, list_item)
    return record

  def _step_prefix(self, step: int) -> str:
    width = len(str(self.total_steps))
    return f"step {step:>{width}}/{self.total_steps}  "


def to_json(value: Any) -> Any:
  """`value` as plain JSON data: numbers, lists, dicts, strings; non-finite floats become None."""
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, int):
    return value
  if isinstance(value, float):
    return value if math.isfinite(value) else None
  if isinstance(value, Mapping):
    return {str(k): to_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [to_json(v) for v in value]
  array = np.asarray(value)  # numpy scalars and arrays, JAX arrays (copied to the host)
  if array.dtype.kind not in "iubUS":
    array = array.astype(np.float64)  # float16/bfloat16/float32 and friends print as exact float64 values
  return to_json(array.tolist())


def truncate_metrics(path: str | Path, resume_step: int) -> None:
  """Keeps the complete records of `path` with `step <= resume_step`, unchanged, replacing the file atomically.

  Dropped: records of later steps (they will be logged again), and lines that are unterminated or do not
  parse (a process killed mid-write leaves at most one such line, the last)."""
  path = Path(path)
  kept = [line for line in path.read_bytes().splitlines(keepends=True) if _keep(line, resume_step)]
  # Write beside the target so os.replace stays on one file system and is atomic: a crash leaves the old
  # file or the new one, never a half-written mix.
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.writelines(kept)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise


def last_train_loss(path: str | Path) -> float:
  """The loss of the newest complete train record in `path` (what a resumed run that has no step left to
  train reports as its final loss); NaN when there is none (no file, or no train record)."""
  path = Path(path)
  if not path.exists():
    return float("nan")
  losses = [record["loss"] for record in map(_record, path.read_bytes().splitlines(keepends=True))
            if record and record.get("kind") == "train" and _is_number(record.get("loss"))]
  return float(losses[-1]) if losses else float("nan")


def _record(line: bytes) -> dict | None:
  """One metrics.jsonl line as a dict, or None for a line that is unterminated or does not parse."""
  if not line.endswith(b"\n"):
    return None
  try:
    record = json.loads(line)
  except ValueError:
    return None
  return record if isinstance(record, dict) else None


def _keep(line: bytes, resume_step: int) -> bool:
  record = _record(line)
  step = record.get("step") if record else None
  return isinstance(step, int) and step <= resume_step


def _summary_writer(logdir: Path, resume_step: int):
  from tensorboardX import SummaryWriter

  # TensorBoard hides events of earlier files whose step >= purge_step: after a resume from checkpoint N
  # those are the old run's steps N+1..., on a fresh start (no checkpoint) all of them.
  purge_step = resume_step + 1 if resume_step > 0 else 0
  # tensorboardX names the file by the whole second and host only, so a restart within the same second would
  # overwrite the previous file; the nanoseconds within that second keep the names distinct and in order.
  suffix = f".{time.time_ns() % 1_000_000_000:09d}"
  return SummaryWriter(str(logdir), purge_step=purge_step, filename_suffix=suffix)


def _write_scalars(writer, kind: str, record: Mapping[str, Any], list_item: str = "layer") -> None:
  step = record["step"]
  for name, value in record.items():
    if name in _RESERVED:
      continue
    if _is_number(value):
      writer.add_scalar(f"{kind}/{name}", value, step)
    elif isinstance(value, list) and all(_is_number(v) or v is None for v in value):
      # A flat list is one value per MoE layer (e.g. expert_load_imbalance) or per process. Deeper arrays
      # (the raw [layers, experts] load) stay in metrics.jsonl: hundreds of scalar curves would bury the rest.
      for i, v in enumerate(value):
        if v is not None:
          writer.add_scalar(f"{kind}/{name}/{list_item}_{i}", v, step)
    # None (a non-finite value) and strings are skipped: TensorBoard scalars are numbers.


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(record: Mapping[str, Any], name: str) -> float | None:
  value = record.get(name)
  return float(value) if _is_number(value) else None


def _train_fields(record: Mapping[str, Any], eval_loss: float | None) -> list[str | None]:
  loss, tokens = _number(record, "loss"), _number(record, "tokens_per_s")
  step_time, mfu_value = _number(record, "step_time_s"), _number(record, "mfu")
  return [
      _format("loss {:.3f}", loss),
      _format("eval {:.2f}", eval_loss),
      _format("{} tok/s", tokens, _short),
      _format("step {:.2f}s", step_time),
      _format("mfu {:.1f}%", None if mfu_value is None else 100 * mfu_value),
  ]


def _eval_fields(record: Mapping[str, Any]) -> list[str | None]:
  return [_format("eval loss {:.3f}", _number(record, "loss")) or "eval"]


def _format(template: str, value: float | None, convert=None) -> str | None:
  """`template` filled with `value`, or None when the metric is absent (the field is then left out)."""
  if value is None:
    return None
  return template.format(convert(value) if convert else value)


def _join(fields: list[str | None]) -> str:
  return "  ".join(f for f in fields if f)


def _short(x: float) -> str:
  """1.2e4 rather than 1.2e+04: throughput spans orders of magnitude, two digits are enough."""
  mantissa, exponent = f"{x:.1e}".split("e")
  return f"{mantissa}e{int(exponent)}"


def expert_load_imbalance(load_LE: Any) -> list[float]:
  """Per MoE layer, the busiest expert's load over the mean load (1.0 = perfectly balanced).

  `load_LE` is [layers, experts] in any unit (counts or fractions: the ratio does not care). A layer that
  received no tokens at all reports 1.0: zero load cannot be imbalanced, and NaN would break the curves."""
  load = np.asarray(load_LE, dtype=np.float64)
  if load.ndim != 2:
    raise ValueError(f"expert load must be [layers, experts], got shape {load.shape}")
  mean, peak = load.mean(axis=1), load.max(axis=1, initial=0.0)
  return [float(p / m) if m > 0 else 1.0 for p, m in zip(peak, mean, strict=True)]


# Dense BF16 tensor-core peak per device, from NVIDIA's datasheets; the datasheets quote the sparse
# (2:4 structured sparsity) figure, which is twice these, so each is half the quoted number. Matched on
# lowercase substrings of `jax.Device.device_kind`, first match wins (PCIe/NVL before the SXM default).
# The SXM rows are the GPU kinds the planner and the AOT report know: their figures are read from
# meshmoe.analysis.gpus (gpu_specs/hardware.toml, with the datasheets they come from), so each lives once.
_PEAK_BF16_FLOPS = (
    (("h100", "pcie"), 756e12),  # H100 datasheet: PCIe BF16 1,513 TFLOPS sparse
    (("h100", "nvl"), 835e12),  # H100 datasheet: NVL BF16 1,671 TFLOPS sparse
    (("h100",), gpus.gpu("h100").dense_bf16_flops),  # SXM
    (("h200", "nvl"), 835e12),  # H200 datasheet: NVL BF16 1,671 TFLOPS sparse
    (("h200",), gpus.gpu("h200").dense_bf16_flops),  # SXM (GH200's GPU alike)
    (("a100",), gpus.gpu("a100").dense_bf16_flops),  # SXM and PCIe alike (A100 datasheet)
    (("b200",), gpus.gpu("b200").dense_bf16_flops),
)


def peak_flops_per_device(device_kind: str, platform: str) -> float | None:
  """Dense BF16 peak FLOP/s of a known accelerator, e.g. ("NVIDIA H100 80GB HBM3", "gpu") -> 989e12.

  None for CPUs and unknown kinds: an MFU against a guessed peak would mislead more than no MFU."""
  if platform.lower() == "cpu":
    return None
  kind = device_kind.lower()
  for words, peak in _PEAK_BF16_FLOPS:
    if all(w in kind for w in words):
      return peak
  return None


def mfu(model_flops_per_step: float, step_time_s: float, num_devices: int, peak: float | None) -> float | None:
  """Model FLOPs utilisation as a fraction: useful FLOPs per second over the devices' combined peak.

  None when the peak is unknown or the step time is not a positive finite number (nothing measured)."""
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  if peak is None or peak <= 0 or not (math.isfinite(step_time_s) and step_time_s > 0):
    return None
  return model_flops_per_step / (step_time_s * num_devices * peak)
