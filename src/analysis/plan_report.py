"""The planner's output as text (experiments.plan): what it searched, the ranked layouts, the config's own
layout among them, and predicted beside compiled figures for the layouts it verifies. Every figure from
planner.py is labelled modelled; compiled ones come from aot.analyze and are printed beside, never mixed."""

from __future__ import annotations

from meshmoe.analysis import planner
from meshmoe.config import Config, ConfigError
from meshmoe.sharding.plan import process_layout as process_layout_of

_GB = 1e9


def header(found: planner.Search, gpus_per_node: int, efficiency: float) -> str:
  g = found.gpu
  invalid = sum(found.invalid.values())
  reasons = ", ".join(f"{field} {count}" for field, count in found.invalid.most_common(4))
  return "\n".join([
      f"{found.num_gpus} x {g.description}, {gpus_per_node} per node: dense bf16 {g.dense_bf16_flops / 1e12:.0f} "
      f"TFLOP/s at {efficiency:.0%} (stated efficiency), NVLink {g.nvlink_bandwidth / _GB:.0f} GB/s and network "
      f"{g.network_bandwidth / _GB:.0f} GB/s per GPU per direction; memory {g.memory_bytes / _GB:.1f} GB, planned "
      f"to {found.capacity_bytes / _GB:.1f} GB (train.gpu_memory_fraction less --memory_margin)",
      f"searched {found.evaluated} layouts: {invalid} refused by the config validation"
      + (f" ({reasons})" if reasons else "")
      + "; of the rest, per (mesh, preset, experts, storage, optimizer, tier, buffers, remat) the fewest "
      "micro-batches that fit: "
      f"{len(found.ranked) + found.equivalent} fit ({found.equivalent} of them predicted the same as a simpler "
      f"one ranked here), {'some' if found.too_big else 'none'} do not fit with any"]) + "\n"


_COLUMNS = (f"{'rank':>4s} {'mesh d.e.t.s':>11s} {'preset':9s} {'experts':7s} {'storage':7s} {'optimizer':9s} "
            f"{'tier':9s} {'buffers':8s} {'µb':>4s}"
            f" {'remat':5s} {'memory':>9s} {'step s':>8s} {'tokens/s':>10s} {'MFU':>6s} {'exposed s':>9s}")


def ranked_table(found: planner.Search, top: int) -> str:
  lines = ["modelled (cost model + step_time; memory per device, step and exposed communication in seconds; "
           "buffers: the MoE receive buffers, 'worst' for the dropless worst case or f x balanced routing / the "
           "micro-batches of the step that redoes an overflowing one):", _COLUMNS]
  for rank, candidate in enumerate(found.ranked[:top], 1):
    lines.append(_row(rank, candidate, found))
  measured = [rank for rank, c in enumerate(found.ranked[:top], 1) if c.time.gemm_rates]
  if measured:
    best = found.ranked[measured[0] - 1].time.gemm_rates
    which = f"ranks {', '.join(map(str, measured))} time" if len(measured) > 1 else f"rank {measured[0]} times"
    lines.append(f"{which} the routed experts' GEMMs at the rates "
                 f"sharding/gpu_kernel_table.json measured at their expert shape (#{measured[0]}: {best}); the "
                 "rest of the compute at the stated efficiency")
  return "\n".join(lines)


def _row(rank, candidate: planner.Candidate, found: planner.Search) -> str:
  t = candidate.time
  return (f"{rank!s:>4s} {candidate.layout.describe()} {candidate.memory_bytes / _GB:6.2f} GB {t.step_s:8.4g} "
          f"{found.tokens_per_step / t.step_s:10.0f} {t.mfu:6.1%} {t.exposed_comm_s:9.3g}")


def process_layout(found: planner.Search, config: Config, per_gpu: planner.Candidate | None) -> str:
  """How many processes per node the best layout was planned for (one: every device of a node in one
  process, so the fused kernels run wherever their ring stays in a node), what launching it needs, and
  the best layout with one process per GPU (planner.best_with_one_process_per_gpu; modelled)."""
  best = found.ranked[0]
  need, why = process_layout_of(best.layout.apply(config).parallel)
  if need != "node":
    return f"processes: planned with one per node; one per GPU runs the same plan ({why})"
  line = (f"processes: planned with one per node; {why}: experiments/slurm/train.sbatch and experiments.launch "
          "run one per node for it")
  if per_gpu is None:
    return line + "\n  with one process per GPU: no layout of the fastest fits"
  slower = per_gpu.time.step_s / best.time.step_s - 1
  rank = next(i for i, c in enumerate(found.ranked, 1) if c.layout == per_gpu.layout)
  falls_back = process_layout_of(per_gpu.layout.apply(config).parallel)[0] == "node"
  return (line + f"\n  with one process per GPU the best is #{rank} ({per_gpu.layout.describe().strip()})"
          + (", its fused kernels' rings that cross processes falling back" if falls_back else "")
          + f": {per_gpu.time.step_s:.4g} s, {per_gpu.time.mfu:.1%} MFU, {slower:.1%} slower (modelled)")


def own_layout(config: Config, found: planner.Search, gpus_per_node: int | None, efficiency: float) -> str:
  """Where the config's own layout ranks, and how far the best is from it (modelled)."""
  try:
    own = planner.Layout.of(config, found.num_gpus)
    candidate = planner.evaluate(config, own, found, gpus_per_node, efficiency)
  except ConfigError as error:
    return f"\nthe config's own layout is not valid on {found.num_gpus} GPUs: {error}"
  if not candidate.fits:
    return (f"\nthe config's own layout ({own.describe().strip()}) does not fit: "
            f"{candidate.memory_bytes / _GB:.1f} GB modelled, {found.capacity_bytes / _GB:.1f} GB planned")
  rank = 1 + sum(c.time.step_s < candidate.time.step_s for c in found.ranked)
  best = found.ranked[0].time.step_s
  return "\n".join([
      "", "the config's own layout (modelled):", _COLUMNS, _row(rank, candidate, found),
      f"ranks {rank} of {len(found.ranked)}: the best layout's step is predicted "
      f"{1 - best / candidate.time.step_s:.1%} shorter ({best:.4g} s against {candidate.time.step_s:.4g} s)"])


def nothing_fits(found: planner.Search, smallest) -> str:
  """The error when no layout fits: the closest one and what fills it, and the fewest GPUs where one fits."""
  if not found.too_big:
    reasons = ", ".join(f"{field} ({count})" for field, count in found.invalid.most_common())
    return (f"error: no layout of this config is valid on {found.num_gpus} GPUs: the config validation refused "
            f"every one, by field: {reasons}. A GPU count that divides the batch, the heads and the model "
            "dimension (e.g. a power of two) will have some.")
  lines = [f"error: no layout fits {found.num_gpus} x {found.gpu.description} "
           f"({found.capacity_bytes / _GB:.1f} GB planned per device)."]
  if found.too_big:
    closest = found.too_big[0]
    activations = closest.memory_bytes - closest.state_bytes
    lines.append(f"The least memory (modelled) is {closest.memory_bytes / _GB:.1f} GB per device, with "
                 f"{closest.layout.overrides()}: {closest.state_bytes / _GB:.1f} GB of parameters, gradients and "
                 f"optimizer state, which more GPUs split further, and {activations / _GB:.1f} GB of activations "
                 "with its micro-batches.")
  if smallest:
    n, candidate = smallest
    lines.append(f"The smallest GPU count where a layout fits: {n} ({candidate.memory_bytes / _GB:.1f} GB modelled "
                 f"with {candidate.layout.overrides()}).")
  else:
    lines.append("No GPU count up to 16384 fits it.")
  return "\n".join(lines)


def verified(rank: int, candidate: planner.Candidate, report: dict) -> str:
  """A candidate's compiled figures (`report`: planner.verify's) beside its modelled ones."""
  memory, flops = report["memory"], report["flops"]
  modelled_bytes = sum(r["cost_model"] for r in report["collective_bytes_by_kind"].values())
  compiled_bytes = sum(r["compiled"] for r in report["collective_bytes_by_kind"].values())
  peak = memory["peak_bytes_per_device"]
  return "\n".join([
      f"\nverified #{rank} ({candidate.layout.describe().strip()}), compiled deviceless"
      f"{' (read from the analysis cache)' if report.get('compiled_from_cache') else ''} in "
      f"{report['compile_seconds']:.0f} s:",
      "                         predicted (cost model)   compiled (XLA)   compiled / predicted",
      f"  memory per device      {candidate.memory_bytes / _GB:12.2f} GB  {peak / _GB:12.2f} GB   "
      f"{peak / candidate.memory_bytes:6.3f}   ({'fits' if memory['fits'] else 'DOES NOT FIT'})",
      f"  matmul FLOPs (XLA's)   {flops['cost_model_outside_kernels'] / 1e12:12.2f} TF  "
      f"{flops['compiled'] / 1e12:12.2f} TF   {_ratio(flops['compiled'], flops['cost_model_outside_kernels'])}",
      f"  collective bytes       {modelled_bytes / _GB:12.2f} GB  {compiled_bytes / _GB:12.2f} GB   "
      f"{_ratio(compiled_bytes, modelled_bytes)}",
      f"  kernels' FLOPs {sum(flops['kernels_modelled'].values()) / 1e12:.2f} TF (modelled only: opaque custom calls)"])


def _ratio(compiled: float, modelled: float) -> str:
  return f"{compiled / modelled:6.3f}" if modelled else "     -"

