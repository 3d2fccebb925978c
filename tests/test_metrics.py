"""Metrics logging and reporting: metrics.jsonl contents and resume, TensorBoard events, console output,
expert load imbalance, peak FLOP/s and MFU, and the training plot.

TensorBoard events are read back by parsing the TFRecord framing (length, masked CRC32C, payload, masked
CRC32C) and decoding each payload with tensorboardX's own `Event` proto: the `tensorboard` package, which
has a reader, is not a dependency.
"""

import json
import math
import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.crc32c import crc32c
from tensorboardX.proto.event_pb2 import Event

from meshmoe.training import metrics as metrics_lib
from meshmoe.training import report
from meshmoe.training.metrics import MetricsLogger, expert_load_imbalance, mfu, peak_flops_per_device

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _strict_loads(line: str):
  """json.loads that rejects the NaN/Infinity tokens Python's json would otherwise accept."""
  def reject(token):
    raise AssertionError(f"non-JSON token {token} in {line!r}")
  return json.loads(line, parse_constant=reject)


def _records(workdir: Path) -> list[dict]:
  return [_strict_loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _run(workdir: Path, steps: range, *, resume_step: int = 0, total_steps: int = 50) -> None:
  """A deterministic fake run: a train record at every step, an eval record every 20 steps."""
  with MetricsLogger(workdir, total_steps=total_steps, resume_step=resume_step, use_progress_bar=False) as log:
    for step in steps:
      log.log_train(step, {"loss": 5.0 / step, "tokens_per_s": 1000.0 * step,
                           "expert_load_imbalance": [1.0 + step / 100, 1.5]})
      if step % 20 == 0:
        log.log_eval(step, {"loss": 6.0 / step})


def _masked_crc(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _read_events(logdir: Path) -> list[Event]:
  events = []
  for path in sorted(logdir.glob("events.out.tfevents.*")):
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
      header = data[pos:pos + 8]
      (length,) = struct.unpack("<Q", header)
      (header_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
      payload = data[pos + 12:pos + 12 + length]
      (payload_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
      assert header_crc == _masked_crc(header) and payload_crc == _masked_crc(payload), f"corrupt {path}"
      events.append(Event.FromString(payload))
      pos += 16 + length
  return events


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
  out: dict[str, list[tuple[int, float]]] = {}
  for event in _read_events(logdir):
    for value in event.summary.value:
      out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


# ---- metrics.jsonl ----------------------------------------------------------------------------------------


def test_jsonl_converts_python_numpy_and_jax_values(tmp_path):
  with MetricsLogger(tmp_path, total_steps=10, use_progress_bar=False) as log:
    log.log_train(1, {
        "loss": 2.5, "tokens": 4096, "grad_norm": np.float32(0.25), "count": np.int64(7),
        "load": np.array([[1, 2], [3, 4]], np.int32), "jax_loss": jnp.float32(1.5),
        "bf16": jnp.asarray(0.5, jnp.bfloat16), "per_layer": jnp.array([1.0, 2.0]),
        "nan": float("nan"), "inf": np.float32(np.inf), "layers_nan": np.array([1.0, np.nan, -np.inf]),
        "label": "ok", "nothing": None,
    })
    log.log_eval(1, {"loss": jnp.float32(3.0)})
  train, evals = _records(tmp_path)
  assert train == {
      "step": 1, "kind": "train", "loss": 2.5, "tokens": 4096, "grad_norm": 0.25, "count": 7,
      "load": [[1, 2], [3, 4]], "jax_loss": 1.5, "bf16": 0.5, "per_layer": [1.0, 2.0],
      "nan": None, "inf": None, "layers_nan": [1.0, None, None], "label": "ok", "nothing": None,
  }
  assert type(train["tokens"]) is int and type(train["count"]) is int and type(train["load"][0][0]) is int
  assert type(train["grad_norm"]) is float and type(train["jax_loss"]) is float
  assert evals == {"step": 1, "kind": "eval", "loss": 3.0}
  assert list(train)[:2] == ["step", "kind"]


def test_each_line_reaches_the_file_before_close(tmp_path):
  log = MetricsLogger(tmp_path, total_steps=10, use_progress_bar=False)
  try:
    log.log_train(1, {"loss": 1.0})
    assert _records(tmp_path) == [{"step": 1, "kind": "train", "loss": 1.0}]
    log.log_eval(1, {"loss": 2.0})
    assert len(_records(tmp_path)) == 2
  finally:
    log.close()


def test_reserved_metric_names_are_rejected(tmp_path):
  with MetricsLogger(tmp_path, total_steps=10, use_progress_bar=False) as log:
    with pytest.raises(ValueError, match="reserved"):
      log.log_train(1, {"step": 3, "loss": 1.0})


def test_resume_keeps_records_up_to_the_checkpoint_byte_for_byte(tmp_path):
  uninterrupted, killed = tmp_path / "uninterrupted", tmp_path / "killed"
  _run(uninterrupted, range(1, 51))
  # Killed at step 47 (the last checkpoint was step 30) in the middle of writing a line.
  _run(killed, range(1, 48))
  original = (killed / "metrics.jsonl").read_bytes()
  with (killed / "metrics.jsonl").open("ab") as f:
    f.write(b'{"step": 48, "kind": "tra')

  MetricsLogger(killed, total_steps=50, resume_step=30, use_progress_bar=False).close()
  truncated = (killed / "metrics.jsonl").read_bytes()
  assert [r["step"] for r in _records(killed)] == list(range(1, 21)) + [20] + list(range(21, 31))
  assert original.startswith(truncated) and truncated.endswith(b"\n")
  assert sorted(p.name for p in killed.iterdir()) == ["metrics.jsonl", "tensorboard"]  # no temp file left

  _run(killed, range(31, 51), resume_step=30)
  assert (killed / "metrics.jsonl").read_bytes() == (uninterrupted / "metrics.jsonl").read_bytes()


def test_resume_drops_unparsable_lines(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_bytes(b'{"step": 1, "kind": "train", "loss": 1.0}\nnot json\n{"step": 2, "kind": "train"}\n{"step"')
  metrics_lib.truncate_metrics(path, resume_step=5)
  assert path.read_bytes() == b'{"step": 1, "kind": "train", "loss": 1.0}\n{"step": 2, "kind": "train"}\n'
  # Killed between the record and its newline: complete JSON, but the next line would be glued onto it.
  path.write_bytes(b'{"step": 1, "kind": "train"}\n{"step": 2, "kind": "train"}')
  metrics_lib.truncate_metrics(path, resume_step=5)
  assert path.read_bytes() == b'{"step": 1, "kind": "train"}\n'


def test_fresh_start_replaces_an_old_file(tmp_path):
  _run(tmp_path, range(1, 11))
  _run(tmp_path, range(1, 3))
  assert [r["step"] for r in _records(tmp_path)] == [1, 2]


# ---- TensorBoard ------------------------------------------------------------------------------------------


def test_tensorboard_gets_every_scalar_and_per_layer_values(tmp_path):
  with MetricsLogger(tmp_path, total_steps=10, use_progress_bar=False) as log:
    log.log_train(5, {"loss": 2.5, "tokens_per_s": 100, "expert_load_imbalance": jnp.array([1.25, 2.0]),
                      "grad_norm": float("nan"), "expert_load": np.ones((2, 4))})
    log.log_eval(5, {"loss": 3.0})
  scalars = _scalars(tmp_path / "tensorboard")
  assert scalars == {
      "train/loss": [(5, 2.5)], "train/tokens_per_s": [(5, 100.0)],
      "train/expert_load_imbalance/layer_0": [(5, 1.25)], "train/expert_load_imbalance/layer_1": [(5, 2.0)],
      "eval/loss": [(5, 3.0)],
  }


def test_tensorboard_resume_marks_the_purge_step(tmp_path):
  _run(tmp_path, range(1, 4))
  _run(tmp_path, range(3, 5), resume_step=2)
  starts = [e.step for e in _read_events(tmp_path / "tensorboard") if e.HasField("session_log")]
  assert starts == [0, 3]  # fresh run purges everything older; the resume hides steps >= 3 of the first


# ---- console and non-primary processes ------------------------------------------------------------------


def test_line_output_without_a_terminal(tmp_path, capsys):
  with MetricsLogger(tmp_path, total_steps=300, use_progress_bar=False) as log:
    log.log_train(7, {"loss": 3.14159})
    log.log_eval(20, {"loss": np.float32(2.796)})
    log.log_eval(30, {"accuracy": 0.5})  # no loss: the train lines keep showing the last eval loss
    log.log_train(40, {"loss": 2.7314, "tokens_per_s": 12345.0, "step_time_s": 0.3149, "mfu": 0.1234,
                       "grad_norm": 1.0})
    log.log_train(41, {"loss": None, "tokens_per_s": float("nan"), "step_time_s": 0.5})
  assert capsys.readouterr().out.splitlines() == [
      "step   7/300  loss 3.142",
      "step  20/300  eval loss 2.796",
      "step  30/300  eval",
      "step  40/300  loss 2.731  eval 2.80  1.2e4 tok/s  step 0.31s  mfu 12.3%",
      "step  41/300  eval 2.80  step 0.50s",
  ]


def test_progress_bar_shows_loss_and_throughput(tmp_path, capsys):
  with MetricsLogger(tmp_path, total_steps=100, resume_step=10, use_progress_bar=True) as log:
    log.log_train(40, {"loss": 2.5, "tokens_per_s": 2.0e4})
    log.log_eval(40, {"loss": 2.75})
  out = capsys.readouterr().out
  assert "40/100" in out and "loss 2.500" in out and "2.0e4 tok/s" in out
  assert "step  40/100  eval loss 2.750\n" in out
  assert (tmp_path / "metrics.jsonl").exists()


def test_non_primary_process_writes_nothing(tmp_path, capsys):
  workdir = tmp_path / "run"
  with MetricsLogger(workdir, total_steps=10, is_primary=False, resume_step=3, use_progress_bar=True) as log:
    log.log_train(4, {"loss": 1.0})
    log.log_eval(4, {"loss": 1.0})
  assert not workdir.exists()
  assert capsys.readouterr() == ("", "")


# ---- expert load, peak FLOP/s and MFU ---------------------------------------------------------------------


def test_expert_load_imbalance_by_hand():
  load_LE = [[2, 2, 2, 2],  # balanced
             [8, 0, 0, 0],  # one expert takes all: 8 / 2
             [0, 0, 0, 0],  # no tokens: reported as balanced
             [3, 1, 1, 3]]  # 3 / 2
  assert expert_load_imbalance(load_LE) == [1.0, 4.0, 1.0, 1.5]
  assert expert_load_imbalance(jnp.array([[0.1, 0.3, 0.2, 0.4]])) == pytest.approx([1.6])
  assert expert_load_imbalance(np.zeros((0, 8))) == []
  with pytest.raises(ValueError, match=r"\[layers, experts\]"):
    expert_load_imbalance([1.0, 2.0])


@pytest.mark.parametrize("kind, platform, peak", [
    ("NVIDIA H100 80GB HBM3", "gpu", 989e12),
    ("NVIDIA H100 PCIe", "gpu", 756e12),
    ("NVIDIA H100 NVL", "gpu", 835e12),
    ("NVIDIA H200", "gpu", 989e12),
    ("NVIDIA A100-SXM4-80GB", "gpu", 312e12),
    ("NVIDIA A100 80GB PCIe", "gpu", 312e12),
    ("NVIDIA B200", "gpu", 2.25e15),
    ("NVIDIA GeForce RTX 4090", "gpu", None),
    ("cpu", "cpu", None),
    ("NVIDIA H100 80GB HBM3", "cpu", None),
])
def test_peak_flops_lookup(kind, platform, peak):
  assert peak_flops_per_device(kind, platform) == peak


def test_peak_flops_of_this_machines_cpu_is_unknown():
  import jax

  device = jax.devices("cpu")[0]
  assert peak_flops_per_device(device.device_kind, device.platform) is None


def test_mfu_arithmetic():
  # 4e14 useful FLOPs in 0.5 s on 8 devices of 1e14 FLOP/s: 8e14 FLOP/s of 8e14 possible.
  assert mfu(4e14, 0.5, 8, 1e14) == pytest.approx(1.0)
  assert mfu(4e14, 0.5, 8, 989e12) == pytest.approx(4e14 / (0.5 * 8 * 989e12))
  assert mfu(1e12, 2.0, 1, 1e13) == pytest.approx(0.05)
  assert mfu(1e12, 2.0, 1, None) is None
  assert mfu(1e12, 2.0, 1, 0.0) is None
  assert mfu(1e12, 0.0, 1, 1e13) is None
  assert mfu(1e12, math.nan, 1, 1e13) is None
  with pytest.raises(ValueError):
    mfu(1e12, 1.0, 0, 1e13)


# ---- report -----------------------------------------------------------------------------------------------


def test_read_metrics_splits_kinds_and_skips_a_torn_line(tmp_path):
  _run(tmp_path, range(1, 41))
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 41, "ki')
  train, evals = report.read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in train] == list(range(1, 41))
  assert [(r["step"], r["loss"]) for r in evals] == [(20, 0.3), (40, 0.15)]


def _png_size(path: Path) -> tuple[int, int]:
  data = path.read_bytes()
  assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
  return struct.unpack(">II", data[16:24])


def test_plot_training_with_eval_imbalance_and_reference(tmp_path):
  _run(tmp_path, range(1, 41))
  out = report.plot_training(tmp_path / "metrics.jsonl", tmp_path / "plots" / "training.png",
                             reference_loss=4.2, reference_label="unigram entropy")
  assert out == tmp_path / "plots" / "training.png"
  assert _png_size(out) == (1210, 440)  # 11 x 4 inches at 110 dpi
  assert out.stat().st_size > 20_000  # curves, labels and a legend, not a blank canvas


def test_training_figure_draws_losses_reference_and_one_line_per_layer(tmp_path):
  _run(tmp_path, range(1, 41))
  fig = report.training_figure(tmp_path / "metrics.jsonl", reference_loss=4.2, reference_label="unigram")
  loss_ax, load_ax = fig.axes
  assert [line.get_label() for line in loss_ax.get_lines()] == ["train", "eval", "unigram (4.20)"]
  train_line, eval_line, reference = loss_ax.get_lines()
  assert list(eval_line.get_xdata()) == [20, 40] and list(eval_line.get_ydata()) == [0.3, 0.15]
  assert len(train_line.get_xdata()) == 40 and list(reference.get_ydata()) == [4.2, 4.2]
  layer_lines = [line for line in load_ax.get_lines() if line.get_label().startswith("MoE layer")]
  assert [line.get_label() for line in layer_lines] == ["MoE layer 0", "MoE layer 1"]
  assert list(layer_lines[1].get_ydata()) == [1.5] * 40
  assert loss_ax.get_title() and load_ax.get_title() and loss_ax.get_xlabel() == "step"
  assert loss_ax.get_legend() is not None and load_ax.get_legend() is not None


def test_training_figure_notes_missing_imbalance(tmp_path):
  with MetricsLogger(tmp_path, total_steps=2, use_progress_bar=False) as log:
    log.log_train(1, {"loss": 1.0})
  _, load_ax = report.training_figure(tmp_path / "metrics.jsonl").axes
  assert load_ax.get_lines() == [] and [t.get_text() for t in load_ax.texts] == [
      "no expert_load_imbalance in the metrics"]


def test_training_figure_of_an_empty_run(tmp_path):
  (tmp_path / "metrics.jsonl").write_text("")
  loss_ax, load_ax = report.training_figure(tmp_path / "metrics.jsonl").axes
  assert [t.get_text() for t in loss_ax.texts] == ["no loss records"] and not loss_ax.get_lines()
  assert [t.get_text() for t in load_ax.texts] == ["no expert_load_imbalance in the metrics"]


def test_plot_training_without_eval_or_imbalance(tmp_path):
  with MetricsLogger(tmp_path, total_steps=5, use_progress_bar=False) as log:
    for step in range(1, 6):
      log.log_train(step, {"loss": 5.0 - step if step != 3 else float("nan")})
  out = report.plot_training(tmp_path / "metrics.jsonl", tmp_path / "training.png")
  assert _png_size(out) == (1210, 440)
  assert out.stat().st_size > 10_000


def test_plot_training_many_layers_uses_a_colour_bar(tmp_path):
  with MetricsLogger(tmp_path, total_steps=3, use_progress_bar=False) as log:
    for step in range(1, 4):
      log.log_train(step, {"loss": 1.0, "expert_load_imbalance": [1.0 + i / 10 for i in range(12)]})
  out = report.plot_training(tmp_path / "metrics.jsonl", tmp_path / "training.png")
  assert _png_size(out) == (1210, 440)
