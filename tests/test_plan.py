"""The parallel plan (meshmoe.sharding.plan): one place decides how every parallel op runs.

- The tier table and the config agree, and every implementation the plan names is one its op has.
- Fused kernels: Mosaic GPU on Hopper GPUs for shapes that tile, the op's unfused implementation elsewhere
  (said once in the log, and in the plan with the reason), the kernels' plain-collective versions with
  `parallel.kernel_backend="collectives"` anywhere.
- The cost model follows the plan (a non-Hopper GPU gets no kernel accounting), and what the plan predicts
  is what the compiled step contains.
"""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import pytest
from absl import logging

from experiments.configs import tiny_moe
from meshmoe import config as config_lib
from meshmoe.analysis import cost_collectives, cost_kernels, cost_model, deviceless
from meshmoe.pallas_kernels import mosaic_tiles
from meshmoe.config import MeshConfig, ParallelConfig
from meshmoe.models.layers import swiglu_hidden
from meshmoe.sharding import context_parallel, expert_parallel, grouped_ffn, plan as plan_lib, tensor_parallel
from meshmoe.sharding.grouped_gemm_kernels import Candidate
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import Hardware, ParallelPlan
from meshmoe.sharding.shardings import use_plan
from meshmoe.training import train_step
from tests.model_steps import gpu_mesh

# Each preset on a layout that exercises it.
LAYOUTS = {"dp": (8, 1, 1, 1), "fsdp": (8, 1, 1, 1), "zero1": (8, 1, 1, 1), "ep": (2, 4, 1, 1),
           "tp_sp": (2, 2, 2, 1), "megascale": (2, 2, 1, 2)}


def _config(preset="ep", impl="reference", dtype="float32", **parallel):
  config = tiny_moe.get_config()
  config.mesh = MeshConfig(**dict(zip(("data", "expert", "tensor", "sequence"), LAYOUTS[preset])), preset=preset)
  config.parallel = ParallelConfig(impl=impl, **parallel)
  config.model.dtype = dtype
  return config.validate(8)


def _gpu_plan(**parallel) -> ParallelPlan:
  mesh = gpu_mesh((8,), ("data",))
  return ParallelPlan.for_mesh(mesh, "dp", ParallelConfig(**parallel))


def test_the_config_lists_the_tiers_and_kernel_backends_the_plan_knows():
  assert config_lib.IMPLS == tuple(plan_lib.TIERS)
  assert config_lib.KERNEL_BACKENDS == tuple(plan_lib.FUSED_KERNEL_BACKENDS)


@pytest.mark.parametrize("impl", config_lib.IMPLS)
@pytest.mark.parametrize("preset", list(LAYOUTS))
def test_every_choice_is_an_implementation_of_its_op(preset, impl):
  tables = {"attention": context_parallel.IMPLEMENTATIONS, "project_in": tensor_parallel.PROJECT_IN,
            "project_out": tensor_parallel.PROJECT_OUT, "moe": expert_parallel.IMPLEMENTATIONS,
            "gradients": {"xla", *config_lib.GRADIENT_COMPRESSIONS[1:]}, "layer": config_lib.LAYER_SCHEDULES}
  for attention in config_lib.ATTENTION_KINDS:
    config = _config(preset, impl, attention=attention, kernel_backend="collectives")
    config.model.num_heads, config.model.num_kv_heads = 8, 4  # Ulysses splits them over 4 devices
    plan = ParallelPlan.build(config, make_mesh(config.mesh))
    assert set(plan.ops) >= {"attention", "attention.project_in", "attention.project_out", "moe", "gradients"}
    for name, choice in plan.ops.items():
      assert choice.implementation in tables[name.split(".")[-1]], (name, choice)
    json.dumps(plan.to_json())  # plan.json holds plain data
    assert all(name in plan.table() for name in plan.ops)


def test_the_tier_picks_each_op_s_implementation():
  chosen = {}
  for impl in config_lib.IMPLS:
    config = _config("tp_sp", impl, attention="ring", kernel_backend="collectives")
    ops = ParallelPlan.build(config, make_mesh(config.mesh)).ops
    chosen[impl] = (ops["attention"].implementation, ops["attention.project_in"].implementation,
                    ops["moe"].implementation, ops["moe"].chunks)
  assert chosen == {"reference": ("ring", "collectives", "all_to_all", 1),
                    "xla": ("zigzag_ring", "ring", "all_to_all", 2),
                    "pallas": ("zigzag_ring", "fused", "fused", 1)}


def test_hopper_gpus_get_the_mosaic_kernels_for_shapes_that_tile():
  plan = _gpu_plan(impl="pallas")
  assert plan.hardware.num_sms == 132 and plan.hardware.compute_capability.startswith("9.")
  tiles = plan.project_in(("data",), rows=256, d=512, width=512, dtype=jnp.bfloat16)
  assert (tiles.implementation, tiles.kernel_backend, tiles.fallback) == ("fused", "mosaic_gpu", "")
  odd = plan.project_in(("data",), rows=256, d=512, width=100, dtype=jnp.bfloat16)
  assert odd.implementation == "ring" and "is not a multiple of its tile" in odd.fallback
  float32 = plan.expert_ffn(ep=8, d=512, f=512, dtype=jnp.float32)
  assert float32.implementation == "all_to_all" and "float32" in float32.fallback


def _h100_model_plan(dtype: str) -> ParallelPlan:
  """The plan of tiny_moe with 512-wide tokens and experts in `dtype` on 8 H100s, data parallel."""
  config = tiny_moe.get_config()
  config.mesh = MeshConfig(data=8, expert=1, tensor=1, sequence=1, preset="dp")
  config.parallel = ParallelConfig(impl="xla")
  config.model.dtype, config.model.embed_dim, config.model.moe.expert_mlp_dim = dtype, 512, 512
  return ParallelPlan.build(config.validate(8), make_mesh(config.mesh, deviceless.gpu_devices(8)))


def test_on_hopper_the_plan_runs_each_form_s_measured_kernel_and_says_where_it_came_from():
  """An H100 (sm90) in bfloat16 at d=512, f=512: every form runs JAX's Hopper kernels with the tiles they
  were measured with (the table's fastest correct candidate at the nearest class, moe_1b); the table says
  so, with the row. Where no Hopper kernel takes the widths, the next fastest correct one that does runs."""
  plan = _gpu_plan(impl="xla")
  choice = plan.expert_ffn(ep=8, d=512, f=512, dtype=jnp.bfloat16)
  assert choice.grouped_gemm == "kernels"
  tiles = (("block_m", 128), ("block_n", 128), ("block_k", 64), ("max_concurrent_steps", 4), ("grid_block_n", 1))
  assert choice.gemm_kernels.candidates() == (Candidate("jax_mgpu", "forward", tiles),
                                              Candidate("jax_mgpu", "input_gradient", tiles),
                                              Candidate("jax_mgpu", "weight_gradient", tiles))
  assert choice.gemm_kernels.sources[2] == ("measured 2026-11-27 on NVIDIA H200: 355.7 TFLOP/s at moe_1b "
                                            "(d_model 1024, expert width 512)")
  table = _h100_model_plan("bfloat16").table()
  assert "moe weight gradient: jax_mgpu[128x128x64x4x1] (measured 2026-11-27 on NVIDIA H200" in table
  # A gate/up width of 80: JAX's kernels tile 128 columns and tokamax's Mosaic kernels 64 (its compile for
  # an H100 fails at 80), so at the nearest class (moe_1b) the fastest correct candidate left runs: XLA's.
  narrow = plan.expert_ffn(ep=8, d=512, f=40, dtype=jnp.bfloat16)
  assert [c.implementation for c in narrow.gemm_kernels.candidates()] == ["xla", "xla", "xla"]


def test_a_float32_model_on_a_gpu_runs_the_blocked_gemm_and_the_plan_says_why():
  plan = _gpu_plan(impl="xla")
  choice = plan.expert_ffn(ep=8, d=512, f=512, dtype=jnp.float32)
  assert (choice.grouped_gemm, choice.gemm_kernels) == ("blocked", None)
  table = _h100_model_plan("float32").table()
  assert ("  moe: not the xla tier's first choice: the GPU grouped-GEMM kernels take bfloat16/float16 operands, not "
          "float32 (model.dtype=bfloat16 runs them): the blocked GEMM runs (exact, slower)") in table.splitlines()


def test_gemm_kernel_overrides_replace_the_measured_choice_for_their_forms_only():
  plan = _gpu_plan(impl="xla", gemm_kernels="weight_gradient=meshmoe_mosaic")
  kernels = plan.expert_ffn(ep=8, d=512, f=512, dtype=jnp.bfloat16).gemm_kernels
  assert [c.implementation for c in kernels.candidates()] == ["jax_mgpu", "jax_mgpu", "meshmoe_mosaic"]
  assert kernels.sources[2] == "set by parallel.gemm_kernels"
  assert kernels.row_multiple == mosaic_tiles.DEFAULT_TILES.block_k
  with pytest.raises(config_lib.ConfigError, match="parallel.gemm_kernels.*forms: forward, input_gradient"):
    ParallelConfig(gemm_kernels="backward=jax_mgpu").validate()


def test_kernel_tiles_reach_every_fused_op_and_decide_what_tiles():
  """`parallel.kernel_tiles`: the plan hands each fused op its tiles, checks the shapes against them and says
  when they are warp-specialised."""
  default, hopper = _gpu_plan(impl="pallas"), _gpu_plan(impl="pallas", kernel_tiles="warp_specialized")
  for plan, tiles in ((default, mosaic_tiles.DEFAULT_TILES), (hopper, mosaic_tiles.HOPPER_TILES)):
    choices = [plan.project_in(("data",), rows=256, d=512, width=512, dtype=jnp.bfloat16),
               plan.project_out(("data",), rows=256, contraction=512, d=512, dtype=jnp.bfloat16),
               plan.expert_ffn(ep=8, d=512, f=512, dtype=jnp.bfloat16)]
    for choice in choices:
      assert (choice.implementation, choice.tiles) == ("fused", tiles), choice
      assert ("warp-specialised 128 x 256 tiles" in choice.detail) == (tiles.consumers > 1), choice.detail
    # Only the MoE dispatch kernel has a send phase for a sender warpgroup.
    assert ["sender warpgroup" in choice.detail for choice in choices] == [False, False, tiles.consumers > 1]
  # 384 columns tile by 128, not by the warp-specialised layout's 256.
  assert default.project_in(("data",), 256, 512, 384, jnp.bfloat16).implementation == "fused"
  narrow = hopper.project_in(("data",), 256, 512, 384, jnp.bfloat16)
  assert narrow.implementation == "ring" and "N=384 is not a multiple of its tile 256" in narrow.fallback
  # The kernels' plain-collective versions have no thread blocks to describe.
  plain = _gpu_plan(impl="pallas", kernel_tiles="warp_specialized", kernel_backend="collectives")
  choice = plain.expert_ffn(ep=8, d=512, f=512, dtype=jnp.bfloat16)
  assert choice.tiles == mosaic_tiles.HOPPER_TILES and "warp-specialised" not in choice.detail


def test_kernels_fall_back_where_the_mesh_is_not_in_device_id_order():
  """Mosaic GPU's communicating kernels address peers by mesh position, which must follow the device ids:
  with `tensor` and `sequence` both split, sharding/mesh.py places tensor inside sequence and they do not."""
  devices = list(gpu_mesh((8,), ("data",)).devices.ravel())
  for sequence, ordered in ((1, True), (2, False)):
    mesh = make_mesh(MeshConfig(data=-1, expert=2, tensor=2, sequence=sequence, preset="tp_sp"), devices)
    plan = ParallelPlan.for_mesh(mesh, "tp_sp", ParallelConfig(impl="pallas"))
    tiles = plan.project_in(("tensor",), rows=256, d=512, width=512, dtype=jnp.bfloat16)
    assert (tiles.kernel_backend == "mosaic_gpu") == ordered, tiles
    if not ordered:
      assert tiles.implementation == "ring" and "row-major order" in tiles.fallback


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_other_tiers_never_use_kernels(impl):
  plan = _gpu_plan(impl=impl)
  assert plan.project_in(("data",), 256, 512, 512, jnp.bfloat16).implementation != "fused"
  assert plan.expert_ffn(8, 512, 512, jnp.bfloat16).implementation == "all_to_all"


def test_cpu_falls_back_and_says_so_once(monkeypatch):
  messages = []
  monkeypatch.setattr(logging, "warning", lambda fmt, *args: messages.append(fmt % args))
  plan = ParallelPlan.for_mesh(make_mesh(MeshConfig(data=8, preset="ep")), "ep",
                               ParallelConfig(impl="pallas", moe_chunks=3))
  for _ in range(3):
    choice = plan.expert_ffn(ep=8, d=17, f=5, dtype=jnp.bfloat16)
  assert (choice.implementation, choice.chunks, choice.exchange) == ("all_to_all", 3, "padded_all_to_all")
  assert choice.fallback == "no fused kernels on cpu (Mosaic GPU needs GPUs)"
  assert len(messages) == 1 and "MoE dispatch/return runs its unfused implementation: no fused kernels on cpu" \
      in messages[0]


@pytest.mark.parametrize("devices", ["cpu", "h100"])
def test_collectives_kernel_backend_runs_anywhere(devices):
  mesh = (make_mesh(MeshConfig(data=8, preset="dp")) if devices == "cpu"
          else gpu_mesh((8,), ("data",)))
  plan = ParallelPlan.for_mesh(mesh, "dp", ParallelConfig(impl="pallas", kernel_backend="collectives"))
  choice = plan.project_out(("data",), rows=3, contraction=5, d=7, dtype=jnp.float32)
  assert (choice.implementation, choice.kernel_backend) == ("fused", "collectives")


def test_a_gpu_other_than_hopper_runs_unfused_and_the_cost_model_agrees(monkeypatch):
  """The plan, and so the cost model, read the GPU generation: on an A100 (compute capability 8.0) the
  pallas tier's kernels do not run and nothing is accounted inside them."""
  config = _config("ep", "pallas", "bfloat16")
  mesh = make_mesh(config.mesh, deviceless.gpu_devices(8))
  hopper = ParallelPlan.build(config, mesh)
  assert hopper.ops["moe"].implementation == "fused"
  assert cost_model.flops_in_kernels(config, hopper)["routed_experts"] > 0
  a100 = Hardware("gpu", "NVIDIA A100-SXM4-80GB", "8.0", 108)
  monkeypatch.setattr(Hardware, "of", classmethod(lambda cls, device: a100))
  ampere = ParallelPlan.build(config, mesh)
  assert ampere.ops["moe"].implementation == "all_to_all"
  assert "written for Hopper (compute capability 9.x), not 8.0" in ampere.ops["moe"].fallback
  # No fused kernel; the grouped GEMM is tokamax's where its weight-gradient kernel (Triton) is installed.
  kernels = cost_model.flops_in_kernels(config, ampere)
  assert kernels["projections"] == 0
  assert (kernels["routed_experts"] > 0) == cost_kernels.gemm_in_kernels(ampere.ops["moe"])
  kinds = {cost.kind for cost in cost_collectives.collective_costs(config, ampere)}
  assert "ragged-all-to-all" in kinds and not kinds & set(cost_kernels.FUSED_KINDS)


def test_plain_collective_kernels_are_accounted_as_hlo_collectives():
  config = _config("ep", "pallas", kernel_backend="collectives")
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  assert plan.ops["moe"].implementation == "fused" and plan.ops["moe"].kernel_backend == "collectives"
  assert not any(cost_model.flops_in_kernels(config, plan).values())
  kinds = {cost.kind for cost in cost_collectives.collective_costs(config, plan)}
  assert not kinds & set(cost_kernels.FUSED_KINDS)


@pytest.mark.parametrize("gemm, dense", [("blocked", False), ("ragged_dot", True)])
def test_the_grouped_gemm_is_the_plan_s(gemm, dense):
  """parallel.grouped_gemm reaches the op through the plan: XLA:CPU multiplies ragged_dot densely, every
  row by every expert (8 here), the blocked layout only each row's expert."""
  mesh = make_mesh(MeshConfig(data=8, preset="dp"))
  plan = ParallelPlan.for_mesh(mesh, "dp", ParallelConfig(grouped_gemm=gemm))
  b, s, d, f, e = 8, 64, 32, 64, 8
  x = jax.ShapeDtypeStruct((b, s, d), jnp.float32, sharding=plan.activation_sharding(("act_batch", "act_seq", None)))
  routing = jax.ShapeDtypeStruct((b, s, 2), jnp.int32, sharding=x.sharding)
  w = grouped_ffn.ExpertWeights(*(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=plan.replicated())
                                  for shape in [(e, d, f), (e, d, f), (e, f, d)]))

  def moe(x, experts, w):
    with use_plan(plan):
      return expert_parallel.moe_ffn(x, experts, jnp.ones(experts.shape, jnp.float32), w, swiglu_hidden)

  cost = jax.jit(moe).lower(x, routing, w).compile().cost_analysis()
  flops = (cost[0] if isinstance(cost, list) else cost)["flops"]
  useful = b * s // 8 * 2 * 2 * 3 * d * f  # per device
  assert (flops > 4 * useful) == dense, (flops, useful)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_what_the_plan_predicts_is_what_the_lowered_step_calls(dtype):
  """tiny_moe under tp_sp with the pallas tier, lowered for 8 H100s: in bfloat16 the plan predicts the
  fused kernels for the projections and the experts, and the step's program calls Mosaic GPU kernels; in
  float32 (which the kernels do not take) it predicts none, and the step calls none. The kernels are custom
  calls from tracing on, so the lowered program shows them (test_aot.py compiles this tier's step)."""
  config = _config("tp_sp", "pallas", dtype)
  plan = ParallelPlan.build(config, make_mesh(config.mesh, deviceless.gpu_devices(8)))
  fused = {name for name, choice in plan.ops.items() if choice.implementation == "fused"}
  trainer, state = train_step.create_abstract(config, plan)
  with deviceless.targeting(plan.mesh):
    lowered = trainer.train_step.lower(state, train_step.abstract_batch(config, plan))
  kernels = lowered.as_text().count("stablehlo.custom_call @mosaic_gpu")
  if dtype == "bfloat16":
    # Each direction is decided on its own shapes: attention's output projection contracts 64 columns per
    # device, which its backward all-gather GEMM does not tile, so it runs the ring while the rest fuse.
    assert fused == {"attention.project_in", "dense_mlp.project_in", "dense_mlp.project_out", "moe"}, plan.table()
    assert plan.ops["attention.project_out"].implementation == "ring"
    assert "N=64 is not a multiple of its tile 128" in plan.ops["attention.project_out"].fallback
    assert kernels >= 2 * len(fused)  # each kernel forward, and its dual in the backward pass
  else:
    assert not fused and kernels == 0, plan.table()
    assert all("float32" in plan.ops[name].fallback for name in ("attention.project_in", "moe"))


def test_plan_json_and_table_name_every_op_and_fallback():
  config = _config("megascale", "pallas", attention="ring")
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  data = json.loads(json.dumps(plan.to_json()))
  assert data["preset"] == "megascale" and data["mesh"] == {"data": 2, "expert": 2, "tensor": 1, "sequence": 2}
  assert data["ops"]["attention"]["implementation"] == "zigzag_ring"
  assert data["ops"]["moe"]["fallback"] == "no fused kernels on cpu (Mosaic GPU needs GPUs)"
  table = plan.table()
  assert table.splitlines()[0].startswith("parallel plan: preset megascale, tier pallas")
  assert "moe: not the pallas tier's first choice: no fused kernels on cpu" in table


def test_sequence_order_is_zigzag_over_the_attention_devices():
  config = _config("megascale")
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  assert plan.attention_axes() == ("expert", "sequence")
  order = plan.sequence_order(16)
  assert list(order) == list(context_parallel.zigzag_order(16, 4))
  assert ParallelPlan.build(_config("ep"), make_mesh(_config("ep").mesh)).sequence_order(16) is None


def test_layouts_are_the_ones_the_ops_use():
  config = _config("tp_sp")
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  tp_axes, gather = plan.projection_axes([("embed", "heads", "head_dim")])
  assert tp_axes == ("tensor",) and gather == ("tensor",)
  experts = plan.expert_layout()
  assert (experts.expert_axes, experts.width_axes, experts.gather, experts.reduce, experts.ep) == \
      (("expert",), ("tensor",), ("tensor",), (), 2)
  assert plan.weight_spec(("exp", "embed", "exp_mlp")) == jax.sharding.PartitionSpec("expert", None, "tensor")
  fsdp = ParallelPlan.build(_config("fsdp"), make_mesh(_config("fsdp").mesh))
  assert fsdp.param_spec(("embed", "mlp"))[0] == ("data", "expert", "tensor", "sequence")
  assert fsdp.weight_spec(("embed", "mlp")) == jax.sharding.PartitionSpec(None, None)  # gathered for use


def test_hardware_of_a_deviceless_h100():
  hardware = Hardware.of(deviceless.gpu_devices(1)[0])
  assert hardware.platform == "gpu" and hardware.compute_capability == "9.0" and hardware.num_sms == 132
  assert "132 SMs" in hardware.describe()
  assert Hardware.of(jax.devices()[0]) == Hardware("cpu", jax.devices()[0].device_kind, "", 0)


def test_unknown_tier_or_preset_is_one_config_error():
  mesh = make_mesh(MeshConfig(data=8, preset="dp"))
  with pytest.raises(config_lib.ConfigError, match="parallel.impl='triton' is invalid"):
    ParallelPlan.for_mesh(mesh, "dp", ParallelConfig(impl="triton"))
  with pytest.raises(config_lib.ConfigError, match="mesh.preset='pp' is invalid"):
    ParallelPlan.for_mesh(mesh, "pp")


def test_the_layer_schedule_is_in_the_plan_and_odd_rows_are_one_config_error():
  config = _config("ep", layer_schedule="two_halves")  # 16 rows over 8 batch shards: 2 per device
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  assert plan.two_halves and plan.ops["layer"].implementation == "two_halves"
  assert re.search(r"\n  layer +two_halves +each device's rows in two halves", plan.table())
  assert ParallelPlan.build(_config("ep"), make_mesh(config.mesh)).ops["layer"].implementation == "sequential"
  # One device holds every expert: no exchange to hide, and the plan says so.
  local = _config("dp", layer_schedule="two_halves")
  local.train.global_batch_size = 32  # 4 rows per device
  assert "nothing to hide" in ParallelPlan.build(local, make_mesh(local.mesh)).ops["layer"].detail
  config.train.global_batch_size = 24  # 3 rows per device
  with pytest.raises(config_lib.ConfigError, match=(
      r"parallel.layer_schedule='two_halves' is invalid: .* each device has 3 \(train.global_batch_size=24 / "
      r"train.grad_accum_steps=1 / 8 batch shards\): use an even number per device, or 'sequential'")):
    ParallelPlan.build(config, make_mesh(config.mesh))


def test_weight_storage_is_in_the_plan_and_its_layouts():
  """mesh.weight_storage changes where weights are stored, not how the ops use them: the same weight_spec
  and expert layout, param_spec and optimizer_spec split further; the table and plan.json say which. The
  MoE op takes its experts split as stored and gathers them itself (expert_parallel._gather_stored)."""
  config = _config("megascale")
  preset = ParallelPlan.build(config, make_mesh(config.mesh))
  config.mesh.weight_storage = "data"
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  experts = ("layers", "exp", "embed", "exp_mlp")
  assert plan.param_spec(experts) == plan.optimizer_spec(experts) == \
      jax.sharding.PartitionSpec(None, "expert", "data", "tensor")
  assert plan.weight_spec(experts) == preset.weight_spec(experts)
  stored, same = plan.expert_layout(), preset.expert_layout()
  assert (stored.weight_gather, stored.gate_shard_spec, stored.down_shard_spec) == (
      ("data",), jax.sharding.PartitionSpec("expert", "data", "tensor"),
      jax.sharding.PartitionSpec("expert", "tensor", "data"))
  assert (same.weight_gather, same.gate_shard_spec) == ((), same.gate_spec)
  assert dataclasses.replace(stored, gate_shard_spec=same.gate_shard_spec, down_shard_spec=same.down_shard_spec,
                             weight_gather=()) == same and plan.ops == preset.ops
  assert json.loads(json.dumps(plan.to_json()))["weight_storage"] == "data"
  assert preset.to_json()["weight_storage"] == "preset"
  assert plan.table().splitlines()[0].startswith(
      "parallel plan: preset megascale (weights stored split over data), tier reference")
  assert preset.table().splitlines()[0].startswith("parallel plan: preset megascale, tier reference")
  direct = ParallelPlan.for_mesh(make_mesh(config.mesh), "megascale", weight_storage="all")
  assert direct.param_spec(experts) == jax.sharding.PartitionSpec(None, "expert", ("data", "sequence"), "tensor")
  assert "split over every axis" in direct.table()


def test_split_weight_storage_rules_out_compressed_gradients():
  mesh = make_mesh(MeshConfig(data=2, expert=4, preset="ep"))
  with pytest.raises(config_lib.ConfigError, match=(
      r"config.parallel.gradient_compression='int8' is invalid: 'none' with mesh.weight_storage='data': the "
      r"compressed sum runs over replicas that each hold whole expert weights")):
    ParallelPlan.for_mesh(mesh, "ep", ParallelConfig(gradient_compression="int8"), weight_storage="data")
  with pytest.raises(config_lib.ConfigError, match="mesh.weight_storage='zero3' is invalid: one of 'preset', "):
    ParallelPlan.for_mesh(mesh, "ep", weight_storage="zero3")


def test_folded_experts_are_in_the_rules_the_layout_and_the_plan():
  """mesh.expert_axes / expert_width_axes (MoE parallel folding, rules.fold_experts) place the routed experts
  over axes of their own and change no other rule: tp_sp's attention keeps `tensor` for its heads while the
  experts take expert x tensor whole, so the MoE neither gathers the sequence nor sums partial widths."""
  config = _config("tp_sp")
  preset = ParallelPlan.build(config, make_mesh(config.mesh))
  config.mesh.expert_axes = "expert,tensor"
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  experts = plan.expert_layout()
  assert (experts.expert_axes, experts.width_axes, experts.gather, experts.reduce, experts.ep) == \
      (("expert", "tensor"), (), (), (), 4)
  P = jax.sharding.PartitionSpec
  assert plan.param_spec(("layers", "exp", "embed", "exp_mlp")) == P(None, ("expert", "tensor"), None, None)
  unchanged = {"params": ("exp", "exp_mlp"), "activations": ("act_exp", "act_exp_mlp"), "optimizer": ("exp", "exp_mlp")}
  for part, names in unchanged.items():
    folded = getattr(plan.rules, part) or {}
    own = getattr(preset.rules, part) or {}
    assert {k: v for k, v in folded.items() if k not in names} == {k: v for k, v in own.items() if k not in names}
  heads = [("embed", "heads", "head_dim")]
  assert plan.projection_axes(heads) == preset.projection_axes(heads)
  assert "tokens by padded_all_to_all over expert x tensor (4 devices)" in plan.ops["moe"].detail
  assert plan.table().splitlines()[0].startswith(
      "parallel plan: preset tp_sp (experts folded over expert x tensor, each whole), tier reference")
  assert plan.to_json()["expert_axes"] == "expert,tensor" and preset.to_json()["expert_axes"] == "preset"
  # The width over an axis of its own, and the experts over none (every device holds every expert).
  config.mesh.expert_axes, config.mesh.expert_width_axes = "tensor", "expert"
  widths = ParallelPlan.build(config, make_mesh(config.mesh)).expert_layout()
  assert (widths.expert_axes, widths.width_axes, widths.gather, widths.token_dim, widths.ep) == \
      (("tensor",), ("expert",), ("expert",), 0, 2)
  config.mesh.expert_width_axes = "data"  # the batch is split over data x expert: only `expert` gathers it
  with pytest.raises(config_lib.ConfigError, match=(
      r"mesh.expert_width_axes='data' is invalid: axes the MoE can gather its tokens over \(expert-tensor-parallel "
      r"gather of the tokens: mesh axes \('data',\) must be the innermost axes of \('data', 'expert'\)")):
    ParallelPlan.build(config, make_mesh(config.mesh))
  config.mesh.expert_axes, config.mesh.expert_width_axes = "none", "none"
  local = ParallelPlan.build(config, make_mesh(config.mesh))
  assert local.expert_layout().ep == 1 and local.ops["moe"].implementation == "local"


def test_a_folding_the_token_exchange_cannot_run_is_one_config_error():
  config = _config("megascale")  # its tokens are split over data, expert and sequence, not tensor
  config.mesh = MeshConfig(data=2, expert=2, tensor=2, sequence=1, preset="megascale", expert_axes="expert,tensor")
  with pytest.raises(config_lib.ConfigError, match=(
      r"mesh.expert_axes='expert,tensor' is invalid: mesh axes that split the tokens \(data, expert, sequence "
      r"under this preset\): .* tensor does not split them")):
    ParallelPlan.build(config, make_mesh(config.mesh))
  for field, value in (("expert_axes", "expert,pipeline"), ("expert_axes", "expert,expert"),
                       ("expert_width_axes", 3)):
    bad = _config("tp_sp")
    setattr(bad.mesh, field, value)
    with pytest.raises(config_lib.ConfigError, match=rf"mesh.{field}=.* is invalid: 'preset', 'none', or mesh axes"):
      bad.validate(8)
  both = _config("tp_sp")
  both.mesh.expert_axes, both.mesh.expert_width_axes = "expert,tensor", "tensor"
  with pytest.raises(config_lib.ConfigError,
                     match=r"a mesh axis splits the experts or their width, not both \(tensor\)"):
    both.validate(8)
  uneven = _config("tp_sp")  # tiny_moe's 8 experts over data x expert x tensor = 8 devices, then 16
  uneven.mesh.expert_axes = "data,expert,tensor"
  ParallelPlan.build(uneven, make_mesh(uneven.mesh))
  uneven.model.moe.num_experts = 4
  with pytest.raises(config_lib.ConfigError, match=(
      r"model.moe.num_experts=4 is invalid: a multiple of 8: preset 'tp_sp' with mesh.expert_axes='data,expert,tensor' "
      r"splits the experts over mesh axes data=2 x expert=2 x tensor=2")):
    ParallelPlan.build(uneven, make_mesh(uneven.mesh))


def _h100_plan(hosts: int, kernel_backend: str = "auto") -> ParallelPlan:
  """moe_1b's widths on 16 deviceless H100s as tp_sp 1x4x4x1, the pallas tier, `hosts` processes."""
  from experiments.configs import moe_1b

  config = moe_1b.get_config()
  config.mesh = MeshConfig(data=1, expert=4, tensor=4, sequence=1, preset="tp_sp")
  config.parallel = ParallelConfig(impl="pallas", kernel_backend=kernel_backend)
  config.train.global_batch_size = 64
  devices = deviceless.gpu_devices(16, "h100_sxm", hosts)
  return ParallelPlan.build(config.validate(16), make_mesh(config.mesh, devices))


def test_fused_kernels_run_only_where_one_process_drives_their_ring():
  """Mosaic GPU's communicating kernels store into peers' memory: every device of a kernel's ring must be
  driven by one process. One process per node of 8 (hosts=2): the tensor rings (4 devices) stay inside a
  node and fuse, the MoE's ring over `expert` (4 x 4 = 16 devices, 2 nodes) does not; one process per GPU
  (hosts=16): nothing fuses. Each fallback names the ring and the processes; kernel_backend="mosaic_gpu"
  makes it one ConfigError."""
  per_node, per_gpu = _h100_plan(2), _h100_plan(16)
  assert (per_node.process_count, per_node.devices_per_process) == (2, 8)
  assert per_node.processes_per_ring(("tensor",)) == 1 and per_node.processes_per_ring(("expert",)) == 2
  assert per_gpu.processes_per_ring(("tensor",)) == 4 and per_gpu.processes_per_ring(("expert", "tensor")) == 16
  assert per_node.ops["attention.project_in"].implementation == "fused"
  assert per_node.ops["moe"].implementation == "all_to_all"
  assert ("its ring over expert (4 devices) spans 2 processes (8 device(s) each), and Mosaic GPU's communicating "
          "kernels need one process to drive every GPU of a ring") in per_node.ops["moe"].fallback
  for name in ("attention.project_in", "attention.project_out", "moe"):
    assert per_gpu.ops[name].implementation != "fused"
    assert "spans 4 processes (1 device(s) each)" in per_gpu.ops[name].fallback, name
  assert per_gpu.table().splitlines()[0].endswith("device(s) in 16 processes of 1")
  assert per_gpu.to_json()["processes"] == 16 and per_gpu.to_json()["devices_per_process"] == 1
  one = ParallelPlan.build(_config("ep"), make_mesh(_config("ep").mesh))
  assert one.table().splitlines()[0].endswith("device(s) in one process") and one.process_count == 1
  with pytest.raises(config_lib.ConfigError, match=(
      r"parallel.kernel_backend='mosaic_gpu' is invalid: a layout where the fused kernels run; project_in "
      r"\(all-gather GEMM\) cannot: its ring over tensor \(4 devices\) spans 4 processes")):
    _h100_plan(16, "mosaic_gpu")


def test_the_process_layout_a_config_needs_follows_the_tier_and_backend():
  assert plan_lib.process_layout(ParallelConfig(impl="pallas"))[0] == "node"
  assert plan_lib.process_layout(ParallelConfig(impl="pallas", kernel_backend="mosaic_gpu"))[0] == "node"
  assert plan_lib.process_layout(ParallelConfig(impl="pallas", kernel_backend="collectives"))[0] == "any"
  assert plan_lib.process_layout(ParallelConfig(impl="xla"))[0] == "any"
