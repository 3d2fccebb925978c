"""The parallel plan: how every parallel op runs for one (config, mesh), decided once, before tracing.

`ParallelPlan.build(config, mesh)` resolves the rules preset (checking that every dimension it splits
divides evenly), reads what the devices can do (`Hardware`) and decides, for each parallel op, which of
its implementations runs, and why where the tier's first choice cannot. The parallel ops
(tensor_parallel, context_parallel, expert_parallel) find the plan in the sharding context
(`shardings.use_plan`) and dispatch through their own table of implementations by the name the plan
gives; the cost model, the AOT report, the benchmarks and the trainer read the same plan. A run prints
`plan.table()` at start-up and writes `plan.to_json()` to <workdir>/plan.json.

One function answers each question:
- Tiers (`parallel.impl`) are interpreted here only: `TIERS`.
- Choices that depend on a call's shapes (does a fused kernel tile them?) are methods, `attention`,
  `project_in`, `project_out` and `expert_ffn`, which an op calls with the shapes it traces and `build`
  calls with the shapes the config implies, to record them in `ops` (what the table, plan.json and the
  cost model read).
- Layout questions, for the ops and the cost model alike: over which mesh axes a projection gathers the
  sequence (`projection_axes`), how expert parallelism splits and gathers (`expert_layout`), how a weight
  is placed inside an op and so which axes it is gathered over (`weight_spec` against `param_spec`), and
  in what order the sequence must be for context-parallel attention (`sequence_order`), and which
  processes drive the mesh: a fused kernel runs only where one process drives every device of its ring
  (`processes_per_ring`; Mosaic GPU's communicating kernels store into peers' memory), and `process_layout`
  tells the launchers from the config alone whether a run needs one process per node.
- The grouped GEMM of the unfused MoE paths (`grouped_gemm`), also for ops called with no plan active.
  It and the other choices that depend only on the devices and the shapes (`Hardware`, `grouped_gemm_for`,
  `attention_kernel`) are in hardware.py; the model's tensor-parallel blocks, which `build` walks, in
  projection_blocks.py.
- Beside this file: plan_choices.py holds the plan's vocabulary (the tiers, the kernel backends, the
  records of each choice) and `process_layout`; plan_predict.py walks a config's shapes through the
  methods above for `build` (the predicted `ops`) and decides the gradient sums and the layer schedule.

Implementation names, per op (each op module holds the table that maps them to code):
- attention: "local" (the sequence is not split), "allgather", "ring" (the plain ring), "zigzag_ring"
  (causal quarter blocks, transfers ahead of compute), "ulysses"; its `kernel_backend` is the tokamax
  kernel that computes the blocks ("mosaic", "triton", "xla"; `attention_kernel`), "" for the einsum ones;
- projections (`<block>.project_in` / `.project_out`): "local" (nothing to gather or scatter; partial sums
  psum-ed where tensor-parallel axes do not split the tokens), "collectives" (all-gather / reduce-scatter,
  then or before the matmul), "ring" (the ppermute collective matmul), "fused" (a Flux kernel);
- experts (`moe`): "local" (every expert on this device), "all_to_all" (exchange, grouped GEMM, return,
  in `chunks` pipelined chunks; each exchange in its wire format, `dispatch_formats`/`combine_formats`),
  "fused" (the two Comet kernels);
- gradient synchronisation (`gradients`): "xla" (XLA's all-reduce, inside each op's backward pass and by
  GSPMD for the weights outside the ops), or the routed experts' sum over their replicas compressed:
  "bfloat16", "int8", "sign" (sharding/gradient_sync.py; the other weights' as "xla").
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshmoe.config import (EXCHANGE_FORMAT_FIELDS, MESH_AXES, Config, ConfigError, ParallelConfig,
                            check_weight_storage)
from meshmoe.pallas_kernels import mosaic_tiles
from meshmoe.pallas_kernels.allgather_matmul import api as allgather_matmul
from meshmoe.pallas_kernels.matmul_reducescatter import api as matmul_reducescatter
from meshmoe.pallas_kernels.moe_dispatch_gemm import api as moe_dispatch_gemm
from meshmoe.pallas_kernels.moe_gemm_return import api as moe_gemm_return
from meshmoe.sharding import attention_kernels, exchange_formats, gradient_sync, parallel, plan_predict, rules
from meshmoe.sharding.context_parallel import QUERY_AXES, zigzag_order
from meshmoe.sharding.hardware import Hardware, attention_kernel, grouped_gemm, grouped_gemm_for
from meshmoe.sharding.parallel import Axes
# The plan's vocabulary (plan_choices.py), importable from here too.
from meshmoe.sharding.plan_choices import (FUSED_KERNEL_BACKENDS, ONE_PROCESS_PER_NODE, STREAM_TOKENS, TIERS,
                                          ExpertChoice, ExpertLayout, OpChoice, Tier, describe_axes,
                                          process_layout)
from meshmoe.sharding.rules import Preset, logical_to_spec
from meshmoe.sharding.shardings import named_shardings




def _formats_unsupported_by_kernels(formats) -> str | None:
  """Why the fused MoE kernels cannot run with these exchange formats (they move activation-dtype rows)."""
  if all(exchange_formats.is_plain(*pair) for pair in formats):
    return None
  return "the fused kernels exchange rows in the activation dtype, and a parallel.moe_*_dtype format is set"


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
  """The resolved preset, the devices, and each op's implementation for one (config, mesh) (module
  docstring). Build it with `build` (a run) or `for_mesh` (calling parallel ops directly)."""

  mesh: Mesh
  preset: str
  rules: Preset
  parallel: ParallelConfig
  hardware: Hardware
  grouped_gemm: str  # resolved for the model's dtype where it matters: see `expert_ffn`
  gemm_block_rows: int
  weight_storage: str = "preset"  # `mesh.weight_storage`, applied to `rules` (rules.with_storage)
  # `mesh.expert_axes` and `mesh.expert_width_axes`, applied to `rules` (MoE parallel folding: rules.fold_experts)
  expert_axes: str = "preset"
  expert_width_axes: str = "preset"
  # `mesh.optimizer_storage`, applied to `rules` (rules.with_optimizer_storage): the distributed optimizer
  optimizer_storage: str = "weights"
  ops: dict[str, OpChoice] = dataclasses.field(default_factory=dict)  # predicted from the config's shapes

  @classmethod
  def build(cls, config: Config, mesh: Mesh) -> ParallelPlan:
    """The plan of a run of `config` on `mesh`. Raises ConfigError when the preset splits a dimension
    over mesh axes whose product does not divide it."""
    rules.check_divisibility(config, axis_sizes(mesh))
    m = config.mesh
    plan = cls.for_mesh(mesh, m.preset, config.parallel, m.weight_storage, m.expert_axes, m.expert_width_axes,
                        m.optimizer_storage)
    return dataclasses.replace(plan, ops=plan_predict.predict(plan, config))

  @classmethod
  def for_mesh(cls, mesh: Mesh, preset: str, parallel: ParallelConfig | None = None,
               weight_storage: str = "preset", expert_axes: str = "preset",
               expert_width_axes: str = "preset", optimizer_storage: str = "weights") -> ParallelPlan:
    """A plan without a model config: for calling parallel ops directly (tests, notebooks). Nothing is
    checked against model shapes and `ops` is empty; the ops decide with the shapes they trace."""
    parallel = (parallel or ParallelConfig()).validate()
    placement = rules.placement(preset, weight_storage, expert_axes, expert_width_axes, optimizer_storage)
    rules.check_expert_axes(placement, axis_sizes(mesh), expert_axes)
    check_weight_storage(weight_storage, parallel, optimizer_storage)
    hardware = Hardware.of(mesh.devices.flat[0])
    plan = cls(mesh, preset, placement, parallel, hardware, grouped_gemm(parallel.grouped_gemm, hardware),
               parallel.gemm_block_rows, weight_storage, expert_axes, expert_width_axes, optimizer_storage)
    if expert_width_axes != "preset":
      try:
        plan.expert_layout()
      except ValueError as error:  # the width axes that split the tokens cannot be gathered over
        raise ConfigError("mesh.expert_width_axes", expert_width_axes,
                          f"axes the MoE can gather its tokens over ({error})") from None
    return plan

  @property
  def tier(self) -> Tier:
    return TIERS[self.parallel.impl]

  @property
  def kernel_tiles(self) -> mosaic_tiles.Tiles:
    """The fused kernels' tiles and thread-block layout (ParallelConfig.kernel_tiles)."""
    return mosaic_tiles.LAYOUTS[self.parallel.kernel_tiles]

  @property
  def two_halves(self) -> bool:
    """Whether MoE layers run their rows in two halves (ParallelConfig.layer_schedule)."""
    layer = self.ops.get("layer")
    return layer.implementation == "two_halves" if layer else self.parallel.layer_schedule == "two_halves"

  @property
  def caps_receive_buffers(self) -> bool:
    """Whether the routed experts' token exchange receives into buffers smaller than the dropless worst
    case (`parallel.moe_buffer_factor`; an overflowing step is run again with worst-case buffers)."""
    moe = self.ops.get("moe")
    return moe is not None and moe.implementation == "all_to_all" and moe.buffer_factor > 0

  @property
  def gradient_compression(self) -> str:
    """How the routed experts' gradients are summed over their replicas (ParallelConfig.gradient_compression)."""
    return self.parallel.gradient_compression

  @property
  def gradient_replica_axes(self) -> Axes:
    """The mesh axes over which the routed experts' gradients are summed: those that split the tokens but
    not the experts (their devices hold the same expert weights and compute on other tokens); axes of size 1
    are left out."""
    lay = self.expert_layout()
    expert_axes = parallel.all_axes(lay.gate_spec)
    token_axes = parallel.all_axes(lay.token_spec)
    return tuple(a for a in self.mesh.axis_names
                 if a in token_axes and a not in expert_axes and self.mesh.shape[a] > 1)

  @property
  def gradient_feedback(self) -> bool:
    """Whether that sum keeps an error-feedback residual (low-bit formats with it asked for)."""
    return self.gradient_compression in gradient_sync.LOW_BIT and self.parallel.gradient_error_feedback

  # --- Processes ----------------------------------------------------------------------------------------

  @property
  def process_count(self) -> int:
    """How many processes drive the mesh's devices (their `process_index`: hosts, or one per GPU)."""
    return len({d.process_index for d in self.mesh.devices.flat})

  @property
  def devices_per_process(self) -> int:
    return self.mesh.size // self.process_count

  def processes_per_ring(self, axes: Axes) -> int:
    """The most processes any group of devices over mesh `axes` (one ring of a collective over them) spans."""
    processes = np.vectorize(lambda d: d.process_index, otypes=[int])(self.mesh.devices)
    inner = [self.mesh.axis_names.index(a) for a in axes]
    outer = [i for i in range(processes.ndim) if i not in inner]
    rings = processes.transpose(outer + inner).reshape(-1, self.axis_size(axes))
    return max(len(set(ring)) for ring in rings)

  # --- Placement ----------------------------------------------------------------------------------------

  def axis_size(self, axes: Sequence[str]) -> int:
    return math.prod(self.mesh.shape[a] for a in axes)

  def activation_spec(self, logical: Sequence[str | None]) -> PartitionSpec:
    return logical_to_spec(logical, self.rules.activations)

  def param_spec(self, logical: Sequence[str | None]) -> PartitionSpec:
    """Where a parameter (and its gradient) is stored."""
    return logical_to_spec(logical, self.rules.params)

  def optimizer_spec(self, logical: Sequence[str | None]) -> PartitionSpec:
    return logical_to_spec(logical, self.rules.optimizer_rules())

  def weight_spec(self, logical: Sequence[str | None]) -> PartitionSpec:
    """A weight's spec inside a parallel op: as stored, except `embed`, which FSDP splits for storage only
    (the op needs it whole, so XLA all-gathers it over the axes `param_spec` has and this lacks)."""
    return self.param_spec([None if name == "embed" else name for name in logical])

  def activation_sharding(self, logical: Sequence[str | None]) -> NamedSharding:
    return NamedSharding(self.mesh, self.activation_spec(logical))

  @property
  def distributed_optimizer(self) -> bool:
    """Whether the train state's float32 parameters are a master copy apart from the weights the model
    computes with (`mesh.optimizer_storage`; training/master_weights.py)."""
    return self.optimizer_storage != "weights"

  def param_shardings(self, state: Any) -> Any:
    """NamedSharding of every variable of `state` (an nnx.State, maybe abstract) as the train state stores
    its float32 parameters: under the parameter rules, or the optimizer's under a distributed optimizer."""
    return self.optimizer_shardings(state) if self.distributed_optimizer else self.weight_shardings(state)

  def weight_shardings(self, state: Any) -> Any:
    """NamedSharding of every variable of `state` as the model computes with it: the parameter rules."""
    return named_shardings(state, self.mesh, self.rules.params)

  def optimizer_shardings(self, state: Any) -> Any:
    """Shardings for optimizer state shaped like the parameters in `state` (ZeRO-1 splits it further)."""
    return named_shardings(state, self.mesh, self.rules.optimizer_rules())

  def batch_sharding(self) -> NamedSharding:
    """Sharding of a [batch, seq] token array."""
    return self.activation_sharding(("act_batch", "act_seq"))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  # --- Layouts of the parallel ops ------------------------------------------------------------------------

  def projection_axes(self, weights_logical: Sequence[Sequence[str | None]]) -> tuple[Axes, Axes]:
    """(tensor-parallel axes, gathered axes) of a projection whose weights have these logical names: the
    axes that split the weights' units, and of those the ones that also split the residual stream's
    sequence, over which project_in gathers it and project_out scatters it back."""
    specs = [self.weight_spec(names) for names in weights_logical]
    tp_axes = tuple(dict.fromkeys(a for spec in specs for a in parallel.all_axes(spec)))
    seq_axes = parallel.dim_axes(self.activation_spec(STREAM_TOKENS), 1)
    return tp_axes, parallel.split_suffix(seq_axes, tp_axes, "tensor-parallel gather of the sequence")

  def expert_layout(self) -> ExpertLayout:
    token_spec = self.activation_spec(STREAM_TOKENS)
    gate_spec = self.weight_spec(("exp", "embed", "exp_mlp"))
    down_spec = self.weight_spec(("exp", "exp_mlp", "embed"))
    # The storage axes the op gathers over: those that split the tokens (storage over other axes, if any,
    # is GSPMD's to gather) and have more than one device. None under a compressed gradient sum, whose
    # replicas hold whole experts (Config refuses split storage with it).
    token_axes = parallel.all_axes(token_spec)
    weight_gather = tuple(a for a in parallel.dim_axes(self.param_spec(("exp", "embed", "exp_mlp")), 1)
                          if a in token_axes and self.mesh.shape[a] > 1)
    if self.gradient_compression != "none":
      weight_gather = ()
    with_d = lambda spec, dim: PartitionSpec(*[(weight_gather or None) if i == dim else entry
                                               for i, entry in enumerate([*spec, None, None, None][:3])])
    expert_axes, width_axes = parallel.dim_axes(gate_spec, 0), parallel.dim_axes(gate_spec, 2)
    token_dim, gather = 1, ()
    for dim in (1, 0):  # the sequence first: gathering it keeps every device's batch rows whole
      shared = parallel.split_suffix(parallel.dim_axes(token_spec, dim), width_axes,
                                     "expert-tensor-parallel gather of the tokens")
      if shared:
        token_dim, gather = dim, shared
        break
    return ExpertLayout(token_spec, gate_spec, down_spec, with_d(gate_spec, 1), with_d(down_spec, 2),
                        weight_gather, expert_axes, width_axes, token_dim, gather,
                        parallel.without(width_axes, gather), self.axis_size(expert_axes))

  def attention_axes(self) -> Axes:
    """The mesh axes that split the sequence inside attention."""
    return parallel.dim_axes(self.activation_spec(QUERY_AXES), 1)

  def sequence_order(self, seq_len: int) -> np.ndarray | None:
    """The order the sequence must be in for attention (zigzag over the devices that split it: every
    device gets an early and a late chunk, so causal work is balanced), or None when it is not split."""
    n = self.axis_size(self.attention_axes())
    return None if n == 1 else zigzag_order(seq_len, n)

  # --- Choices ------------------------------------------------------------------------------------------

  def attention(self, dtype=None, head_dim: int = 0) -> OpChoice:
    """How attention runs for q of `dtype` with heads of `head_dim` (None: not known, no kernel checked):
    the implementation (context_parallel.IMPLEMENTATIONS) and, as `kernel_backend`, tokamax's kernel that
    computes its blocks ("" for the einsum blocks; `attention_kernel`)."""
    axes = self.attention_axes()
    if not axes:
      implementation, detail = "local", "the sequence is whole on every device"
    else:
      kind = self.parallel.attention
      implementation = {"allgather": "allgather", "ring": self.tier.ring_attention, "ulysses": "ulysses"}[kind]
      detail = f"sequence over {describe_axes(self, axes)}"
    kernel, fallback = attention_kernel(self.parallel.attention_kernel, self.hardware)
    if kernel and dtype is None:
      kernel = ""
    elif kernel and (why := attention_kernels.unsupported(kernel, dtype, head_dim)):
      kernel, fallback = "", f"{why}: the einsum blocks run"
    if kernel:
      detail += "; tokamax flash attention"
    elif axes and self.tier.fused_kernels and not fallback:
      fallback = "no fused attention kernel: the xla tier's"
    return OpChoice(implementation, detail, kernel_backend=kernel, fallback=fallback)

  def project_in(self, gather: Axes, rows: int, d: int, width: int, dtype) -> OpChoice:
    """How a column-parallel projection x [rows, D] @ [D, width] (per device, before the gather) runs."""
    if not gather:
      return OpChoice("local")
    return self._gathered_projection(
        "project_in (all-gather GEMM)", allgather_matmul.unsupported(rows, d, width, dtype, self.kernel_tiles),
        f"sequence all-gathered over {describe_axes(self, gather)}", gather)

  def project_out(self, scatter: Axes, rows: int, contraction: int, d: int, dtype) -> OpChoice:
    """How a row-parallel projection of [rows, contraction] blocks @ [contraction, D] runs (rows: of one
    destination block of the reduce-scatter)."""
    if not scatter:
      return OpChoice("local")
    return self._gathered_projection(
        "project_out (GEMM reduce-scatter)",
        matmul_reducescatter.unsupported(rows, contraction, d, dtype, self.kernel_tiles),
        f"sequence reduce-scattered over {describe_axes(self, scatter)}", scatter)

  def expert_ffn(self, ep: int, d: int, f: int, dtype) -> ExpertChoice:
    """How the routed experts run for tokens of width d, an expert width of f per device, over ep devices."""
    gemm_name, kernels, gemm_fallback = grouped_gemm_for(self.grouped_gemm, self.hardware, dtype, d, f,
                                                         self.parallel.gemm_kernels, self.parallel.kernel_table)
    gemm = dict(grouped_gemm=gemm_name, block_rows=self.gemm_block_rows, gemm_kernels=kernels)
    if ep == 1:
      unused = [f"parallel.{name}={getattr(self.parallel, name)!r}" for name in EXCHANGE_FORMAT_FIELDS
                if getattr(self.parallel, name) != "auto"]
      if self.parallel.moe_buffer_factor:
        unused.append(f"parallel.moe_buffer_factor={self.parallel.moe_buffer_factor!r}")
      if unused:  # said, not an error: a config may set them for the layouts that exchange tokens
        gemm_fallback = "; ".join(filter(None, (gemm_fallback, f"{', '.join(unused)} unused: no tokens are "
                                                               "exchanged (one device holds every expert)")))
      return ExpertChoice("local", f"every expert here; grouped GEMM {gemm_name}", fallback=gemm_fallback,
                          **gemm)
    formats = self._exchange_formats()
    expert_axes = self.expert_layout().expert_axes
    over = describe_axes(self, expert_axes)  # the token exchange's devices
    fused_fallback = ""
    if self.tier.fused_kernels and (fused_fallback := _formats_unsupported_by_kernels(formats)) is None:
      tiles = self.kernel_tiles
      backend, fused_fallback = self._fused_kernels(
          "MoE dispatch/return",
          moe_dispatch_gemm.unsupported(d, [f, f], dtype, tiles) or moe_gemm_return.unsupported([f], d, dtype, tiles),
          expert_axes)
      if backend:
        gradient = self.parallel.moe_swiglu_gradient
        unused = (f"parallel.moe_buffer_factor={self.parallel.moe_buffer_factor!r} unused: the fused kernels' "
                  "tile plan sizes their buffers" if self.parallel.moe_buffer_factor else "")
        return ExpertChoice("fused", f"dispatch + grouped GEMM + SwiGLU ({gradient} gate/up for its gradient), "
                            f"grouped GEMM + return over {over}{_describe_tiles(tiles, backend, sender=True)}",
                            kernel_backend=backend, swiglu_gradient=gradient, tiles=tiles, fallback=unused)
    chunks = self.parallel.moe_chunks if self.tier.moe_pipeline else 1
    exchange = "padded_all_to_all" if self.hardware.platform == "cpu" else "ragged_all_to_all"
    detail = f"{chunks} chunk(s); tokens by {exchange} over {over}"
    factor = self.parallel.moe_buffer_factor
    if factor:
      detail += (f"; receive buffers for {factor:g}x balanced routing (an overflowing step runs again with "
                 "worst-case buffers)")
    for name, (forward, backward) in zip(("dispatch", "combine"), formats):
      if not exchange_formats.is_plain(forward, backward):
        forward, backward = (f.replace("auto", "the activation dtype") for f in (forward, backward))
        detail += f"; {name} in {forward} (its gradient in {backward})"
    return ExpertChoice("all_to_all", f"{detail}; grouped GEMM {gemm_name}",
                        fallback="; ".join(filter(None, (fused_fallback, gemm_fallback))),
                        exchange=exchange, chunks=chunks, dispatch_formats=formats[0], combine_formats=formats[1],
                        buffer_factor=factor, **gemm)

  def _exchange_formats(self) -> tuple[tuple[str, str], tuple[str, str]]:
    """((dispatch, its gradient), (combine, its gradient)) wire formats. Raises ConfigError for float8 on a
    GPU without float8 conversions in hardware (before Ada/Hopper, compute capability 8.9)."""
    p = self.parallel
    grad = p.moe_exchange_grad_dtype
    formats = ((p.moe_dispatch_dtype, grad), (p.moe_combine_dtype, grad))
    hw = self.hardware
    for field in EXCHANGE_FORMAT_FIELDS:
      if getattr(p, field) == "float8_e4m3fn" and hw.platform == "gpu":
        major, _, minor = hw.compute_capability.partition(".")
        if not (major.isdigit() and minor.isdigit()) or (int(major), int(minor)) < (8, 9):
          raise ConfigError(f"parallel.{field}", "float8_e4m3fn", (
              f"float8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
              f"{hw.describe()} has none. Allowed here: 'auto' or 'bfloat16'"))
    return formats

  def _gathered_projection(self, op: str, unsupported: str | None, detail: str, axes: Axes) -> OpChoice:
    fallback = ""
    if self.tier.fused_kernels:
      backend, fallback = self._fused_kernels(op, unsupported, axes)
      if backend:
        tiles = self.kernel_tiles
        return OpChoice("fused", detail + _describe_tiles(tiles, backend), kernel_backend=backend, tiles=tiles)
    return OpChoice(self.tier.gathered_projection, detail, fallback=fallback)

  def _fused_kernels(self, op: str, unsupported: str | None, axes: Axes) -> tuple[str, str]:
    """(kernel backend, "") when the fused kernels of `op`, communicating over the mesh `axes`, run here,
    else ("", why not); `unsupported` is the kernels' own verdict on the call's shapes. A reason is logged
    once per op; under `parallel.kernel_backend="mosaic_gpu"` it is a ConfigError instead."""
    backend = FUSED_KERNEL_BACKENDS[self.parallel.kernel_backend]
    if backend == "collectives":
      return backend, ""
    hw = self.hardware
    if hw.platform != "gpu":
      reason = f"no fused kernels on {hw.platform} (Mosaic GPU needs GPUs)"
    elif not hw.compute_capability.startswith("9."):  # WGMMA and TMA as these kernels use them: Hopper
      reason = f"the kernels are written for Hopper (compute capability 9.x), not {hw.compute_capability or 'unknown'}"
    elif hw.num_sms < 1:
      reason = "the GPU does not report its number of SMs (the kernels launch one block on each)"
    elif not np.array_equal(self.mesh.device_ids.ravel(), np.arange(self.mesh.size)):
      # Mosaic GPU addresses peers by their position in the mesh, which must be the device ids in order;
      # sharding/mesh.py places `tensor` inside `sequence`, which reorders them when both are split.
      reason = ("Mosaic GPU's communicating kernels need a mesh whose device ids are in row-major order, and "
                "this one places tensor inside sequence (both split)")
    elif (processes := self.processes_per_ring(axes)) > 1:
      reason = (f"its ring over {describe_axes(self, axes)} spans {processes} processes "
                f"({self.devices_per_process} device(s) each), and Mosaic GPU's communicating kernels need one "
                "process to drive every GPU of a ring (they store into peers' memory; jax has no NVSHMEM path): "
                f"{ONE_PROCESS_PER_NODE}")
    else:
      reason = unsupported
    if reason is None:
      return backend, ""
    if self.parallel.kernel_backend == "mosaic_gpu":
      raise ConfigError("parallel.kernel_backend", "mosaic_gpu", (
          f"a layout where the fused kernels run; {op} cannot: {reason}. 'auto' runs the xla tier's "
          "implementation where a kernel cannot"))
    if (op, reason) not in _FALLBACKS_LOGGED:
      _FALLBACKS_LOGGED.add((op, reason))
      logging.warning("parallel.impl=%r: %s runs its unfused implementation: %s", self.parallel.impl, op, reason)
    return "", reason

  # --- Reporting ----------------------------------------------------------------------------------------

  def to_json(self) -> dict[str, Any]:
    return {
        "preset": self.preset, "weight_storage": self.weight_storage, "expert_axes": self.expert_axes,
        "expert_width_axes": self.expert_width_axes, "optimizer_storage": self.optimizer_storage,
        "mesh": dict(self.mesh.shape),
        "processes": self.process_count, "devices_per_process": self.devices_per_process,
        "hardware": dataclasses.asdict(self.hardware),
        "parallel": dataclasses.asdict(self.parallel), "grouped_gemm": self.grouped_gemm,
        "ops": {name: {k: v for k, v in dataclasses.asdict(choice).items() if v not in ("", 0, None)}
                for name, choice in self.ops.items()},
    }

  def table(self) -> str:
    """A short table of the plan: one line per op, then the fallbacks with their reasons."""
    mesh = " ".join(f"{a}={s}" for a, s in self.mesh.shape.items())
    placement = []
    if self.weight_storage != "preset":
      placement.append(f"weights stored split over {_in_words(self.weight_storage)}")
    if self.distributed_optimizer:
      placement.append(f"float32 master weights and optimizer state split over {_in_words(self.optimizer_storage)}")
    if (self.expert_axes, self.expert_width_axes) != ("preset", "preset"):
      lay = self.expert_layout()
      width = f", their width over {' x '.join(lay.width_axes)}" if lay.width_axes else ", each whole"
      placement.append(f"experts folded over {' x '.join(lay.expert_axes) or 'no axis'}{width}")
    storage = f" ({'; '.join(placement)})" if placement else ""
    processes = (f" in {self.process_count} processes of {self.devices_per_process}" if self.process_count > 1
                 else " in one process")
    lines = [f"parallel plan: preset {self.preset}{storage}, tier {self.parallel.impl}, mesh {mesh} of "
             f"{self.mesh.size} {self.hardware.describe()} device(s){processes}"]
    chosen = {name: choice.implementation + (f" ({choice.kernel_backend})" if choice.kernel_backend else "")
              for name, choice in self.ops.items()}
    names, implementations = (max(map(len, column), default=0) for column in (chosen, chosen.values()))
    for name, choice in self.ops.items():
      lines.append(f"  {name:{names}s}  {chosen[name]:{implementations}s}  {choice.detail}".rstrip())
    for name, choice in self.ops.items():
      for form, candidate, source in _kernel_sources(choice):
        lines.append(f"  {name} {form}: {candidate.name}" + (f" ({source})" if source else ""))
    for name, choice in self.ops.items():
      if choice.fallback:
        lines.append(f"  {name}: not the {self.parallel.impl} tier's first choice: {choice.fallback}")
    return "\n".join(lines)

  def write_json(self, path) -> None:
    with open(path, "w") as f:
      json.dump(self.to_json(), f, indent=1)
      f.write("\n")


_FALLBACKS_LOGGED: set[tuple[str, str]] = set()


def axis_sizes(mesh: Mesh) -> dict[str, int]:
  """The size of every mesh axis of the config (1 for an axis a hand-made mesh leaves out)."""
  return {a: mesh.shape.get(a, 1) for a in MESH_AXES}


def _describe_tiles(tiles: mosaic_tiles.Tiles, backend: str, sender: bool = False) -> str:
  """How the Mosaic GPU kernels' thread blocks work, for an op's detail (nothing for the default, or where
  the kernels' plain-collective versions run: only their MoE tile plan takes the tiles' height). `sender`:
  the op's dispatch kernel puts to peers from a sender warpgroup (gpu_warp_specialized.py)."""
  if tiles.consumers == 1 or backend != "mosaic_gpu":
    return ""
  senders = "; the dispatch's puts from a sender warpgroup" if sender else ""
  return f"; warp-specialised {tiles.block_m} x {tiles.block_n} tiles ({tiles.consumers} consumer warpgroups{senders})"


def _kernel_sources(choice: OpChoice):
  """(form, candidate, where its choice came from) of an op's grouped-GEMM kernels, if it has any."""
  kernels = getattr(choice, "gemm_kernels", None)
  if kernels is None:
    return []
  return [(form, candidate, source) for form, candidate, source in
          zip(("forward", "input gradient", "weight gradient"), kernels.candidates(), kernels.sources)]


def _in_words(storage: str) -> str:
  """What a storage choice (`weight_storage`, `optimizer_storage`) adds, in words: "data" or "every axis"."""
  return "every axis" if storage == "all" else " x ".join(rules.STORAGE_AXES[storage])
