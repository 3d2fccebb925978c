"""The MoE block against the naive per-token reference: forward and gradients, fp32, 1e-5 relative.

The block runs without a parallel plan (the platform's grouped GEMM) except in the cases that choose a
grouped GEMM, which run under a one-device plan that says so."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshmoe.config import MeshConfig, ModelConfig, MoEConfig, ParallelConfig
from meshmoe.models.layers import swiglu_hidden
from meshmoe.models.moe import MoEBlock
from meshmoe.sharding import grouped_ffn
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.shardings import use_plan
from tests import moe_reference
from tests.tolerances import FP32_MODULE_RTOL, assert_close

B, S, D, E = 2, 12, 16, 6

# The grouped GEMM is the parallel plan's choice (parallel.grouped_gemm): these cases run under a plan.
GEMMS = {
    "softmax_blocked": ParallelConfig(grouped_gemm="blocked"),
    "softmax_blocked_rows4": ParallelConfig(grouped_gemm="blocked", gemm_block_rows=4),
    "softmax_ragged_dot": ParallelConfig(grouped_gemm="ragged_dot"),
    "softmax_kernels": ParallelConfig(grouped_gemm="kernels"),
}

CASES = {
    "softmax_blocked": {},
    "softmax_blocked_rows4": {},
    "softmax_ragged_dot": {},
    "softmax_kernels": {},
    "sigmoid_scaled_unnormalised": dict(score_fn="sigmoid", normalize_top_k=False, routed_scaling=2.5),
    "sigmoid_normalised_shared": dict(score_fn="sigmoid", num_shared_experts=2, routed_scaling=2.5),
    "top1": dict(top_k=1),
    "top3_shared": dict(top_k=3, num_shared_experts=1),
    "capacity_drops": dict(capacity_factor=0.5),
    "capacity_roomy": dict(capacity_factor=4.0, top_k=3),
}

# Selection biases that make loads uneven: experts 4 and 5 never chosen, or expert 0 chosen by everyone.
BIASES = {
    "no_bias": None,
    "empty_experts": np.array([0.0, 0.0, 0.0, 0.0, -10.0, -10.0], np.float32),
    "one_hot_expert": np.array([10.0, 0.0, 0.0, 0.0, 0.0, 0.0], np.float32),
}


def _block(moe_overrides: dict, bias) -> MoEBlock:
  moe = MoEConfig(num_experts=E, expert_mlp_dim=8, expert_bias=bias is not None,
                  **{"top_k": 2, **moe_overrides})
  cfg = ModelConfig(embed_dim=D, init_std=0.3, moe=moe)
  block = MoEBlock(cfg, rngs=nnx.Rngs(0))
  if bias is not None:
    block.router.bias_E[...] = jnp.asarray(bias)
  return block


def _running_as(case: str):
  """The one-device plan a case's grouped GEMM asks for, or no plan at all."""
  if case not in GEMMS:
    return contextlib.nullcontext()
  mesh = make_mesh(MeshConfig(data=1, preset="dp"), jax.devices()[:1])
  return use_plan(ParallelPlan.for_mesh(mesh, "dp", GEMMS[case]))


def _reference_params(block: MoEBlock) -> dict:
  params = {"router": block.router.kernel_DE[...], "gate": block.gate_EDF[...], "up": block.up_EDF[...],
            "down": block.down_EFD[...]}
  if block.shared is not None:
    params.update(shared_gate=block.shared.gate_DF[...], shared_up=block.shared.up_DF[...],
                  shared_down=block.shared.down_FD[...])
  return params


def _reference_choices(block: MoEBlock, x_BSD) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per sequence: (expert choices [S, K], kept mask [S, K]), decided from concrete values."""
  bias = None if block.router.bias_E is None else block.router.bias_E[...]
  decisions = []
  for b in range(x_BSD.shape[0]):
    choices = moe_reference.choose_experts(x_BSD[b], block.router.kernel_DE[...], bias, block.cfg)
    decisions.append((choices, moe_reference.kept_mask(choices, block.cfg)))
  return decisions


def _reference_output(block: MoEBlock, params: dict, x_BSD, decisions) -> jax.Array:
  return jnp.stack([moe_reference.moe_forward(params, x_BSD[b], choices, kept, block.cfg)
                    for b, (choices, kept) in enumerate(decisions)])


@pytest.mark.parametrize("bias_name", list(BIASES))
@pytest.mark.parametrize("case", list(CASES))
def test_moe_block_matches_per_token_reference(case, bias_name):
  block = _block(CASES[case], BIASES[bias_name])
  x_BSD = jax.random.normal(jax.random.key(1), (B, S, D), jnp.float32)
  cotangent = jax.random.normal(jax.random.key(2), (B, S, D), jnp.float32)

  graphdef, params_state, others = nnx.split(block, nnx.Param, ...)

  def block_loss(params_state, x):
    with _running_as(case):
      y, _ = nnx.merge(graphdef, params_state, others)(x)
    return jnp.sum(y * cotangent), y

  (_, y), (grads_state, grad_x) = jax.jit(jax.value_and_grad(block_loss, argnums=(0, 1), has_aux=True))(
      params_state, x_BSD)

  ref_params = _reference_params(block)
  decisions = _reference_choices(block, x_BSD)

  def reference_loss(params, x):
    y = _reference_output(block, params, x, decisions)
    return jnp.sum(y * cotangent), y

  (_, y_ref), (ref_grads, ref_grad_x) = jax.value_and_grad(reference_loss, argnums=(0, 1), has_aux=True)(
      ref_params, x_BSD)

  assert_close(y, y_ref, FP32_MODULE_RTOL, "output")
  assert_close(grad_x, ref_grad_x, FP32_MODULE_RTOL, "grad input")
  grads = _reference_params(nnx.merge(graphdef, grads_state, others))
  for name in ref_grads:
    if name == "router" and block.cfg.top_k == 1 and block.cfg.normalize_top_k:
      # One weight renormalised over itself is exactly 1: the router gets no gradient through the output.
      # Both sides hold only rounding noise (~1e-7), so compare them with zero at the scale of the
      # gradients that do flow, not with each other.
      scale = max(float(jnp.max(jnp.abs(g))) for g in ref_grads.values())
      assert float(jnp.max(jnp.abs(grads[name]))) <= FP32_MODULE_RTOL * scale, "router gradient is not zero"
      continue
    assert_close(grads[name], ref_grads[name], FP32_MODULE_RTOL, f"grad {name}")


def test_capacity_counts_dropped_assignments():
  block = _block(dict(capacity_factor=0.5), BIASES["one_hot_expert"])
  x_BSD = jax.random.normal(jax.random.key(1), (B, S, D), jnp.float32)
  _, stats = block(x_BSD)
  expected = sum(int((~kept).sum()) for _, kept in _reference_choices(block, x_BSD))
  assert expected > 0  # the case is built so that expert 0 overflows
  np.testing.assert_allclose(float(stats.dropped_fraction), expected / (B * S * 2), rtol=1e-6)


def test_dropless_drops_nothing_and_counts_every_assignment():
  block = _block({}, BIASES["empty_experts"])
  _, stats = block(jax.random.normal(jax.random.key(3), (B, S, D), jnp.float32))
  assert float(stats.dropped_fraction) == 0.0
  np.testing.assert_array_equal(np.asarray(stats.load_E)[4:], [0.0, 0.0])
  assert float(jnp.sum(stats.load_E)) == B * S * 2


def test_blocked_gemm_executes_no_dense_expert_flops():
  """On CPU the default path must not compute every expert for every token (ragged_dot does)."""
  cfg = dataclasses.replace(MoEConfig(), num_experts=8, top_k=2, expert_mlp_dim=64)
  x = jnp.zeros((4, 64, 32), jnp.float32)
  experts = jnp.zeros((4, 64, 2), jnp.int32)
  weights = jnp.zeros((4, 64, 2), jnp.float32)
  w = grouped_ffn.ExpertWeights(jnp.zeros((8, 32, 64)), jnp.zeros((8, 32, 64)), jnp.zeros((8, 64, 32)))
  useful = 4 * 64 * cfg.top_k * 2 * 3 * 32 * 64
  flops = {}
  for impl in ("blocked", "ragged_dot"):
    fn = lambda x, e, g, w, impl=impl: grouped_ffn.moe_local(x, e, g, w, swiglu_hidden, impl)
    flops[impl] = jax.jit(fn).lower(x, experts, weights, w).compile().cost_analysis()["flops"]
  assert flops["blocked"] < 1.25 * useful, flops
  assert flops["ragged_dot"] > 4 * useful, flops  # XLA:CPU computes ragged_dot densely: why we avoid it
