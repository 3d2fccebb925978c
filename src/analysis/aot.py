"""Compile the real train step for a GPU cluster this machine does not have, and report what it will cost.

`analyze(config, target, num_devices, num_hosts)` builds the config's mesh on a deviceless GPU topology
(deviceless.py) or on the local devices (`target="cpu"`), compiles the training step (forward, backward,
optimizer; every micro-batch) against abstract state, and reads the compiled program:
- memory: XLA's buffer assignment (arguments + outputs - donated aliases + temporaries) per device, next
  to the device's memory and the cost model's estimate;
- FLOPs: matmul FLOPs of the compiled program with loops counted per iteration (hlo_flops.py), next to
  the cost model's FLOPs outside custom-call kernels; the kernels' FLOPs (tokamax's, the fused kernels')
  are modelled and reported apart, never added to compiled figures;
- collectives: every collective with its bytes per device per step and whether it overlaps independent
  compute (hlo_collectives.py), next to the cost model's bytes per kind; `overlap_fraction` is the bytes
  of overlapped collectives over all collective bytes, from the compiled program only.
The JSON holds the contract other tools read (ARCHITECTURE.md): `memory.peak_bytes_per_device`,
`flops.compiled` (XLA's program only), `flops.kernels_modelled`, `flops.model`, `collectives` ([{kind, bytes,
overlapped}]) and `overlap_fraction`, plus the detail above and `plan`, the parallel plan the step was
compiled with (which implementation each op ran, and why where it fell back).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from meshmoe.analysis import (cost_collectives, cost_kernels, cost_model, deviceless, gpus, hlo_collectives,
                              hlo_flops, hlo_module)
from meshmoe.config import MESH_AXES, Config
from meshmoe.runtime import gpu_memory
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.training import train_step

# What --target names: each GPU kind (its XLA spec file stem) and the local CPU devices.
TARGETS = {**{name: gpus.gpu(name).target for name in gpus.GPUS}, "cpu": None}
_REMAT_RECOMPUTE = {"none": 1.0, "dots": 1.0, "full": 4.0 / 3.0}  # forward again: 4 passes instead of 3


@dataclasses.dataclass
class Report:
  data: dict[str, Any]  # the JSON report
  hlo_text: str  # the compiled, scheduled module
  plan_table: str  # what ran, op by op (ParallelPlan.table)

  def table(self) -> str:
    return self.plan_table + "\n\n" + format_table(self.data)


def device_memory_bytes(target: str) -> float | None:
  """Memory of one device of a GPU target, from its XLA spec (None for the CPU)."""
  if TARGETS[target] is None:
    return None
  return gpus.gpu(target).memory_bytes


def target_mesh(config: Config, target: str, num_devices: int, num_hosts: int) -> jax.sharding.Mesh:
  if target not in TARGETS:
    raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")
  if target == "cpu":
    devices = jax.devices()
    if len(devices) != num_devices:
      raise ValueError(f"--devices={num_devices} but this process has {len(devices)} CPU devices")
    return make_mesh(config.mesh, devices)
  devices = deviceless.gpu_devices(num_devices, TARGETS[target], num_hosts)
  return make_mesh(config.mesh, devices)


def analyze(config: Config, target: str, num_devices: int, num_hosts: int = 1) -> Report:
  config.validate(num_devices)
  mesh = target_mesh(config, target, num_devices, num_hosts)
  plan = ParallelPlan.build(config, mesh)
  trainer, state = train_step.create_abstract(config, plan)
  start = time.perf_counter()
  with deviceless.targeting(mesh):
    lowered = trainer.train_step.lower(state, train_step.abstract_batch(config, plan))
  compiled = lowered.compile() if target == "cpu" else deviceless.compile_for_analysis(lowered)
  compile_s = time.perf_counter() - start
  module = hlo_module.parse(compiled.as_text())
  cost = cost_model.step_cost(config, plan)
  found = hlo_collectives.collectives(module, num_devices)
  fallback = _fallback(config, plan, trainer, state, target) if plan.caps_receive_buffers else None
  return Report({
      "config": {"target": target, "devices": num_devices, "hosts": num_hosts,
                 "mesh": dict(mesh.shape), "preset": config.mesh.preset,
                 "weight_storage": config.mesh.weight_storage, "impl": config.parallel.impl,
                 "attention": config.parallel.attention, "xla_flags": config.parallel.xla_flags,
                 "remat": config.model.remat, "dtype": config.model.dtype,
                 "global_batch": config.train.global_batch_size, "seq_len": config.train.seq_len,
                 "grad_accum_steps": config.train.grad_accum_steps},
      "plan": plan.to_json(),
      "compile_seconds": round(compile_s, 2),  # tracing, lowering and compiling (or reading the cache)
      "compiled_from_cache": getattr(compiled, "from_cache", False),  # compiled_cache.py
      "memory": _memory(compiled, cost, target, config.train.gpu_memory_fraction),
      "flops": _flops(module, config, plan, cost),
      "collectives": [{"kind": c.kind, "bytes": c.bytes, "overlapped": c.overlapped, "group_size": c.group_size,
                       "count": c.count} for c in found if c.bytes > 0],
      "collective_bytes_by_kind": _bytes_by_kind(found, cost),
      "overlap_fraction": hlo_collectives.overlap_fraction(found),
      "fused_kernels": _fused_kernels(cost),
      "loops_with_unknown_trip_count": module.unknown_trip_counts,
      "dropless_fallback": fallback,
  }, compiled.as_text(), plan.table())


def _fallback(config: Config, plan: ParallelPlan, trainer, state, target: str) -> dict[str, Any]:
  """The compiled memory of the step a run with capped MoE receive buffers takes again where one overflows
  (train_step.dropless_fallback: worst-case buffers), beside the cost model's: a run must fit both."""
  fallback_config, fallback_plan = train_step.dropless_fallback(config, plan)
  with deviceless.targeting(plan.mesh):
    lowered = trainer.fallback_step.lower(state, train_step.abstract_batch(fallback_config, fallback_plan))
  compiled = lowered.compile() if target == "cpu" else deviceless.compile_for_analysis(lowered)
  return {"grad_accum_steps": fallback_config.train.grad_accum_steps,
          "memory": _memory(compiled, cost_model.step_cost(fallback_config, fallback_plan), target,
                            config.train.gpu_memory_fraction)}


def _compiled_in(report: dict[str, Any]) -> str:
  where = "read from the analysis cache" if report.get("compiled_from_cache") else "compiled"
  return f"{where} in {report['compile_seconds']:.1f} s"


def _memory(compiled, cost, target: str, fraction: float) -> dict[str, Any]:
  """The compiled step's peak against the memory the allocator holds (runtime/gpu_memory.py)."""
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)
  capacity = device_memory_bytes(target)
  usable = None if capacity is None else gpu_memory.usable_bytes(capacity, fraction)
  return {"peak_bytes_per_device": peak, "arguments": m.argument_size_in_bytes,
          "outputs": m.output_size_in_bytes, "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes,
          "device_bytes": capacity, "usable_bytes": usable, "gpu_memory_fraction": fraction,
          "fits": None if usable is None else peak <= usable,
          "cost_model": dataclasses.asdict(cost.memory) | {"total": cost.memory.total}}


def _flops(module, config: Config, plan: ParallelPlan, cost) -> dict[str, Any]:
  """Matmul FLOPs per device, compiled and modelled apart. `compiled` counts the matmuls of XLA's program
  (loops per iteration); custom-call kernels (tokamax's grouped GEMM and flash attention, the fused
  kernels) are opaque to it, so their FLOPs are the cost model's, from the tiles they compute
  (`kernels_modelled`: balanced routing; `kernels_modelled_worst_case`: the most the buffers allow), and
  `compiled_over_cost_model` compares the compiled program with the cost model's non-kernel FLOPs only."""
  in_hlo = hlo_flops.matmul_flops(module)
  kernels = cost_model.flops_in_kernels(config, plan)
  worst = cost_model.flops_in_kernels(config, plan, worst_case=True)
  model = cost.model_flops / plan.mesh.size
  with_remat = model * _REMAT_RECOMPUTE[config.model.remat]
  executed = cost.executed_flops_per_device.total
  outside_kernels = executed - sum(kernels.values())
  useful_experts = cost_model.useful_expert_flops_per_device(config, plan)
  return {"compiled": in_hlo, "cost_model_outside_kernels": outside_kernels,
          "compiled_over_cost_model": in_hlo / outside_kernels if outside_kernels else None,
          "kernels_modelled": kernels, "kernels_modelled_worst_case": worst,
          "useful_routed_experts": useful_experts,
          "expert_kernels_over_useful": (kernels["routed_experts"] / useful_experts
                                         if kernels["routed_experts"] and useful_experts else None),
          "model": model, "model_with_remat": with_remat, "cost_model_executed": executed}


def _fused_kernels(cost) -> dict[str, Any]:
  """Bytes the `pallas` tier's kernels move inside their custom calls: modelled (the cost model's, from
  the kernels' own accounting); the HLO shows no collective for them, and `overlap_fraction` leaves them
  out."""
  return {"bytes_by_kind_modelled": {k: v for k, v in cost_collectives.bytes_by_kind(cost.collectives).items()
                                     if k in cost_kernels.FUSED_KINDS}}


def _bytes_by_kind(found, cost) -> dict[str, dict[str, float]]:
  compiled = hlo_collectives.bytes_by_kind(found)
  modelled = {k: v for k, v in cost_collectives.bytes_by_kind(cost.collectives).items()
              if k not in cost_kernels.FUSED_KINDS}
  overlapped = hlo_collectives.bytes_by_kind([c for c in found if c.overlapped])
  return {kind: {"compiled": compiled.get(kind, 0.0), "cost_model": modelled.get(kind, 0.0),
                 "overlapped": overlapped.get(kind, 0.0)}
          for kind in sorted(set(compiled) | set(modelled))}


def format_table(report: dict[str, Any]) -> str:
  """The report as text: cost model beside compiled figures, and the verdict on memory."""
  c, mem, flops = report["config"], report["memory"], report["flops"]
  gb = lambda b: f"{b / 1e9:9.2f} GB"
  plan = report.get("plan", {})  # MoE parallel folding, where the config sets one
  folding = [f"{what} over {plan[key]}" for key, what in (("expert_axes", "experts"), ("expert_width_axes",
             "expert width")) if plan.get(key, "preset") != "preset"]
  if plan.get("optimizer_storage", "weights") != "weights":
    folding.append(f"float32 master and optimizer state over {plan['optimizer_storage']}")
  lines = [
      f"{c['devices']} x {c['target']} ({c['hosts']} host(s)), mesh "
      + " ".join(f"{a}={c['mesh'][a]}" for a in MESH_AXES) + f", preset {c['preset']} (weights stored: "
      f"{c.get('weight_storage', 'preset')}{''.join('; ' + f for f in folding)}), impl {c['impl']}, "
      f"attention {c['attention']}, xla_flags {c['xla_flags']}, remat {c['remat']}, {c['dtype']}; "
      f"{_compiled_in(report)}",
      "",
      "per device, per step             compiled (XLA's program)   modelled (cost model)",
      f"matmul FLOPs outside kernels  {flops['compiled'] / 1e12:10.3f} TF        "
      f"{flops['cost_model_outside_kernels'] / 1e12:10.3f} TF"
      + (f"   (compiled / modelled = {flops['compiled_over_cost_model']:.2f})"
         if flops['compiled_over_cost_model'] else ""),
      f"matmul FLOPs in kernels            (opaque)        {sum(flops['kernels_modelled'].values()) / 1e12:10.3f} TF"
      f"   (worst case {sum(flops['kernels_modelled_worst_case'].values()) / 1e12:.3f} TF; "
      + ", ".join(f"{part} {value / 1e12:.3f}" for part, value in flops["kernels_modelled"].items() if value) + ")",
      f"useful FLOPs {flops['model'] / 1e12:.3f} TF (with remat {flops['model_with_remat'] / 1e12:.3f} TF); modelled "
      f"executed in all {flops['cost_model_executed'] / 1e12:.3f} TF"
      + (f"; expert kernels / useful expert FLOPs = {flops['expert_kernels_over_useful']:.3f} (modelled)"
         if flops["expert_kernels_over_useful"] else ""),
      f"memory                   {gb(mem['peak_bytes_per_device'])}              {gb(mem['cost_model']['total'])}"
      f"   (params {mem['cost_model']['params'] / 1e9:.2f}, grads {mem['cost_model']['gradients'] / 1e9:.2f}, "
      f"optimizer {mem['cost_model']['optimizer'] / 1e9:.2f}, activations "
      f"{mem['cost_model']['activations'] / 1e9:.2f} GB)",
      "collective bytes          compiled      cost model    overlapped",
  ]
  for kind, row in report["collective_bytes_by_kind"].items():
    share = row["overlapped"] / row["compiled"] if row["compiled"] else 0.0
    lines.append(f"  {kind:21s} {row['compiled'] / 1e6:10.1f} MB {row['cost_model'] / 1e6:10.1f} MB"
                 f"   {100 * share:5.1f}%")
  lines.append(f"overlap_fraction {report['overlap_fraction']:.3f} (compiled: bytes of collectives that run beside "
               "independent compute / all collective bytes)")
  fused = report["fused_kernels"]["bytes_by_kind_modelled"]
  if fused:
    lines.append("inside fused kernels (modelled, from the kernels' own accounting; no HLO collective, not in "
                 "overlap_fraction):")
    for kind, nbytes in fused.items():
      lines.append(f"  {kind:21s} {nbytes / 1e6:10.1f} MB")
  if report["loops_with_unknown_trip_count"]:
    lines.append(f"note: {report['loops_with_unknown_trip_count']} loop(s) without a known trip count were "
                 "counted once")
  fallback = report.get("dropless_fallback")
  if fallback:
    fb = fallback["memory"]
    lines.append(f"dropless fallback (worst-case MoE receive buffers, {fallback['grad_accum_steps']} micro-batches; "
                 f"run where a capped buffer overflows): memory {gb(fb['peak_bytes_per_device']).strip()} compiled, "
                 f"{gb(fb['cost_model']['total']).strip()} modelled")
  if mem["fits"] is None:
    lines.append("memory verdict: CPU target, no device memory limit")
  else:
    fits = mem["fits"] and (not fallback or fallback["memory"]["fits"])
    verdict = "FITS" if fits else "DOES NOT FIT"
    lines.append(f"memory verdict: {verdict}: peak {gb(mem['peak_bytes_per_device']).strip()} of the "
                 f"{gb(mem['usable_bytes']).strip()} the allocator holds per device "
                 f"({100 * mem['peak_bytes_per_device'] / mem['usable_bytes']:.0f}%; train.gpu_memory_fraction="
                 f"{mem['gpu_memory_fraction']:g} of {gb(mem['device_bytes']).strip()})"
                 + (f"; the dropless fallback's {gb(fallback['memory']['peak_bytes_per_device']).strip()} "
                    f"{'fits' if fallback['memory']['fits'] else 'does NOT fit'}" if fallback else ""))
  return "\n".join(lines)
