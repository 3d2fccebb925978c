"""Reading metrics.jsonl back and plotting a run: loss curves and per-layer expert load imbalance.

The plot is drawn on a bare `matplotlib.figure.Figure` rendered by the Agg canvas, never through pyplot:
pyplot would pick (or need) a display backend and keep global figure state, and switching the global backend
with `matplotlib.use("Agg")` would break inline plots for a notebook that imports this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

_MAX_LEGEND_LAYERS = 8  # beyond this a colour bar labels the layers; a legend would cover the curves


def read_metrics(path: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
  """(train records, eval records) of a metrics.jsonl, in file order.

  A torn last line (a run still writing, or killed mid-line) is skipped rather than failing the report."""
  train, evals = [], []
  for line in Path(path).read_text(encoding="utf-8").splitlines():
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if not isinstance(record, dict):
      continue
    if record.get("kind") == "train":
      train.append(record)
    elif record.get("kind") == "eval":
      evals.append(record)
  return train, evals


def plot_training(metrics_path: str | Path, out_png: str | Path, *, reference_loss: float | None = None,
                  reference_label: str = "reference") -> Path:
  """Writes a two-panel PNG of a run: losses (with an optional reference line) and expert load imbalance.

  `reference_loss` is drawn as a dashed horizontal line in the loss's units (nats per token), e.g. the
  corpus' unigram entropy: a model below it has learned more than symbol frequencies."""
  fig = training_figure(metrics_path, reference_loss=reference_loss, reference_label=reference_label)
  out = Path(out_png)
  out.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(out, format="png")
  return out


def training_figure(metrics_path: str | Path, *, reference_loss: float | None = None,
                    reference_label: str = "reference") -> Figure:
  """The figure `plot_training` saves, for notebooks to show inline or callers to restyle."""
  train, evals = read_metrics(metrics_path)
  fig = Figure(figsize=(11, 4), dpi=110, layout="constrained")
  FigureCanvasAgg(fig)
  loss_ax, load_ax = fig.subplots(1, 2)
  _plot_losses(loss_ax, train, evals, reference_loss, reference_label)
  _plot_imbalance(fig, load_ax, train)
  return fig


def _series(records: list[dict[str, Any]], name: str) -> tuple[list[int], list[float]]:
  """Steps and values of a scalar metric; a null (non-finite) value becomes NaN, a gap in the line."""
  steps, values = [], []
  for r in records:
    if name in r and not isinstance(r[name], list):
      steps.append(r["step"])
      values.append(float("nan") if r[name] is None else float(r[name]))
  return steps, values


def _plot_losses(ax, train, evals, reference_loss, reference_label) -> None:
  ax.set_title("Loss")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per token)")
  steps, values = _series(train, "loss")
  if steps:
    ax.plot(steps, values, label="train", color="tab:blue")
  steps, values = _series(evals, "loss")
  if steps:
    ax.plot(steps, values, "o-", label="eval", color="tab:orange", markersize=4)
  if reference_loss is not None:
    ax.axhline(reference_loss, linestyle="--", color="gray", label=f"{reference_label} ({reference_loss:.2f})")
  if ax.has_data():
    ax.legend()
    ax.grid(alpha=0.3)
  else:
    _note(ax, "no loss records")


def _plot_imbalance(fig, ax, train) -> None:
  ax.set_title("Expert load imbalance (max / mean load)")
  ax.set_xlabel("step")
  ax.set_ylabel("imbalance (1 = balanced)")
  records = [r for r in train if isinstance(r.get("expert_load_imbalance"), list)]
  num_layers = max((len(r["expert_load_imbalance"]) for r in records), default=0)
  if num_layers == 0:
    _note(ax, "no expert_load_imbalance in the metrics")
    return
  cmap = colormaps["viridis"]  # dark to light with depth, so a trend across layers reads at a glance
  norm = Normalize(0, max(num_layers - 1, 1))
  for layer in range(num_layers):
    steps, values = _layer_series(records, layer)
    ax.plot(steps, values, color=cmap(norm(layer)), label=f"MoE layer {layer}")
  ax.axhline(1.0, linestyle=":", color="gray", linewidth=1)
  ax.grid(alpha=0.3)
  if num_layers <= _MAX_LEGEND_LAYERS:
    ax.legend(fontsize="small")
  else:
    fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=ax, label="MoE layer")


def _layer_series(records, layer: int) -> tuple[list[int], list[float]]:
  steps, values = [], []
  for r in records:
    per_layer = r["expert_load_imbalance"]
    if layer < len(per_layer):
      steps.append(r["step"])
      values.append(float("nan") if per_layer[layer] is None else float(per_layer[layer]))
  return steps, values


def _note(ax, text: str) -> None:
  ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")
  ax.set_xticks([])
  ax.set_yticks([])
