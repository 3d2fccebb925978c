"""The whole model's loss and gradients on many mesh layouts equal the single-device result (1e-4)."""

import jax
import numpy as np
import pytest
from flax import nnx

from meshmoe.config import Config, MeshConfig, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from meshmoe.training import model_state
from tests.model_steps import init_model, make_loss_and_grad, plan_for, synthetic_batch
from tests.tolerances import FP32_MODEL_RTOL, assert_close


def small_config(heads: tuple[int, int] = (4, 2), **moe_overrides) -> Config:
  """Every feature on: a dense first layer, shared experts, untied output, divisible on every layout.
  `heads` = (query heads, key/value heads)."""
  moe = MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=32, num_shared_experts=1, **moe_overrides)
  return Config(
      model=ModelConfig(vocab_size=64, embed_dim=32, num_layers=2, num_dense_layers=1, num_heads=heads[0],
                        num_kv_heads=heads[1], head_dim=8, mlp_dim=64, max_seq_len=16, tie_embeddings=False,
                        init_std=0.1, moe=moe),
      train=TrainConfig(global_batch_size=8, seq_len=16, seed=3),
  )


# One compile of the sharded loss and gradients per case (10-35 s on 2 cores): each case adds a layout no
# other case in this file runs. Here: ep over 8 (tiny_moe's own layout), zero1 (for loss and gradients the
# `dp` placement: parameters whole, the batch over every axis), fsdp over three axes, megascale with `tensor`
# and `sequence` split. The rest of the layouts run in the families below, with one more feature each:
# dp 8x1x1x1 (FLASH_LAYOUTS), megascale 2x2x1x2 all-gather (FLASH_LAYOUTS; the einsum all-gather blocks run
# on megascale 1x2x2x2 here), tp_sp 2x2x2x1 (TWO_HALVES_LAYOUTS, the sigmoid test, STORAGE_LAYOUTS), ep 2x4
# (STORAGE_LAYOUTS), tp_sp 2x1x2x2 and megascale 1x2x1x4 (ATTENTION_LAYOUTS, FLASH_LAYOUTS), megascale
# 1x4x2x1 (TWO_HALVES_LAYOUTS); tp_sp 1x4x2x1 is tp_sp 2x2x2x1's program with the experts over 4, and fsdp
# 8x1x1x1 is fsdp 2x2x2x1's (every axis splits the batch and `embed` alike).
# (data, expert, tensor, sequence), preset
LAYOUTS = [
    ((1, 8, 1, 1), "ep"),
    ((4, 2, 1, 1), "zero1"),
    ((2, 2, 2, 1), "fsdp"),
    ((1, 2, 2, 2), "megascale"),
]


def _loss_and_grads(config: Config, devices) -> tuple[float, dict]:
  config.validate(len(devices))
  plan = plan_for(config, devices)
  model = init_model(config, plan)
  _, params, others = nnx.split(model, nnx.Param, ...)
  inputs, targets = synthetic_batch(config, plan, seed=7)
  loss, _, grads = make_loss_and_grad(model, config, plan)(params, others, inputs, targets)
  return float(loss), {path: np.asarray(v) for path, v in nnx.to_flat_state(grads)}


_REFERENCE: dict[str, tuple[float, dict]] = {}


def _single_device(variant: str, config: Config) -> tuple[float, dict]:
  if variant not in _REFERENCE:
    config.mesh = MeshConfig(data=1, preset="dp")
    _REFERENCE[variant] = _loss_and_grads(config, jax.devices()[:1])
  return _REFERENCE[variant]


def _check_layout(variant: str, moe_overrides: dict, sizes, preset, attention: str = "allgather",
                  heads: tuple[int, int] = (4, 2), parallel: ParallelConfig | None = None,
                  weight_storage: str = "preset", expert_axes: str = "preset", expert_width_axes: str = "preset"):
  ref_loss, ref_grads = _single_device(variant, small_config(heads, **moe_overrides))
  config = small_config(heads, **moe_overrides)
  data, expert, tensor, sequence = sizes
  config.mesh = MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset,
                           weight_storage=weight_storage, expert_axes=expert_axes,
                           expert_width_axes=expert_width_axes)
  config.parallel = parallel or ParallelConfig(attention=attention)
  loss, grads = _loss_and_grads(config, jax.devices())
  assert_close(loss, ref_loss, FP32_MODEL_RTOL, "loss")
  assert grads.keys() == ref_grads.keys()
  for path in ref_grads:
    assert_close(grads[path], ref_grads[path], FP32_MODEL_RTOL, f"grad {'/'.join(map(str, path))}")


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,storage", [((2, 2, 1, 2), "megascale", "preset"), ((2, 2, 2, 1), "tp_sp", "all")])
def test_sharded_initialiser_creates_the_single_device_values_in_place(sizes, preset, storage):
  """model_state.init_model, jitted with the plan's shardings as outputs, gives every variable bit for bit
  the values of the model created on one device, each already split as the plan says (the other tests
  place the one-device values instead: tests/model_steps.py init_model)."""
  config = small_config()
  config.mesh = MeshConfig(data=1, preset="dp")
  one_device = nnx.state(model_state.init_model(config, plan_for(config, jax.devices()[:1])))
  data, expert, tensor, sequence = sizes
  config.mesh = MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset,
                           weight_storage=storage)
  plan = plan_for(config)
  state = nnx.state(model_state.init_model(config, plan))
  want_shardings = plan.param_shardings(state)
  got, want = nnx.to_flat_state(state), dict(nnx.to_flat_state(one_device))
  assert [path for path, _ in got] == list(want)
  for (path, variable), sharding in zip(got, jax.tree.leaves(want_shardings), strict=True):
    assert variable[...].sharding.is_equivalent_to(sharding, variable[...].ndim), path
    np.testing.assert_array_equal(np.asarray(variable[...]), np.asarray(want[path][...]), err_msg=str(path))


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset", LAYOUTS, ids=[f"{p}-{'x'.join(map(str, s))}" for s, p in LAYOUTS])
def test_dropless_model_matches_single_device(sizes, preset):
  _check_layout("dropless", {}, sizes, preset)


# Weights stored split over `data` ("data") or over every axis the preset leaves them on ("all"; rules.py
# with_storage), gathered per layer where the ops use them. (mesh sizes, preset, weight storage, tier)
# megascale 2x2x1x2 and tp_sp 2x2x2x1 with the reference tier under both storages are test_step.py's
# whole optimizer steps against one device (test_weight_storage_step_matches_single_device), not repeated.
# Each storage on each tier: "all" on ep 2x4 (also the plain ep 2x4 reference layout: experts over 4 with
# data replicas) and on the pallas tier's tp_sp 2x2x2x1 (also that layout's plain pallas case), "data" on
# the xla tier and on the pallas tier's ep 2x4 (also its plain pallas case). "data" on zero1 4x2x1x1 is
# fsdp's `embed` split over `data` alone, which megascale's and ep's "data" cases gather too.
STORAGE_LAYOUTS = [((2, 4, 1, 1), "ep", "all", "reference"),
                   ((2, 2, 1, 2), "megascale", "data", "xla"), ((2, 2, 2, 1), "tp_sp", "all", "pallas"),
                   ((2, 4, 1, 1), "ep", "data", "pallas")]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,storage,impl", STORAGE_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}-{w}-{i}" for s, p, w, i in STORAGE_LAYOUTS])
def test_weight_storage_matches_single_device(sizes, preset, storage, impl):
  _check_layout("dropless", {}, sizes, preset, weight_storage=storage,
                parallel=ParallelConfig(impl=impl, kernel_backend="collectives"))


# MoE parallel folding (sharding/rules.py fold_experts): the experts over mesh axes of their own, apart from
# attention's use of them. (mesh sizes, preset, expert axes, expert width axes, tier, weight storage)
# - tp_sp 2x2x2x1, experts over expert x tensor, whole (expert parallelism over the devices attention splits
#   by heads; no gather of the sequence for the MoE), reference tier;
# - ep 2x4x1x1, experts over data x expert (one whole expert per device, no replicas), xla tier's pipeline,
#   with every other weight stored split over every axis (DeepSeek-V3's planned layout, in small);
# - megascale 1x2x2x2, experts over expert x sequence with their width over tensor, the pallas tier's MoE
#   kernels (their plain-collective versions) over two axes.
FOLDED_LAYOUTS = [((2, 2, 2, 1), "tp_sp", "expert,tensor", "preset", "reference", "preset"),
                  ((2, 4, 1, 1), "ep", "data,expert", "preset", "xla", "all"),
                  ((1, 2, 2, 2), "megascale", "expert,sequence", "tensor", "pallas", "preset")]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,experts,width,impl,storage", FOLDED_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}-{e}-{i}" for s, p, e, _, i, _ in FOLDED_LAYOUTS])
def test_folded_experts_match_single_device(sizes, preset, experts, width, impl, storage):
  _check_layout("dropless", {}, sizes, preset, weight_storage=storage, expert_axes=experts,
                expert_width_axes=width, parallel=ParallelConfig(impl=impl, kernel_backend="collectives"))


@pytest.mark.slow
def test_a_folding_that_places_like_a_preset_runs_bitwise_the_same():
  """The experts folded over `data` on an 8 x 1 mesh hold the same experts on the same devices as `ep`'s own
  placement over `expert` on 1 x 8 (the batch is over every axis either way): the same program over other
  axis names, so the same losses and gradients bit for bit."""
  def run(sizes, expert_axes):
    config = small_config()
    config.mesh = MeshConfig(**dict(zip(("data", "expert", "tensor", "sequence"), sizes)), preset="ep",
                             expert_axes=expert_axes)
    return _loss_and_grads(config, jax.devices())

  own_loss, own = run((1, 8, 1, 1), "preset")
  folded_loss, folded = run((8, 1, 1, 1), "data")
  assert folded_loss == own_loss
  assert folded.keys() == own.keys()
  for path in own:
    np.testing.assert_array_equal(folded[path], own[path], err_msg=str(path))


# Context-parallel attention kinds other than the default all-gather, on layouts that split the sequence,
# with the einsum blocks: the ring over all 8 devices (megascale 1x2x1x4), Ulysses on tp_sp (sequence only)
# and on megascale with the heads also split over `tensor` (2x1x2x2). The ring on tp_sp 2x1x2x2 and Ulysses
# on megascale 2x2x1x2 are FLASH_LAYOUTS' cases (the same exchanges; blocks by the kernel path), and the
# ring's einsum blocks run here; megascale 2x2x1x2's ring is the same ring as 1x2x1x4's, over 4.
ATTENTION_LAYOUTS = [
    ((1, 2, 1, 4), "megascale", "ring"), ((4, 1, 1, 2), "tp_sp", "ulysses"), ((2, 1, 2, 2), "megascale", "ulysses"),
]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,attention", ATTENTION_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}-{a}" for s, p, a in ATTENTION_LAYOUTS])
def test_context_parallel_kinds_match_single_device(sizes, preset, attention):
  # Ulysses splits the key/value heads over the sequence devices too: 8 query and 4 key/value heads.
  heads = (8, 4) if attention == "ulysses" else (4, 2)
  _check_layout("dropless" if heads == (4, 2) else "more_heads", {}, sizes, preset, attention, heads)


# Attention's blocks by the kernel path (sharding/attention_kernels.py; tokamax's XLA version on CPU): the
# blocks, their merging and their custom backward inside the whole model, against the einsum path on one
# device. (mesh sizes, preset, attention kind, tier) Every kind: local (dp, also this file's only dp case),
# all-gather and Ulysses on megascale 2x2x1x2 (also that layout's plain reference case), the reference ring
# on tp_sp 2x1x2x2 and the xla tier's zigzag ring on megascale 1x2x1x4.
FLASH_LAYOUTS = [((8, 1, 1, 1), "dp", "allgather", "reference"), ((2, 2, 1, 2), "megascale", "allgather", "reference"),
                 ((1, 2, 1, 4), "megascale", "ring", "xla"), ((2, 1, 2, 2), "tp_sp", "ring", "reference"),
                 ((2, 2, 1, 2), "megascale", "ulysses", "reference")]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,attention,impl", FLASH_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}-{a}-{i}" for s, p, a, i in FLASH_LAYOUTS])
def test_attention_kernel_path_matches_single_device(sizes, preset, attention, impl):
  heads = (8, 4) if attention == "ulysses" else (4, 2)
  _check_layout("dropless" if heads == (4, 2) else "more_heads", {}, sizes, preset, heads=heads,
                parallel=ParallelConfig(impl=impl, attention=attention, attention_kernel="tokamax"))


# Capacity drops (per sequence) on the reference tier where the sequence is split over all 8 devices. The
# other capacity cases: the batch split alone (ep 2x4 on the pallas tier, with warp-specialized tiles,
# below), the sequence gathered over `tensor` for the MoE (tp_sp 2x2x2x1 on the reference tier: the sigmoid
# test), megascale 2x2x1x2 (xla tier, two halves: TWO_HALVES_LAYOUTS).
@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset", [((1, 2, 1, 4), "megascale")])
def test_capacity_model_matches_single_device(sizes, preset):
  _check_layout("capacity", {"capacity_factor": 0.75}, sizes, preset)


@pytest.mark.slow
def test_sigmoid_bias_ragged_dot_model_with_capacity_matches_single_device():
  """Sigmoid scores with a selection bias and routed scaling, XLA's ragged dot, and capacity drops (which
  the biased scores order) on tp_sp 2x2x2x1, whose MoE gathers the sequence over `tensor`."""
  overrides = {"score_fn": "sigmoid", "expert_bias": True, "routed_scaling": 2.0, "capacity_factor": 0.75}
  _check_layout("sigmoid_capacity", overrides, (2, 2, 2, 1), "tp_sp",
                parallel=ParallelConfig(grouped_gemm="ragged_dot"))


# The pallas tier's data layouts (the MoE tile plan, the collective GEMMs' row blocks and concatenated
# weights, the custom gradients' plumbing) with each kernel replaced by its plain-collective reference:
# the same layouts the Mosaic GPU kernels use on GPUs, checked on CPU. Its plain layouts run in other
# families, each with one more feature: tp_sp 2x2x2x1 (fused projections and MoE kernels) and ep 2x4 (MoE
# kernels over 4) in STORAGE_LAYOUTS, megascale 1x4x2x1 in TWO_HALVES_LAYOUTS; ep 2x4 here with the two
# features below (one compile).


@pytest.mark.slow
def test_pallas_tier_with_warp_specialized_tiles_and_capacity_drops_matches_single_device():
  """`parallel.kernel_tiles="warp_specialized"`: the MoE tile plan in the kernels' 128-row tiles, with
  capacity drops (dropped assignments never sent or computed) in those tiles."""
  _check_layout("capacity", {"capacity_factor": 0.75}, (2, 4, 1, 1), "ep", parallel=ParallelConfig(
      impl="pallas", kernel_backend="collectives", kernel_tiles="warp_specialized"))


# The two-halves layer schedule (models/decoder.py): each device's rows cut in two halves whose attention and
# MoE alternate, against the sequential single-device model. Every tier (reference on tp_sp 2x2x2x1, pallas on
# megascale 1x4x2x1, also the pallas tier's plain case of that layout), with and without capacity drops
# (capacity is per sequence, so halves of the rows drop what the whole batch drops; the xla tier's case has
# them, and covers megascale 2x2x1x2 on the xla tier without them).
TWO_HALVES_LAYOUTS = [((2, 2, 2, 1), "tp_sp", "reference", {}),
                      ((1, 4, 2, 1), "megascale", "pallas", {}),
                      ((2, 2, 1, 2), "megascale", "xla", {"capacity_factor": 0.75})]


@pytest.mark.slow
@pytest.mark.parametrize("sizes,preset,impl,moe", TWO_HALVES_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}-{i}{'-capacity' if m else ''}"
                              for s, p, i, m in TWO_HALVES_LAYOUTS])
def test_two_halves_layer_schedule_matches_single_device(sizes, preset, impl, moe):
  parallel = ParallelConfig(impl=impl, kernel_backend="collectives", layer_schedule="two_halves")
  _check_layout("capacity" if moe else "dropless", moe, sizes, preset, parallel=parallel)
