"""On a real GPU: the kernels the GPU paths run, against independent references (marked `gpu`).

Every test here is marked `gpu` and skipped, with the reason, unless JAX's first device is a GPU: the
suite's CPU runs (tests/conftest.py sets JAX_PLATFORMS=cpu unless the environment names a platform)
collect and skip them. `experiments/benchmarks/gpu_measure.sh OUT --parts=tests` runs them on one GPU:

  JAX_PLATFORMS=cuda python -m pytest -m gpu tests/

(conftest's XLA flags, 8 simulated host devices, deviceless CUB mode and LLVM at -O0, only touch the CPU
platform or the quality of the GPU code, never results.)

- (a) the routed experts' grouped FFN (sharding/grouped_ffn.py) in bfloat16 with dropped rows (expert id
  E), by the plan's GPU grouped-GEMM kernels (per form, from the measured table), XLA's ragged_dot and the
  blocked GEMM, forward and gradients, against a float32 loop over experts written here (each expert's
  weight gradient on its own); dropped rows give exact zeros and get exact-zero gradients; the program
  really runs Mosaic GPU kernels; each form's chosen kernel at every shipped config's expert widths, on
  uneven groups (an empty one, a one-row one), against a float32 padded reference; and the MoE op the
  model calls (expert_parallel.moe_ffn, through moe_ffn_and_buffer_use) under a one-GPU plan, inside its shard_map;
- (b) causal GQA attention by the plan's GPU kernel (tokamax's flash attention, sharding/attention_kernels.py)
  in bfloat16, forward and dq/dk/dv, against context_parallel.causal_attention (the einsum path) in
  float32: the whole-sequence call, the blocked kinds (allgather, ring, zigzag ring: the kernel's block
  forward, merging by softmax statistics and block backward) on a one-GPU sequence axis, and the parallel
  op the model calls under a one-GPU plan;
- (c) one model: three train steps of a small bfloat16 MoE with every GPU kernel the plan picks (the
  grouped-GEMM kernels, flash attention) against the same steps with the blocked GEMM and einsum attention, in
  bfloat16 and in float32 (losses and gradient norms);
- (d) meshmoe's own Mosaic GPU kernels (pallas_kernels/) on a ring of one GPU, compiled and run for real
  rather than in the Mosaic GPU interpreter (tests/pallas_kernels/): the Comet MoE pair forward and
  gradients, the Flux pair forward and gradients, and the grouped weight gradient (Hopper only).

Tolerances (tests/tolerances.py): bfloat16 against float32, BF16_MODEL_RTOL for tensors and
BF16_LOSS_RTOL for a model's loss; a 16-bit kernel against XLA computing the same bfloat16 GEMMs,
one bfloat16 rounding (harness.BF16_RTOL); a float32 result of bfloat16 inputs, FP32_MODULE_RTOL.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshmoe.config import MeshConfig, ParallelConfig
from meshmoe.pallas_kernels import moe_routing, mosaic_tiles, sm_budget
from meshmoe.pallas_kernels.allgather_matmul import api as allgather_api
from meshmoe.pallas_kernels.grouped_weight_gradient import api as weight_gradient_api
from meshmoe.pallas_kernels.matmul_reducescatter import api as scatter_api
from meshmoe.pallas_kernels.moe_dispatch_gemm import api as dispatch_api
from meshmoe.pallas_kernels.moe_gemm_return import api as return_api
from meshmoe.sharding import context_parallel as cp
from experiments.benchmarks import gemm_cases
from meshmoe.sharding import expert_parallel, grouped_ffn
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import Hardware, ParallelPlan, attention_kernel, grouped_gemm, grouped_gemm_for
from meshmoe.sharding.shardings import use_plan
from meshmoe.training import train_step
from tests.tolerances import BF16_LOSS_RTOL, BF16_MODEL_RTOL, FP32_MODULE_RTOL, assert_close

# A 16-bit result rounds the float32 sum once: one bfloat16 unit in the last place of the largest entry
# (as tests/pallas_kernels/harness.py, not imported: it pulls in the CPU-only interpreters).
BF16_RTOL = 2.0**-7
# An expert's weight gradient against float32, by Frobenius norm: bfloat16 rounds the FFN's operands, hidden
# units and gradients (each ~2e-3 relative); a wrong tile or a missed group is 1e-1 or more.
PER_EXPERT_RTOL = 2e-2


def _first_device() -> jax.Device:
  return jax.devices()[0]


_ON_GPU = _first_device().platform == "gpu"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _ON_GPU, reason=f"needs a GPU: JAX's first device is {_first_device().platform} "
                                            "(run with JAX_PLATFORMS=cuda on a GPU machine)"),
]


def _hardware() -> Hardware:
  return Hardware.of(_first_device())


def _needs_hopper() -> None:
  hardware = _hardware()
  if not hardware.compute_capability.startswith("9."):
    pytest.skip(f"meshmoe's Mosaic GPU kernels are written for Hopper (9.x), not {hardware.describe()}")


def _mosaic_calls(compiled_text: str) -> int:
  return compiled_text.count('custom_call_target="mosaic_gpu')


def _one_device_mesh(name: str) -> Mesh:
  return Mesh(np.array(jax.devices()[:1]), (name,))


# (a) The grouped expert FFN ------------------------------------------------------------------------------

ROWS, D, F, E = 1024, 256, 256, 8
DROPPED = 0.1  # share of rows with expert id E (dropped assignments / padding): must give zeros


def _swiglu(gate, up):
  return jax.nn.silu(gate) * up


def ffn_case(seed: int = 0, rows: int = ROWS, d: int = D, f: int = F, e: int = E):
  """Expert ids with drops, one empty expert and uneven groups; x, cotangent in bfloat16; float32 weights
  that bfloat16 holds exactly (the model keeps float32 parameters and computes in bfloat16)."""
  rng = np.random.default_rng(seed)
  ids = rng.choice(e, rows, p=np.arange(1, e + 1) / np.arange(1, e + 1).sum())  # uneven groups
  ids[ids == 2] = 3  # expert 2 gets nothing
  ids[rng.random(rows) < DROPPED] = e
  keys = jax.random.split(jax.random.key(seed), 5)
  bf16_exact = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)
  x = jax.random.normal(keys[0], (rows, d), jnp.float32).astype(jnp.bfloat16)
  gate = bf16_exact(jax.random.normal(keys[1], (e, d, f), jnp.float32) / np.sqrt(d))
  up = bf16_exact(jax.random.normal(keys[2], (e, d, f), jnp.float32) / np.sqrt(d))
  down = bf16_exact(jax.random.normal(keys[3], (e, f, d), jnp.float32) / np.sqrt(f))
  ct = jax.random.normal(keys[4], (rows, d), jnp.float32).astype(jnp.bfloat16)
  return jnp.asarray(ids, jnp.int32), x, gate, up, down, ct


def reference_ffn(x_RD, ids_R, gate, up, down):
  """float32: for each expert, its FFN on every row, kept where the row belongs to it (no sorting)."""
  x_RD = x_RD.astype(jnp.float32)
  y_RD = jnp.zeros_like(x_RD)
  for e in range(gate.shape[0]):
    h = _swiglu(x_RD @ gate[e], x_RD @ up[e])
    y_RD = y_RD + jnp.where((ids_R == e)[:, None], h @ down[e], 0.0)
  return y_RD


def ffn_forward_and_grads(gemm: str, kernels, ids, x, gate, up, down, ct):
  """(y, (dx, dgate, dup, ddown)) of grouped_ffn by `gemm`, jitted; also the compiled program's text."""

  def run(x, gate, up, down, ct):
    fn = lambda x, gate, up, down: grouped_ffn.grouped_ffn(
        x, ids, grouped_ffn.ExpertWeights(gate, up, down), _swiglu, gemm, kernels=kernels)
    y, pullback = jax.vjp(fn, x, gate, up, down)
    return y, pullback(ct)

  compiled = jax.jit(run).lower(x, gate, up, down, ct).compile()
  return compiled(x, gate, up, down, ct), compiled.as_text()


def reference_forward_and_grads(ids, x, gate, up, down, ct):
  run = lambda x, gate, up, down: reference_ffn(x, ids, gate, up, down)
  y, pullback = jax.vjp(run, x.astype(jnp.float32), gate, up, down)
  return y, pullback(ct.astype(jnp.float32))


def check_ffn(gemm: str, kernels, seed: int = 0) -> str:
  """Compares grouped_ffn by `gemm` with the float32 reference; returns the compiled program's text."""
  ids, x, gate, up, down, ct = ffn_case(seed)
  (y, grads), text = ffn_forward_and_grads(gemm, kernels, ids, x, gate, up, down, ct)
  want_y, want_grads = jax.jit(reference_forward_and_grads)(ids, x, gate, up, down, ct)
  assert y.dtype == jnp.bfloat16
  assert_close(y.astype(jnp.float32), want_y, BF16_MODEL_RTOL, f"{gemm} output")
  for name, grad, want in zip(("x", "gate", "up", "down"), grads, want_grads):
    assert_close(grad.astype(jnp.float32), want, BF16_MODEL_RTOL, f"{gemm} d{name}")
  # Each expert's weight gradient on its own: a tensor-wide tolerance cannot see a lightly loaded expert.
  for name, grad, want in zip(("gate", "up", "down"), grads[1:], want_grads[1:]):
    for expert in range(gate.shape[0]):
      got, ref = np.asarray(grad[expert], np.float64), np.asarray(want[expert], np.float64)
      scale = np.linalg.norm(ref)
      error = np.linalg.norm(got - ref) / scale if scale else np.abs(got).max()  # no rows: exactly zero
      assert error <= PER_EXPERT_RTOL, f"{gemm} d{name} of expert {expert}: relative error {error:.3g}"
  dropped = np.asarray(ids) == gate.shape[0]
  assert dropped.any()
  np.testing.assert_array_equal(np.asarray(y, np.float32)[dropped], 0.0, err_msg=f"{gemm}: dropped rows' output")
  np.testing.assert_array_equal(np.asarray(grads[0], np.float32)[dropped], 0.0,
                                err_msg=f"{gemm}: dropped rows' gradient")
  return text


def _plan_kernels(d: int = D, f: int = F):
  hardware = _hardware()
  gemm, kernels, why_not = grouped_gemm_for("kernels", hardware, jnp.bfloat16, d, f)
  if kernels is None:
    pytest.skip(why_not)
  return kernels


# The kernels the plan must pick for bfloat16 at (D, F) on each GPU generation, written out: the measured
# table's fastest correct per form (experiments/benchmarks/RESULTS.md, 2026-11-27, H200).
EXPECTED_KERNELS = {"9.0": ("jax_mgpu", "jax_mgpu", "jax_mgpu")}


def test_the_plan_picks_the_kernels_written_out_for_this_gpu():
  hardware = _hardware()
  if hardware.compute_capability not in EXPECTED_KERNELS:
    pytest.skip(f"no expected kernels written out for compute capability {hardware.compute_capability}")
  kernels = _plan_kernels()
  assert tuple(c.implementation for c in kernels.candidates()) == EXPECTED_KERNELS[hardware.compute_capability]


def test_the_plan_s_grouped_gemm_kernels_ffn_matches_a_float32_loop_over_experts():
  kernels = _plan_kernels()
  text = check_ffn("kernels", kernels)
  # Forward: two grouped GEMMs; backward: input and weight gradients of each; Triton kernels are not Mosaic.
  mosaic = sum(c.implementation in ("jax_mgpu", "tokamax_mosaic", "meshmoe_mosaic") for c in kernels.candidates())
  assert _mosaic_calls(text) >= 2 * mosaic, f"the plan's kernels ({kernels.describe()}) did not run"


# Each form's chosen kernel alone at every shipped config's expert widths (rows cut to keep the test short),
# on uneven groups with an empty and a one-row group, against gemm_cases' float32 padded reference, per
# group. tokamax 0.0.17's Hopper weight gradient is 0.09-0.17 off here, every correct kernel 1.7e-3 (H200).
@pytest.mark.parametrize("config", list(gemm_cases.SHAPES))
@pytest.mark.parametrize("form", ["forward", "input_gradient", "weight_gradient"])
def test_each_form_s_chosen_kernel_matches_float32_at_every_shipped_shape(config, form):
  shape = gemm_cases.SHAPES[config]
  m, k, n, e = 4096, shape.k, shape.n, min(shape.experts, 32)
  candidate = getattr(_plan_kernels(shape.d_model, shape.expert_width), form)
  keys = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[1], (e, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[2], (m, n), jnp.float32).astype(jnp.bfloat16)
  a, b = {"forward": (x, w), "input_gradient": (dy, w), "weight_gradient": (x, dy)}[form]
  sizes = gemm_cases.group_sizes(e, m, uneven=True)
  got = jax.jit(candidate.fn())(a, b, jnp.asarray(sizes, jnp.int32))
  want = gemm_cases.padded_reference(form, a, b, sizes)
  error, why = gemm_cases.per_group_error(form, got, want, sizes)
  assert not why and error <= gemm_cases.GEMM_TOLERANCE, f"{candidate.name} {form} at {config}: {why or error}"


@pytest.mark.parametrize("gemm", ["ragged_dot", "blocked"])
def test_xla_grouped_ffns_match_a_float32_loop_over_experts(gemm):
  """The GEMMs the plan falls back to on GPUs: the same check, a control for the kernels' test."""
  check_ffn(gemm, None)


def moe_op_case(seed: int = 1, b: int = 2, s: int = 128, k: int = 2):
  """Tokens [B, S, D] in bfloat16, top-k expert ids [B, S, K] (some dropped: id E), float32 combine
  weights, the expert weights of ffn_case, and a cotangent."""
  ids, _, gate, up, down, _ = ffn_case(seed, rows=b * s * k)
  keys = jax.random.split(jax.random.key(seed + 100), 3)
  x = jax.random.normal(keys[0], (b, s, D), jnp.float32).astype(jnp.bfloat16)
  weights = jax.random.uniform(keys[1], (b, s, k), jnp.float32)
  ct = jax.random.normal(keys[2], (b, s, D), jnp.float32).astype(jnp.bfloat16)
  return x, ids.reshape(b, s, k), weights, grouped_ffn.ExpertWeights(gate, up, down), ct


def reference_moe(x_BSD, experts_BSK, weights_BSK, w: grouped_ffn.ExpertWeights):
  """float32: sum_k weight_k * FFN_{expert_k}(token), by the loop over experts of reference_ffn."""
  b, s, d = x_BSD.shape
  k = experts_BSK.shape[-1]
  token_A = jnp.arange(b * s * k) // k
  y_AD = reference_ffn(x_BSD.reshape(b * s, d)[token_A], experts_BSK.reshape(-1), w.gate_EDF, w.up_EDF, w.down_EFD)
  y_AD = y_AD * weights_BSK.reshape(-1)[:, None]
  return jnp.zeros((b * s, d), jnp.float32).at[token_A].add(y_AD).reshape(b, s, d)


def moe_op_forward_and_grads(plan, x, experts, weights, w, ct):
  """expert_parallel.moe_ffn (the op the model calls) under `plan`: output, d(x, combine weights, w)."""

  def run(x, weights, w, ct):
    def op(x, weights, w):
      with use_plan(plan):
        return expert_parallel.moe_ffn(x, experts, weights, w, _swiglu)
    y, pullback = jax.vjp(op, x, weights, w)
    return y, pullback(ct)

  return jax.jit(run)(x, weights, w, ct)


@pytest.mark.parametrize("preset", ["dp", "megascale"])
def test_the_moe_op_with_the_plan_s_grouped_gemm_matches_the_reference(preset):
  """The routed experts as the model runs them on one GPU (moe_1b's preset included): the plan's grouped
  GEMM for bfloat16 (the measured kernels) inside the op's shard_map, forward and gradients."""
  mesh = make_mesh(MeshConfig(data=1, expert=1, tensor=1, sequence=1, preset=preset), jax.devices()[:1])
  plan = ParallelPlan.for_mesh(mesh, preset, ParallelConfig(impl="xla"))
  x, experts, weights, w, ct = moe_op_case()
  choice = plan.expert_ffn(1, D, F, jnp.bfloat16)
  if _hardware().compute_capability in EXPECTED_KERNELS:
    assert choice.grouped_gemm == "kernels", choice
  y, grads = moe_op_forward_and_grads(plan, x, experts, weights, w, ct)
  f32 = lambda a: a.astype(jnp.float32)
  want, pullback = jax.vjp(reference_moe, f32(x), experts, weights, w)  # experts: integer, no gradient
  want_grads = pullback(f32(ct))
  want_grads = (want_grads[0], want_grads[2], want_grads[3])
  assert_close(f32(y), want, BF16_MODEL_RTOL, f"{choice.grouped_gemm} MoE output")
  for name, got, expected in zip(("x", "combine weights", "expert weights"), grads, want_grads):
    for leaf, leaf_want in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
      assert_close(f32(leaf), leaf_want, BF16_MODEL_RTOL, f"{choice.grouped_gemm} MoE d{name}")


# (b) Attention ---------------------------------------------------------------------------------------------


def _attention_kernel() -> str:
  kernel, why_not = attention_kernel("auto", _hardware())
  if not kernel:
    pytest.skip(why_not)
  return kernel


def attention_case(b: int, s: int, n: int, g: int, h: int, seed: int = 0):
  """q, k, v and the output cotangent in bfloat16 (GQA: n query heads, g key/value heads)."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, ct = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
                 for key, shape in zip(keys, ((b, s, n, h), (b, s, g, h), (b, s, g, h), (b, s, n, h))))
  return q, k, v, ct


def reference_attention(q, k, v, ct):
  """The einsum path in float32 over the whole sequence in order: output and input gradients."""
  f32 = lambda a: a.astype(jnp.float32)
  pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  out, pullback = jax.vjp(lambda q, k, v: cp.causal_attention(q, k, v, pos, pos), f32(q), f32(k), f32(v))
  return out, pullback(f32(ct))


def check_attention(out, grads, q, k, v, ct, what: str) -> None:
  want, want_grads = jax.jit(reference_attention)(q, k, v, ct)
  assert out.dtype == q.dtype, what
  assert_close(out.astype(jnp.float32), want, BF16_MODEL_RTOL, f"{what} output")
  for name, grad, want_grad in zip("qkv", grads, want_grads):
    assert_close(grad.astype(jnp.float32), want_grad, BF16_MODEL_RTOL, f"{what} d{name}")


def local_attention(kernel: str, q, k, v, ct):
  """sharded_attention's `local` implementation with `kernel`: the whole sequence, rows in order."""
  pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])

  def run(q, k, v, ct):
    attend = lambda q, k, v: cp.sharded_attention(q, k, v, pos, implementation="local", axis_names=(), kernel=kernel)
    out, pullback = jax.vjp(attend, q, k, v)
    return out, pullback(ct)

  compiled = jax.jit(run).lower(q, k, v, ct).compile()
  return compiled(q, k, v, ct), compiled.as_text()


def blocked_attention(kind: str, kernel: str, q, k, v, ct):
  """sharded_attention's blocked kinds on a sequence axis of one device: the kernel's blocks (diagonal and
  full), merged by their softmax statistics, and the block backward."""
  mesh = _one_device_mesh("seq")
  spec = P(None, "seq")
  pos = jnp.broadcast_to(jnp.asarray(cp.zigzag_order(q.shape[1], 1)), q.shape[:2])
  attend = jax.shard_map(
      lambda q, k, v, pos: cp.sharded_attention(q, k, v, pos, implementation=kind, axis_names=("seq",), kernel=kernel),
      mesh=mesh, in_specs=(spec,) * 4, out_specs=spec, check_vma=not kernel)

  def run(q, k, v, ct):
    out, pullback = jax.vjp(lambda q, k, v: attend(q, k, v, pos), q, k, v)
    return out, pullback(ct)

  return jax.jit(run)(q, k, v, ct)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attention_matches_the_einsum_reference(head_dim):
  kernel = _attention_kernel()
  q, k, v, ct = attention_case(2, 1024, 8, 2, head_dim)
  (out, grads), text = local_attention(kernel, q, k, v, ct)
  check_attention(out, grads, q, k, v, ct, f"{kernel} h={head_dim}")
  if kernel == "mosaic":
    assert _mosaic_calls(text) >= 2, "forward and backward must be Mosaic GPU kernels"


@pytest.mark.parametrize("kind", ["allgather", "ring", "zigzag_ring"])
def test_flash_attention_blocks_match_the_einsum_reference(kind):
  kernel = _attention_kernel()
  q, k, v, ct = attention_case(2, 512, 8, 2, 64, seed=1)
  out, grads = blocked_attention(kind, kernel, q, k, v, ct)
  check_attention(out, grads, q, k, v, ct, f"{kind} ({kernel})")


@pytest.mark.parametrize("preset", ["dp", "megascale"])
def test_the_attention_op_runs_the_plan_s_kernel(preset):
  """context_parallel.attention, the op the model calls, under the plan of one GPU (moe_1b's heads). Under
  `dp` the sequence is whole (`local`: one kernel call); under `megascale` (moe_1b's preset) attention is
  sequence parallel over axes of size 1 here, its blocked implementation over one device."""
  kernel = _attention_kernel()
  mesh = make_mesh(MeshConfig(data=1, expert=1, tensor=1, sequence=1, preset=preset), jax.devices()[:1])
  plan = ParallelPlan.for_mesh(mesh, preset, ParallelConfig(impl="xla"))
  q, k, v, ct = attention_case(2, 1024, 16, 4, 64, seed=2)
  choice = plan.attention(q.dtype, q.shape[-1])
  assert choice.kernel_backend == kernel, choice
  if preset == "dp":
    assert choice.implementation == "local", choice
  order = plan.sequence_order(q.shape[1])
  order = np.arange(q.shape[1]) if order is None else order  # the identity on one device
  pos = jnp.broadcast_to(jnp.asarray(order), q.shape[:2])

  def run(q, k, v, ct):
    with use_plan(plan):
      out, pullback = jax.vjp(lambda q, k, v: cp.attention(q, k, v, pos), q, k, v)
    return out, pullback(ct)

  out, grads = jax.jit(run)(q, k, v, ct)
  check_attention(out, grads, q, k, v, ct, f"attention op ({preset}: {choice.implementation})")


# (c) A model's train steps ---------------------------------------------------------------------------------


def small_bf16_config(dtype: str, grouped_gemm: str, attention: str):
  """tiny_moe on one device, bf16-kernel friendly (widths multiples of 8, head_dim 64). Every token takes
  every expert (top_k = E): a top-2 choice could flip on a bfloat16 near-tie between the two runs, a
  discrete difference no tolerance describes (as tests/test_step.py)."""
  from experiments.configs import tiny_moe

  config = tiny_moe.get_config()
  config.mesh = MeshConfig(data=1, expert=1, tensor=1, sequence=1, preset="dp")
  config.model.dtype = dtype
  config.model.head_dim = 64
  config.model.moe.top_k = config.model.moe.num_experts
  config.parallel = ParallelConfig(impl="xla", grouped_gemm=grouped_gemm, attention_kernel=attention)
  config.train.global_batch_size, config.train.seq_len = 8, 128
  config.optimizer.warmup_steps = 0
  return config


def run_steps(config, steps: int = 3):
  """(losses, gradient norms, the plan) of `steps` train steps on the first device, a fixed batch."""
  plan = ParallelPlan.build(config, make_mesh(config.mesh, jax.devices()[:1]))
  trainer, state = train_step.create(config, plan)
  rng = np.random.default_rng(0)
  b, s = config.train.global_batch_size, config.train.seq_len
  losses, norms = [], []
  for _ in range(steps):
    tokens = rng.integers(0, config.model.vocab_size, (b, s + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((b, s), np.float32)}
    state, metrics = trainer.train_step(state, train_step.place_batch(batch, config, plan))
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  return np.array(losses), np.array(norms), plan


def test_train_steps_with_the_gpu_kernels_match_the_xla_paths():
  with_kernels = run_steps(small_bf16_config("bfloat16", "auto", "auto"))
  plan = with_kernels[2]
  moe, attention = plan.ops["moe"], plan.ops["attention"]
  if _hardware().compute_capability in EXPECTED_KERNELS:
    assert moe.grouped_gemm == "kernels", moe
  assert attention.kernel_backend == attention_kernel("auto", _hardware())[0], attention
  for name, (dtype, gemm, attn) in {"bf16 blocked/einsum": ("bfloat16", "blocked", "einsum"),
                                    "f32 blocked/einsum": ("float32", "blocked", "einsum")}.items():
    losses, norms, _ = run_steps(small_bf16_config(dtype, gemm, attn))
    for step in range(len(losses)):
      assert_close(with_kernels[0][step], losses[step], BF16_LOSS_RTOL, f"loss at step {step + 1} vs {name}")
      assert_close(with_kernels[1][step], norms[step], BF16_MODEL_RTOL, f"grad norm at step {step + 1} vs {name}")


# (d) meshmoe's Mosaic GPU kernels on a ring of one GPU -------------------------------------------------------

TM = 64  # the kernels' block_m: the tile plan's rows per tile


def _on_ring(fn, in_specs, out_specs):
  """fn under jit(shard_map) over a ring of one GPU ("x"), varying-axis checks on (compiled kernels)."""
  return jax.jit(jax.shard_map(fn, mesh=_one_device_mesh("x"), in_specs=in_specs, out_specs=out_specs,
                               check_vma=True))


def _num_sms() -> int:
  return sm_budget.device_sms()


def _moe_layer(backend: str, num_sms: int, e_local: int, swiglu: str | None = None,
               tiles: mosaic_tiles.Tiles = mosaic_tiles.DEFAULT_TILES):
  """With `swiglu` (the gradient's mode), SwiGLU fused into the dispatch kernel; else between the kernels."""
  def layer(x_TD, experts_TK, gate, up, down):
    t, k = experts_TK.shape
    token_A = jnp.arange(t * k) // k
    tm = tiles.block_m  # the kernels' tile height is the plan's
    plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("x",), e_local, tm)
    options = dict(backend=backend, num_sms=num_sms, tiles=tiles)  # the reference ignores the tiles
    if swiglu:
      h = dispatch_api.dispatch_swiglu(x_TD[token_A], gate, up, plan, "x", tile_rows=tm, gradient=swiglu, **options)
    else:
      g, u = dispatch_api.dispatch_gemm(x_TD[token_A], (gate, up), plan, "x", tile_rows=tm, **options)
      h = jax.nn.silu(g) * u
    y_AD = return_api.gemm_return((h,), (down,), plan, "x", **options)
    return jnp.zeros((t, y_AD.shape[1]), jnp.float32).at[token_A].add(y_AD.astype(jnp.float32))

  return layer


# One warpgroup per block on 64 x 128 tiles, and warp-specialised on Hopper's 128 x 256 (a producer, two consumers).
LAYOUTS = pytest.mark.parametrize("tiles", [mosaic_tiles.DEFAULT_TILES, mosaic_tiles.HOPPER_TILES],
                                  ids=["one-warpgroup", "warp-specialised"])


@LAYOUTS
@pytest.mark.parametrize("swiglu", [None, "recompute", "keep"])
def test_comet_moe_kernels_forward_and_gradients_on_one_gpu(swiglu, tiles):
  _needs_hopper()
  tokens, top_k, d, f, e_local = 256, 2, 256, 256, 4
  rng = np.random.default_rng(3)
  experts = rng.integers(0, e_local, (tokens, top_k)).astype(np.int32)
  experts[:20] = e_local  # dropped
  experts[experts == 1] = 2  # an empty expert
  keys = jax.random.split(jax.random.key(4), 5)
  x = jax.random.normal(keys[0], (tokens, d), jnp.float32).astype(jnp.bfloat16)
  gate, up = ((jax.random.normal(key, (e_local, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
              for key in keys[1:3])
  down = (jax.random.normal(keys[3], (e_local, f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
  ct = jax.random.normal(keys[4], (tokens, d), jnp.float32)

  def forward_and_grads(backend):
    def per_device(x, experts, gate, up, down, ct):
      layer = _moe_layer(backend, _num_sms(), e_local, swiglu if backend == "mosaic_gpu" else None, tiles)
      out, pullback = jax.vjp(lambda x, g, u, dn: layer(x, experts, g, u, dn), x, gate, up, down)
      return out, pullback(ct)
    spec = P("x")
    return _on_ring(per_device, (spec,) * 6, (spec, (spec,) * 4))

  args = (x, experts, gate, up, down, ct)
  compiled = forward_and_grads("mosaic_gpu").lower(*args).compile()
  # Two kernels forward; backward two kernels, three weight gradients and with "recompute" the SwiGLU gradient.
  assert _mosaic_calls(compiled.as_text()) >= (8 if swiglu == "recompute" else 7)
  got_out, got_grads = compiled(*args)
  want_out, want_grads = forward_and_grads("collectives")(*args)
  assert_close(got_out, want_out, BF16_MODEL_RTOL, "MoE layer output")
  for name, got, want in zip(("x", "gate", "up", "down"), got_grads, want_grads):
    assert_close(got.astype(jnp.float32), want.astype(jnp.float32), BF16_MODEL_RTOL, f"MoE layer d{name}")


@LAYOUTS
def test_flux_kernels_forward_and_gradients_on_one_gpu(tiles):
  _needs_hopper()
  m, k, n = 256, 256, 512
  keys = jax.random.split(jax.random.key(5), 5)
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  y = jax.random.normal(keys[1], (1, m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[2], (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  d_gathered = jax.random.normal(keys[3], (1, m, n), jnp.float32).astype(jnp.bfloat16)
  d_scattered = jax.random.normal(keys[4], (m, n), jnp.float32).astype(jnp.bfloat16)
  spec = P("x")

  def forward_and_vjp(op, backend):
    def per_device(a, w, dout):
      out, pullback = jax.vjp(lambda a, w: op(a, w, "x", backend=backend, num_sms=_num_sms(), tiles=tiles), a, w)
      return out, pullback(dout)
    # Every operand split over the ring (of one): the weight too, as in tests/pallas_kernels/test_flux.py.
    return _on_ring(per_device, (spec,) * 3, (spec, (spec, spec)))

  for op, a, dout in ((allgather_api.allgather_matmul, x, d_gathered),
                      (scatter_api.matmul_reducescatter, y, d_scattered)):
    got_out, got_grads = forward_and_vjp(op, "mosaic_gpu")(a, w, dout)
    want_out, want_grads = forward_and_vjp(op, "collectives")(a, w, dout)
    f32 = lambda t: t.astype(jnp.float32)
    assert_close(f32(got_out), f32(want_out), BF16_RTOL, f"{op.__name__} output")
    for name, got, want in zip(("input", "weight"), got_grads, want_grads):
      assert_close(f32(got), f32(want), BF16_RTOL, f"{op.__name__} {name} gradient")


@pytest.mark.parametrize("consumers", [1, 2], ids=["one-warpgroup", "warp-specialised"])
@pytest.mark.parametrize("tiles_per_expert", [[2, 0, 3], [1, 1, 1, 1, 1]], ids=["gap", "even"])
def test_grouped_weight_gradient_kernel_on_one_gpu(tiles_per_expert, consumers):
  """One warpgroup on 64 x 128 tiles, and warp-specialised on Hopper's 128 x 256 (a producer, two consumers)."""
  _needs_hopper()
  tiles = mosaic_tiles.DEFAULT_TILES if consumers == 1 else mosaic_tiles.HOPPER_TILES
  d, f = 128, 256
  rows = np.asarray(tiles_per_expert) * TM
  total = int(rows.sum()) + 2 * TM  # rows after the last group: ignored
  keys = jax.random.split(jax.random.key(6), 2)
  x = jax.random.normal(keys[0], (total, d), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(keys[1], (total, f), jnp.float32).astype(jnp.bfloat16)
  like = jnp.zeros((len(rows), d, f), jnp.float32)
  got = jax.jit(functools.partial(weight_gradient_api.weight_gradient, tile_rows=TM, backend="mosaic_gpu",
                                  num_sms=_num_sms(), tiles=tiles)
                )(x, dy, jnp.asarray(rows, jnp.int32), like)
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  starts = np.cumsum(rows) - rows
  want = np.stack([x64[s:s + r].T @ dy64[s:s + r] for s, r in zip(starts, rows)])
  # float32 output of bfloat16 inputs: only the summation order differs from float64.
  assert_close(got, want, FP32_MODULE_RTOL, "grouped weight gradient")
