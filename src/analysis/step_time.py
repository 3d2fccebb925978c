"""Cost model, time part: a training step's predicted time on a GPU cluster, from the FLOPs and collective
bytes of the cost model (cost_model.step_cost) and the GPU's spec (gpus.py). Modelled, never measured.

- Compute: the FLOPs one device executes (`executed_flops_per_device`: forward, backward, remat, padding)
  at `efficiency` times the GPU's dense bf16 peak, the efficiency the planner states; except the routed
  experts' grouped GEMMs where the plan runs a kernel that sharding/gpu_kernel_table.json measured at
  exactly this expert shape on this GPU generation: each form (forward with its remat repeat, input
  gradient, weight gradient) at its measured TFLOP/s (`expert_gemm_rates`; StepTime.gemm_rates says which).
- Communication: each collective's bytes per device (cost_collectives.py; for a ragged exchange the rows it
  sends, not the worst-case buffer the HLO count has) over the links its groups cross.
  A group's members inside this device's node are reached over NVLink, the others over the network (one
  NIC per GPU); the bytes split in that proportion and the slower of the two parts sets the time (a ring
  or all-to-all over both moves them at once).
- Overlap: a collective is hidden behind compute when the tier runs it beside independent work, and
  exposed otherwise (`hidden_fraction`): the fused kernels' traffic inside their own GEMMs, up to those
  GEMMs' time (`fused_overlap`: a kernel whose transfers outlast its tiles' compute waits for them; the
  MoE kernels' traffic against the routed experts' FLOPs in kernels, the projections' against the fused
  projections', each summed over the step's passes), the xla tier's
  ring projections and zigzag ring attention (each transfer beside a block), the chunked MoE pipeline's
  exchanges ((c-1)/c of them: the first chunk's dispatch waits), the two-halves layer schedule's exchanges
  (beside the other half), and, under XLA's overlap flags, gradient reductions (beside the backward of
  the next layer) and FSDP weight gathers (prefetched a layer ahead). The rest is exposed: the reference
  tier's collectives, gathered attention, the expert-width gathers, ZeRO-1's parameter gather after the
  update and the embedding's all-to-all.
  step = max(compute, hidden communication) + exposed communication.
Not modelled: elementwise work (norms, softmax, SwiGLU), kernel launch and collective latency, network
congestion and imbalanced routing; so the step times rank layouts rather than promise a wall clock.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from meshmoe.analysis import cost_kernels, cost_model
from meshmoe.analysis.cost_collectives import CollectiveCost
from meshmoe.analysis.gpus import GpuSpec
from meshmoe.config import Config
from meshmoe.sharding import gpu_kernel_table
from meshmoe.sharding.grouped_gemm_kernels import FORMS
from meshmoe.sharding.plan import ParallelPlan


@dataclasses.dataclass(frozen=True)
class StepTime:
  """Predicted seconds of one training step (modelled) and what sets them."""

  compute_s: float
  hidden_comm_s: float  # communication the tier runs beside compute
  exposed_comm_s: float  # communication nothing hides
  model_flops: float  # useful FLOPs of the step, all devices (cost_model.train_step_flops)
  num_devices: int
  peak_flops: float  # dense bf16 peak of one device
  gemm_rates: str = ""  # the measured rates the routed experts' GEMMs were timed at; "": the stated efficiency

  @property
  def step_s(self) -> float:
    return max(self.compute_s, self.hidden_comm_s) + self.exposed_comm_s

  @property
  def mfu(self) -> float:
    return self.model_flops / (self.step_s * self.num_devices * self.peak_flops)


def predict(config: Config, plan: ParallelPlan, gpu: GpuSpec, efficiency: float, cost=None,
            gpus_per_node: int | None = None) -> StepTime:
  """The step time of `config` run as `plan` says on `gpu`s, GEMMs at `efficiency` of the dense peak.
  `cost`: the cost model's figures if already computed (cost_model.step_cost). `gpus_per_node`: where the
  mesh's processes are not its nodes (one process per GPU), the devices of a node (`peers_in_node`)."""
  cost = cost or cost_model.step_cost(config, plan)
  hidden = exposed = 0.0
  fused = dict.fromkeys(_KERNEL_FLOPS, 0.0)  # seconds of the fused kernels' traffic, by the GEMMs it hides in
  for collective in cost.collectives:
    seconds = transfer_seconds(plan, collective, gpu, gpus_per_node)
    if collective.kind in cost_kernels.FUSED_KINDS:
      fused["moe" if collective.op == "moe" else "projections"] += seconds
      continue
    share = hidden_fraction(plan, collective)
    hidden += share * seconds
    exposed += (1 - share) * seconds
  if any(fused.values()):
    in_kernels = cost_model.flops_in_kernels(config, plan)
    for part, seconds in fused.items():
      kernel_hidden = fused_overlap(seconds, in_kernels[_KERNEL_FLOPS[part]] / (efficiency * gpu.dense_bf16_flops))
      hidden += kernel_hidden
      exposed += seconds - kernel_hidden
  flops = cost.executed_flops_per_device
  compute = flops.total / (efficiency * gpu.dense_bf16_flops)
  rates = expert_gemm_rates(config, plan)
  if rates:  # the routed experts' passes at their measured rates instead
    passes = _expert_passes(flops.routed_experts, config, plan)
    compute += sum(passes[form] / (row.tflops * 1e12) for form, row in rates.items())
    compute -= sum(passes[form] for form in rates) / (efficiency * gpu.dense_bf16_flops)
  described = "; ".join(f"{form.replace('_', ' ')} {row.tflops:.0f} TFLOP/s ({row.implementation}, measured "
                        f"{row.date} on {row.device})" for form, row in rates.items())
  return StepTime(compute, hidden, exposed, cost.model_flops, plan.mesh.size, gpu.dense_bf16_flops, described)


def expert_gemm_rates(config: Config, plan: ParallelPlan) -> dict:
  """{form: the gpu_kernel_table row measuring the kernel the plan runs for it at exactly this expert shape}
  for the routed experts' grouped-GEMM forms that have one (none where the plan fuses the MoE or runs no
  measured kernel)."""
  moe = plan.ops.get("moe")
  kernels = getattr(moe, "gemm_kernels", None)
  if kernels is None or moe.implementation == "fused" or plan.hardware.platform != "gpu":
    return {}
  m = config.model
  width = m.moe.expert_mlp_dim // plan.axis_size(plan.expert_layout().width_axes)
  found = {}
  for form, candidate in zip(FORMS, kernels.candidates()):
    row = gpu_kernel_table.measured_row(candidate, plan.hardware.compute_capability, m.dtype, m.embed_dim, width,
                                        plan.parallel.kernel_table)
    if row is not None:
      found[form] = row
  return found


def _expert_passes(routed_flops: float, config: Config, plan: ParallelPlan) -> dict[str, float]:
  """The routed experts' executed FLOPs by grouped-GEMM form: the input and weight gradients one forward's
  worth each, the forward the rest (its remat repeat included)."""
  forward_units = cost_model.expert_flops_scale(config, plan) - 2.0
  one = routed_flops / (forward_units + 2.0)
  return {"forward": forward_units * one, "input_gradient": one, "weight_gradient": one}


# The fused kernels' traffic, by op, and the part of cost_model.flops_in_kernels whose GEMMs it runs inside.
_KERNEL_FLOPS = {"moe": "routed_experts", "projections": "projections"}


def fused_overlap(transfer_s: float, kernel_compute_s: float) -> float:
  """Seconds of a fused kernel's traffic hidden behind its own GEMMs: all of it up to their time; what
  outlasts them is exposed (the kernels' tiles wait for their rows)."""
  return min(transfer_s, kernel_compute_s)


def transfer_seconds(plan: ParallelPlan, collective: CollectiveCost, gpu: GpuSpec,
                     gpus_per_node: int | None = None) -> float:
  """Seconds one device spends moving a collective's bytes: the part for peers in its node over NVLink,
  the rest over the network, at the same time."""
  group = collective.group_size
  if group <= 1:
    return 0.0
  local = peers_in_node(plan, collective.axes, gpus_per_node)
  remote_share = (group - local) / (group - 1)
  nbytes = collective.transferred
  return max(nbytes * (1 - remote_share) / gpu.nvlink_bandwidth, nbytes * remote_share / gpu.network_bandwidth)


def peers_in_node(plan: ParallelPlan, axes: tuple[str, ...], gpus_per_node: int | None = None) -> int:
  """How many members of a group over `axes` (the first device's group) share its host (node): the mesh's
  own device placement (sharding/mesh.py) decides it, nodes being the devices' process indices, or, given
  `gpus_per_node` (one process per GPU), their ids in runs of that many (a node's devices are numbered
  together, as the deviceless topology and a cluster's launch number them)."""
  grid = plan.mesh.devices
  index = tuple(slice(None) if name in axes else 0 for name in plan.mesh.axis_names)
  members = np.asarray(grid[index]).ravel()
  node = (lambda d: d.process_index) if gpus_per_node is None else (lambda d: d.id // gpus_per_node)
  return sum(node(d) == node(members[0]) for d in members)


def hidden_fraction(plan: ParallelPlan, collective: CollectiveCost) -> float:
  """The share of a collective's time the plan runs beside independent compute (module docstring); not
  for the fused kernels' traffic, which `predict` caps at their GEMMs' time (`fused_overlap`)."""
  if collective.kind in cost_kernels.FUSED_KINDS:
    raise ValueError(f"{collective.kind}: a fused kernel's traffic is hidden up to its GEMMs (fused_overlap)")
  overlapping_flags = plan.parallel.xla_flags != "none"
  if collective.op == "gradients" or collective.op == "weights":
    return 1.0 if overlapping_flags else 0.0
  if collective.op == "attention":
    return 1.0 if plan.ops["attention"].implementation == "zigzag_ring" else 0.0
  if collective.op == "moe":
    if collective.kind not in ("all-to-all", "ragged-all-to-all"):
      return 0.0
    if plan.two_halves:
      return 1.0
    chunks = getattr(plan.ops["moe"], "chunks", 1)
    return (chunks - 1) / chunks
  if collective.op.endswith(".projections"):  # a tensor-parallel block: its ring passes hide
    block = collective.op.removesuffix(".projections")
    rings = [plan.ops.get(f"{block}.{d}") for d in ("project_in", "project_out")]
    ring = any(r is not None and r.implementation == "ring" for r in rings)
    return 1.0 if ring and collective.kind == "collective-permute" else 0.0
  return 0.0
