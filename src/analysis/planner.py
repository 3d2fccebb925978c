"""The planner: the best layout for a model on N GPUs, from the cost model, without the GPUs.

A layout is everything a user picks beside the model: the mesh axis sizes, the preset, the mesh axes of
the MoE layers' experts (`mesh.expert_axes`: MoE parallel folding, `foldings`), where weights are stored
(`mesh.weight_storage`), where the optimizer state is (`mesh.optimizer_storage`: the distributed
optimizer), the tier, the MoE receive buffers (`parallel.moe_buffer_factor`: the dropless worst case, or
capped with a dropless fallback step whose micro-batches are the fewest that fit its worst-case buffers),
the number of micro-batches, remat, the xla tier's MoE pipeline depth (for the fastest candidates) and
(when allowed) the lossy compression options.
`search` enumerates the layouts the config validation accepts, builds each one's parallel plan on a
deviceless mesh of the GPUs (the same plan a run and a compile use), rejects those whose modelled memory
does not fit the allocator's share of the GPU (train.gpu_memory_fraction, runtime/gpu_memory.py, less a
margin for what the memory model leaves out), predicts the step time of the
rest (step_time.py) and ranks them fastest first. For each (mesh, preset, experts' axes, storage,
optimizer storage, tier, remat) only the fewest micro-batches that fit is kept: more micro-batches never
make the modelled step faster (the same FLOPs, and per-micro-batch collectives repeat).

Process layouts (PROCESS_LAYOUTS): `search` plans with one process per node; `best_with_one_process_per_gpu`
gives the best layout a run with one process per GPU can have (its fused kernels' rings across processes
falling back), for the clusters and launchers that start one per GPU.

Everything here is modelled. `experiments.plan --verify=K` compiles the top K deviceless and prints the
compiled figures beside these (experiments/benchmarks/RESULTS.md has the comparison).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import itertools
import math
from collections.abc import Iterator

from absl import logging

from meshmoe.analysis import cost_memory, deviceless, step_time
from meshmoe.analysis.gpus import GpuSpec
from meshmoe.config import (IMPLS, MESH_AXES, PRESETS, REMAT_POLICIES, Config, ConfigError, MeshConfig,
                            resolve_mesh_sizes)
from meshmoe.sharding import rules
from meshmoe.sharding.mesh import make_mesh
from meshmoe.runtime import gpu_memory
from meshmoe.sharding.plan import ParallelPlan, process_layout

TIERS = IMPLS  # every tier (`parallel.impl`) is a candidate
# Presets whose placement ignores the expert, tensor and sequence axes (every device a data replica):
# one mesh shape each.
_DATA_PARALLEL_PRESETS = ("dp", "fsdp", "zero1")


@dataclasses.dataclass(frozen=True)
class Layout:
  """One choice of everything the planner searches (module docstring)."""

  mesh: tuple[int, int, int, int]  # sizes of MESH_AXES
  preset: str
  weight_storage: str
  impl: str
  remat: str
  grad_accum_steps: int
  gradient_compression: str = "none"
  exchange_dtype: str = "auto"  # the MoE token exchanges' wire format, both ways and their gradients
  expert_axes: str = "preset"  # MoE parallel folding (`mesh.expert_axes`; the width axes stay "preset")
  optimizer_storage: str = "weights"  # the distributed optimizer (`mesh.optimizer_storage`)
  moe_chunks: int = 2  # the xla tier's MoE pipeline (`parallel.moe_chunks`; ParallelConfig's default)
  moe_buffer_factor: float = 0.0  # capped MoE receive buffers (`parallel.moe_buffer_factor`; 0: worst case)
  fallback_accum_steps: int = 0  # their dropless fallback's micro-batches (0: grad_accum_steps)

  @classmethod
  def of(cls, config: Config, num_gpus: int) -> Layout:
    """The layout a config already has (its mesh's -1 axis filled for `num_gpus`)."""
    sizes = resolve_mesh_sizes(config.validate(num_gpus).mesh, num_gpus)
    p = config.parallel
    return cls(tuple(sizes[a] for a in MESH_AXES), config.mesh.preset, config.mesh.weight_storage, p.impl,
               config.model.remat, config.train.grad_accum_steps, p.gradient_compression, p.moe_dispatch_dtype,
               config.mesh.expert_axes, config.mesh.optimizer_storage, p.moe_chunks, p.moe_buffer_factor,
               p.moe_fallback_grad_accum_steps)

  def apply(self, config: Config) -> Config:
    """A copy of `config` with this layout."""
    config = copy.deepcopy(config)
    config.mesh = MeshConfig(**dict(zip(MESH_AXES, self.mesh)), preset=self.preset,
                             weight_storage=self.weight_storage, expert_axes=self.expert_axes,
                             expert_width_axes=config.mesh.expert_width_axes,
                             optimizer_storage=self.optimizer_storage)
    config.parallel.impl = self.impl
    config.parallel.moe_chunks = self.moe_chunks
    config.parallel.moe_buffer_factor = self.moe_buffer_factor
    config.parallel.moe_fallback_grad_accum_steps = self.fallback_accum_steps
    config.model.remat = self.remat
    config.train.grad_accum_steps = self.grad_accum_steps
    config.parallel.gradient_compression = self.gradient_compression
    for field in ("moe_dispatch_dtype", "moe_combine_dtype", "moe_exchange_grad_dtype"):
      setattr(config.parallel, field, self.exchange_dtype)
    return config

  def overrides(self) -> str:
    """The --config overrides that select this layout."""
    flags = [f"--config.mesh.{axis}={size}" for axis, size in zip(MESH_AXES, self.mesh)]
    flags += [f"--config.mesh.preset={self.preset}", f"--config.mesh.weight_storage={self.weight_storage}",
              f"--config.parallel.impl={self.impl}", f"--config.model.remat={self.remat}",
              f"--config.train.grad_accum_steps={self.grad_accum_steps}"]
    if self.expert_axes != "preset":
      flags.append(f"--config.mesh.expert_axes={self.expert_axes}")
    if self.optimizer_storage != "weights":
      flags.append(f"--config.mesh.optimizer_storage={self.optimizer_storage}")
    if self.impl == "xla":
      flags.append(f"--config.parallel.moe_chunks={self.moe_chunks}")
    if self.moe_buffer_factor:
      flags.append(f"--config.parallel.moe_buffer_factor={self.moe_buffer_factor:g}")
      if self.fallback_accum_steps:
        flags.append(f"--config.parallel.moe_fallback_grad_accum_steps={self.fallback_accum_steps}")
    if self.gradient_compression != "none":
      flags.append(f"--config.parallel.gradient_compression={self.gradient_compression}")
    if self.exchange_dtype != "auto":
      flags += [f"--config.parallel.{f}={self.exchange_dtype}"
                for f in ("moe_dispatch_dtype", "moe_combine_dtype", "moe_exchange_grad_dtype")]
    return " ".join(flags)

  def describe(self) -> str:
    mesh = "x".join(map(str, self.mesh))
    extra = "".join(f" {v}" for v in (self.gradient_compression, self.exchange_dtype) if v not in ("none", "auto"))
    experts = "preset" if self.expert_axes == "preset" else ".".join(a[0] for a in self.expert_axes.split(","))
    tier = f"{self.impl} {self.moe_chunks}ch" if self.impl == "xla" else self.impl
    buffers = (f"{self.moe_buffer_factor:g}x/{self.fallback_accum_steps or self.grad_accum_steps}"
               if self.moe_buffer_factor else "worst")
    return (f"{mesh:>11s} {self.preset:9s} {experts:7s} {self.weight_storage:7s} {self.optimizer_storage:9s} "
            f"{tier:9s} {buffers:8s} "
            f"{self.grad_accum_steps:4d} {self.remat:5s}{extra}")


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A layout with its modelled memory and, where it fits, its predicted step."""

  layout: Layout
  memory_bytes: float  # the cost model's peak per device
  fits: bool
  time: step_time.StepTime | None = None
  state_bytes: float = 0.0  # of memory_bytes: parameters, gradients and optimizer state (more GPUs split them)

  @classmethod
  def of(cls, layout: Layout, memory: cost_memory.MemoryCost, fits: bool, time=None) -> Candidate:
    return cls(layout, memory.total, fits, time, memory.params + memory.gradients + memory.optimizer)


@dataclasses.dataclass
class Search:
  """What `search` found: the fitting candidates fastest first, and what it rejected."""

  gpu: GpuSpec
  num_gpus: int
  capacity_bytes: float  # the allocator's share of device memory (train.gpu_memory_fraction) less the margin
  tokens_per_step: int
  ranked: list[Candidate]
  invalid: collections.Counter  # reason -> layouts the config validation refused
  too_big: list[Candidate]  # the fewest-bytes layouts that did not fit (for the error message)
  evaluated: int
  equivalent: int = 0  # fitting layouts left out as indistinguishable from a ranked one


def mesh_shapes(config: Config, num_gpus: int, gpus_per_node: int, preset: str) -> Iterator[tuple[int, ...]]:
  """Mesh sizes (MESH_AXES order) worth trying for `preset`: `tensor` within a node (its collectives are
  in every layer), `expert` dividing the experts, and no axis a preset leaves unused (it would only
  repeat another shape's placement)."""
  if preset in _DATA_PARALLEL_PRESETS:
    yield (num_gpus, 1, 1, 1)
    return
  divisors = [d for d in range(1, num_gpus + 1) if num_gpus % d == 0]
  experts = config.model.moe.num_experts
  for expert, tensor, sequence in itertools.product(divisors, divisors, divisors):
    if num_gpus % (expert * tensor * sequence) or experts % expert or gpus_per_node % tensor:
      continue
    if preset == "ep" and (tensor > 1 or sequence > 1 or expert == 1):
      continue
    yield (num_gpus // (expert * tensor * sequence), expert, tensor, sequence)


def layouts(config: Config, num_gpus: int, gpus_per_node: int, allow_compression: bool = False,
            presets=PRESETS, tiers=TIERS, remats=REMAT_POLICIES) -> Iterator[tuple[Layout, ...]]:
  """Groups of layouts that differ only in their micro-batches, fewest first (`search` keeps the first
  that fits)."""
  batch = config.train.global_batch_size
  accums = [a for a in range(1, batch + 1) if batch % a == 0]
  for preset in presets:
    for mesh in mesh_shapes(config, num_gpus, gpus_per_node, preset):
      for storage, experts, optimizer in itertools.product(_storages(preset, mesh), foldings(config, preset, mesh),
                                                           _optimizer_storages(mesh)):
        for impl, remat, (compression, exchange), factor in itertools.product(
            tiers, remats, _compressions(config, allow_compression, optimizer),
            _buffer_factors(config, preset, mesh, experts)):
          yield tuple(Layout(mesh, preset, storage, impl, remat, a, compression, exchange, experts, optimizer,
                             config.parallel.moe_chunks, factor) for a in accums)


def foldings(config: Config, preset: str, mesh: tuple[int, ...]) -> list[str]:
  """The `mesh.expert_axes` worth trying for `preset` on `mesh`: its own ("preset"), and every set of more
  axes that split the tokens, each of more than one device, whose devices divide the experts (MoE parallel
  folding: sharding/rules.py). Folding only adds axes: fewer would replicate experts the preset splits."""
  table, sizes = rules.get_preset(preset), dict(zip(MESH_AXES, mesh))
  own = [a for a in table.params.get("exp", ()) if sizes[a] > 1]
  if not own or config.model.num_layers == config.model.num_dense_layers:
    return ["preset"]
  token_axes = rules.split_token_axes(table)
  more = [a for a in MESH_AXES if a not in own and a in token_axes and sizes[a] > 1]
  found = ["preset"]
  for count in range(1, len(more) + 1):
    for extra in itertools.combinations(more, count):
      axes = [a for a in MESH_AXES if a in own or a in extra]
      if config.model.moe.num_experts % math.prod(sizes[a] for a in axes) == 0:
        found.append(",".join(axes))
  return found


# The capped MoE receive buffers the planner tries where the config asks for none: twice the rows of
# balanced routing, MaxText's default ragged buffer factor (where it drops what overflows; here an
# overflowing step runs again with worst-case buffers, a cost the step-time model leaves out).
PLANNED_BUFFER_FACTOR = 2.0


def _buffer_factors(config: Config, preset: str, mesh: tuple[int, ...], experts: str) -> list[float]:
  """`parallel.moe_buffer_factor`s to try: worst-case buffers, and capped ones (the config's factor, else
  PLANNED_BUFFER_FACTOR) where they hold fewer rows than the worst case: f x K < ep x min(K, E/ep)."""
  moe = config.model.moe
  if config.model.num_layers == config.model.num_dense_layers:
    return [0.0]
  sizes = dict(zip(MESH_AXES, mesh))
  axes = rules.get_preset(preset).params.get("exp", ()) if experts == "preset" else experts.split(",")
  ep = math.prod(sizes[a] for a in axes)
  factor = config.parallel.moe_buffer_factor or PLANNED_BUFFER_FACTOR
  if ep <= 1 or moe.num_experts % ep or factor * moe.top_k >= ep * min(moe.top_k, moe.num_experts // ep):
    return [0.0]
  return [0.0, factor]


def _storages(preset: str, mesh: tuple[int, ...]) -> list[str]:
  """The weight storages that place weights differently from each other on this mesh."""
  if preset in _DATA_PARALLEL_PRESETS:  # dp with weights split everywhere is fsdp: one storage each
    return ["preset"]
  storages = ["preset"]
  if mesh[0] > 1:
    storages.append("data")
  if math.prod(mesh[1:]) > 1:
    storages.append("all")
  return storages


def _optimizer_storages(mesh: tuple[int, ...]) -> list[str]:
  """The optimizer storages tried: as the weights, and the distributed optimizer over every axis (over
  `data` alone it splits less for the same collectives per micro-batch, so it is left out)."""
  return ["weights", "all"] if math.prod(mesh) > 1 else ["weights"]


def _compressions(config: Config, allowed: bool, optimizer_storage: str = "weights") -> list[tuple[str, str]]:
  """(gradient compression, exchange format) pairs: exact only, unless lossy options are allowed (the
  distributed optimizer sums gradients in float32: no compression with it)."""
  if not allowed or config.model.num_layers == config.model.num_dense_layers:
    return [("none", "auto")]
  if optimizer_storage != "weights":
    return [("none", "auto"), ("none", "float8_e4m3fn")]
  return [("none", "auto"), ("int8", "auto"), ("none", "float8_e4m3fn"), ("int8", "float8_e4m3fn")]


def search(config: Config, num_gpus: int, gpu: GpuSpec, gpus_per_node: int | None = None,
           efficiency: float = 0.5, memory_margin: float = 0.05, allow_compression: bool = False,
           stop_at_first_fit: bool = False, **choices) -> Search:
  """Every layout of `config` on `num_gpus` GPUs, ranked by predicted step time (module docstring).
  `choices` narrows the search (presets=, tiers=, remats=); `stop_at_first_fit` only asks whether any fits."""
  gpus_per_node = gpus_per_node or gpu.gpus_per_node
  devices = gpu_devices(gpu, num_gpus, gpus_per_node)
  # What JAX's allocator holds of each GPU (train.gpu_memory_fraction), less the margin for what the memory
  # model leaves out.
  capacity = gpu_memory.usable_bytes(gpu.memory_bytes, config.train.gpu_memory_fraction) * (1 - memory_margin)
  ranked, too_big, invalid, evaluated = [], [], collections.Counter(), 0
  dropless_fit = None  # the fewest micro-batches the previous worst-case group fits with (None: none)
  with _quiet_fallbacks():  # the plans of a tier whose kernels cannot run say so once each; the table shows it
    for group in layouts(config, num_gpus, gpus_per_node, allow_compression, **choices):
      evaluated += len(group)
      candidate = _fewest_micro_batches(config, group, devices, capacity, gpu, efficiency, invalid)
      if not group[0].moe_buffer_factor:
        dropless_fit = candidate.layout.grad_accum_steps if candidate is not None and candidate.fits else None
      elif candidate is not None and candidate.fits:
        # Capped buffers: their fallback is the worst-case twin just judged (`layouts` yields it first), in the
        # fewest micro-batches that fit it, and no fewer than the capped step's.
        if dropless_fit is None:
          invalid["parallel.moe_fallback_grad_accum_steps"] += 1
          continue
        accum = max(dropless_fit, candidate.layout.grad_accum_steps)
        fallback = 0 if accum == candidate.layout.grad_accum_steps else accum
        candidate = dataclasses.replace(candidate, layout=dataclasses.replace(candidate.layout,
                                                                              fallback_accum_steps=fallback))
      if candidate is None:
        continue
      (ranked if candidate.fits else too_big).append(candidate)
      if stop_at_first_fit and candidate.fits:
        break
  ranked.sort(key=lambda c: c.time.step_s)  # stable: of equal predictions the first enumerated stays first
  if not stop_at_first_fit:
    ranked = _with_moe_chunks(config, ranked, devices, capacity, gpu, efficiency)
  too_big.sort(key=lambda c: c.memory_bytes)
  distinct = _distinct(ranked)
  return Search(gpu, num_gpus, capacity, config.train.global_batch_size * config.train.seq_len, distinct, invalid,
                too_big[:5], evaluated, len(ranked) - len(distinct))


def _fewest_micro_batches(config, group, devices, capacity, gpu, efficiency, invalid) -> Candidate | None:
  """Of layouts that differ only in micro-batches (fewest first), the first that fits with its predicted
  step; else the one with the most (the least memory) as not fitting; None when the config refuses all.
  Plans are built only for the micro-batch counts the bisection probes (a refused one counts as not
  fitting), after the counts that cannot split the batch over the mesh are dropped."""
  split = math.prod(dict(zip(MESH_AXES, group[0].mesh))[a]
                    for a in rules.get_preset(group[0].preset).activations.get("act_batch", ()))
  batch = config.train.global_batch_size
  splittable = [layout for layout in group if batch // layout.grad_accum_steps % split == 0]
  invalid["train.global_batch_size"] += len(group) - len(splittable)
  group = splittable
  if not group:
    return None

  @functools.cache
  def judged(i: int):  # (MemoryCost, config, plan), or None where the config validation refuses it
    try:
      layout_config = group[i].apply(config)
      plan = build_plan(layout_config, devices)
    except ConfigError as error:
      invalid[error.field] += 1
      return None
    return cost_memory.memory_per_device(layout_config, plan), layout_config, plan

  fits = lambda i: judged(i) is not None and judged(i)[0].total <= capacity
  last = len(group) - 1
  if not fits(last):  # not even with the most micro-batches
    return None if judged(last) is None else Candidate.of(group[last], judged(last)[0], False)
  low, high = 0, last  # memory falls as micro-batches grow: the fewest that fit, by bisection
  while low < high:
    middle = (low + high) // 2
    low, high = (low, middle) if fits(middle) else (middle + 1, high)
  memory, layout_config, plan = judged(high)
  return Candidate.of(group[high], memory, True, step_time.predict(layout_config, plan, gpu, efficiency))


# The xla tier's MoE pipeline depths the planner tries (parallel.moe_chunks), and the fewest rows a chunk
# gives each of a device's experts under balanced routing: the step-time model times neither collective
# latency nor a GEMM's loss of efficiency on few rows, so without a floor it would always pick the most
# chunks. 1024 rows per expert is what the kernel table's rows measured (sharding/gpu_kernel_table.json).
MOE_CHUNKS = (1, 2, 4, 8)
MIN_CHUNK_ROWS_PER_EXPERT = 1024
# How many of the fastest candidates get their MoE pipeline depth searched: the depth changes neither
# FLOPs nor the memory model's figure, only how much of the exchanges hides, so it reorders the front of
# the ranking, not which layouts fit.
_CHUNK_SEARCH_TOP = 32


def _with_moe_chunks(config, ranked, devices, capacity, gpu, efficiency) -> list[Candidate]:
  """`ranked` with each of its fastest xla-tier candidates whose MoE exchanges tokens tried at every depth of
  MOE_CHUNKS that leaves a chunk MIN_CHUNK_ROWS_PER_EXPERT rows per local expert (a candidate's own depth
  is the config's), fastest first."""
  tried, found = set(), list(ranked)
  for candidate in ranked[:_CHUNK_SEARCH_TOP]:
    layout = candidate.layout
    if layout.impl != "xla":
      continue
    for chunks in MOE_CHUNKS:
      variant = dataclasses.replace(layout, moe_chunks=chunks)
      if chunks == layout.moe_chunks or variant in tried:
        continue
      tried.add(variant)
      variant_config = variant.apply(config)
      plan = build_plan(variant_config, devices)
      choice = plan.ops.get("moe")
      if choice is None or choice.implementation != "all_to_all" or choice.chunks != chunks:
        break  # no pipelined exchange: the depth changes nothing
      moe = config.model.moe
      rows = cost_memory.moe_tokens_per_device(variant_config, plan) * moe.top_k * plan.expert_layout().ep / moe.num_experts
      if rows / chunks < MIN_CHUNK_ROWS_PER_EXPERT:
        continue
      memory = cost_memory.memory_per_device(variant_config, plan)
      if memory.total <= capacity:
        found.append(Candidate.of(variant, memory, True, step_time.predict(variant_config, plan, gpu, efficiency)))
  return sorted(found, key=lambda c: c.time.step_s)


@contextlib.contextmanager
def _quiet_fallbacks():
  level = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    yield
  finally:
    logging.set_verbosity(level)


def _distinct(ranked: list[Candidate]) -> list[Candidate]:
  """The candidates less those the model cannot tell from an earlier one: the same mesh, micro-batches and
  remat with the same memory and step time (e.g. a tier whose choices all fall back to another's, or two
  presets that place everything alike on this mesh). The simplest, enumerated first, stays."""
  seen, distinct = set(), []
  for c in ranked:
    key = (c.layout.mesh, c.layout.grad_accum_steps, c.layout.remat, round(c.memory_bytes / 1e6),
           round(c.time.step_s * 1e6))
    if key not in seen:
      seen.add(key)
      distinct.append(c)
  return distinct


def gpu_devices(gpu: GpuSpec, num_gpus: int, gpus_per_node: int):
  """Deviceless devices of `gpu`, `gpus_per_node` to a host (a node)."""
  hosts = max(1, num_gpus // gpus_per_node)
  if num_gpus % hosts:
    raise ValueError(f"{num_gpus} GPUs do not fill nodes of {gpus_per_node}")
  return deviceless.gpu_devices(num_gpus, gpu.target, hosts)


def build_plan(config: Config, devices) -> ParallelPlan:
  """The parallel plan a run of `config` would build on `devices`; ConfigError where the layout is invalid."""
  config.validate(len(devices))
  return ParallelPlan.build(config, make_mesh(config.mesh, devices))


def evaluate(config: Config, layout: Layout, found: Search, gpus_per_node: int | None = None,
             efficiency: float = 0.5, processes: str = "node") -> Candidate:
  """One given layout judged as `search` judged its candidates (ConfigError where it is invalid), its
  devices driven by one process per node or, `processes="gpu"`, one per GPU (PROCESS_LAYOUTS)."""
  layout_config = layout.apply(config)
  per_node = gpus_per_node or found.gpu.gpus_per_node
  if processes not in PROCESS_LAYOUTS:
    raise ValueError(f"processes={processes!r}; known: {', '.join(PROCESS_LAYOUTS)}")
  devices = (gpu_devices(found.gpu, found.num_gpus, per_node) if processes == "node"
             else deviceless.gpu_devices(found.num_gpus, found.gpu.target, found.num_gpus))
  timing_nodes = None if processes == "node" else per_node  # the links a process per GPU still shares
  plan = build_plan(layout_config, devices)
  memory = cost_memory.memory_per_device(layout_config, plan)
  if memory.total > found.capacity_bytes:
    return Candidate.of(layout, memory, False)
  if plan.caps_receive_buffers:  # its dropless fallback must fit too
    fallback = dataclasses.replace(layout, moe_buffer_factor=0.0, fallback_accum_steps=0,
                                   grad_accum_steps=layout.fallback_accum_steps or layout.grad_accum_steps)
    fallback_config = fallback.apply(config)
    if cost_memory.memory_per_device(fallback_config, build_plan(fallback_config, devices)).total > found.capacity_bytes:
      return Candidate.of(layout, memory, False)
  return Candidate.of(layout, memory, True, step_time.predict(layout_config, plan, found.gpu, efficiency,
                                                               gpus_per_node=timing_nodes))


# The process layouts the planner judges: one process per node (what `search` plans with; every device of a
# node in one process, so the fused kernels run wherever their ring stays in a node) and one per GPU (each
# GPU its own process, as experiments/slurm/train.sbatch starts a config that runs no fused kernel).
PROCESS_LAYOUTS = ("node", "gpu")


def best_with_one_process_per_gpu(config: Config, found: Search, gpus_per_node: int | None = None,
                                  efficiency: float = 0.5, top: int = 32) -> Candidate | None:
  """The fastest layout of `found` that runs with one process per GPU (None when none fits): the first ranked
  layout that runs no fused kernel (its plan and step are the same in either process layout,
  sharding.plan.process_layout), or one of the faster ones re-judged with a process per GPU, where each
  fused kernel whose ring spans processes falls back as its plan says (the `top` fastest at most)."""
  needs_node = lambda c: process_layout(c.layout.apply(config).parallel)[0] == "node"
  unfused = next((c for c in found.ranked if not needs_node(c)), None)
  found_faster = [c for c in found.ranked[:top] if needs_node(c)
                  and (unfused is None or c.time.step_s < unfused.time.step_s)]
  judged = []
  with _quiet_fallbacks():  # each re-planned fused kernel says why it falls back; the report line says it once
    for candidate in found_faster:
      try:
        judged.append(evaluate(config, candidate.layout, found, gpus_per_node, efficiency, processes="gpu"))
      except ConfigError:
        continue
  fitting = [c for c in [*judged, unfused] if c is not None and c.fits]
  return min(fitting, key=lambda c: c.time.step_s, default=None)


def verify(config: Config, candidate: Candidate, found: Search, gpus_per_node: int | None = None) -> dict:
  """The AOT report (aot.analyze: compiled deviceless) of a candidate's layout."""
  from meshmoe.analysis import aot  # imports the training step: only when compiling

  per_node = gpus_per_node or found.gpu.gpus_per_node
  report = aot.analyze(candidate.layout.apply(config), found.gpu.name, found.num_gpus,
                       max(1, found.num_gpus // per_node))
  return report.data


def smallest_fitting(config: Config, num_gpus: int, gpu: GpuSpec, gpus_per_node: int | None = None,
                     largest: int = 1 << 14, **options) -> tuple[int, Candidate] | None:
  """The fewest GPUs more than `num_gpus` on which some layout fits, and that layout (None when none does up to
  `largest`): whole nodes, or a divisor of one. Doubles first, then tries the counts between the last two."""
  node = gpus_per_node or gpu.gpus_per_node
  fits = lambda n: search(config, n, gpu, gpus_per_node, stop_at_first_fit=True, **options).ranked
  low, high = num_gpus, num_gpus * 2
  while not (found := fits(high)):
    low, high = high, high * 2
    if high > largest:
      return None
  for n in range(low + 1, high):  # more layouts exist at 2^k GPUs; try the counts between too
    if (n % node == 0 if n >= node else node % n == 0) and (between := fits(n)):
      return n, between[0]
  return high, found[0]
