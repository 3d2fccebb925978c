"""Low-precision MoE exchanges (sharding/exchange_formats.py) on 8 CPU devices.

- float8 encoding: every element within the stated bound, the payload's layout and size, zeros to zeros;
- FP8 dispatch equals the one-device MoE fed the dequantised tokens, output and every gradient (the
  reference's input gradient is taken at the dequantised point: the straight-through rule), on every
  expert-parallel layout, and its input gradient matches finite differences of that dequantised op;
- low-precision combine: within the bound (summed over a token's rows) of the exact op; float8 backward
  exchanges: the gradient of a reference that quantises the same cotangent rows;
- the ragged exchange (GPU, emulated) gives what the padded one gives with float8 both ways;
- the compiled exchanges move the wire format's bytes, and the plan's choices, notices and errors.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshmoe.analysis import hlo_collectives
from meshmoe.config import ConfigError, ParallelConfig
from meshmoe.models.layers import swiglu_hidden
from meshmoe.sharding import exchange_formats, expert_parallel, grouped_ffn
from meshmoe.sharding.plan import Hardware, ParallelPlan
from tests.test_expert_parallel import (B, K, S, _emulated_ragged_all_to_all, _inputs, _sharded, assert_matches,
                                        local_moe, output_and_grads, sharded_op)
from tests.tolerances import FP32_MODULE_RTOL

FP8 = "float8_e4m3fn"
# The float8 bound is computed in float32: its own rounding, and float32's in the scale division and the
# dequantising product, are a few 2^-24 relative (module docstring).
BOUND_SLACK = 1 + 2.0**-18


def _quantised(x_RD):
  return exchange_formats.decode(exchange_formats.encode(x_RD, FP8), FP8, x_RD.shape[-1], x_RD.dtype)


@pytest.mark.parametrize("width", [16, 128, 200, 384])
def test_float8_rows_are_within_the_bound(width):
  keys = jax.random.split(jax.random.key(width), 2)
  # Rows of very different magnitudes, blocks with one outlier, and a zero row.
  x = jax.random.normal(keys[0], (6, width)) * jnp.array([1e-6, 1e-2, 1.0, 30.0, 1e4, 0.0])[:, None]
  x = x.at[2, 0].set(500.0)
  payload = exchange_formats.encode(x, FP8)
  blocks = -(-width // 128)
  assert payload.dtype == jnp.uint8 and payload.shape == (6, width + 4 * blocks)
  assert exchange_formats.row_bytes(FP8, width, jnp.bfloat16) == payload.shape[1]
  got = exchange_formats.decode(payload, FP8, width, jnp.float32)
  error, bound = np.abs(np.asarray(got - x)), np.asarray(exchange_formats.float8_error_bound(x))
  assert np.all(error <= bound * BOUND_SLACK), np.max(error / np.maximum(bound, 1e-30))
  assert np.all(np.asarray(got[5]) == 0)
  assert np.max(error) > 0  # it is lossy: the test would see a conversion that does nothing
  # The bound is tight to within the rounding: some element uses more than a quarter of it.
  assert np.max(error / np.maximum(bound, 1e-30)) > 0.25


def test_zero_payload_decodes_to_zero_rows():
  """Padding rows of the receive buffer arrive as zero bytes: they must decode to zeros, not NaN."""
  payload = jnp.zeros((3, 200 + 8), jnp.uint8)
  assert np.all(np.asarray(exchange_formats.decode(payload, FP8, 200, jnp.bfloat16)) == 0)


def _fp8(dispatch="auto", combine="auto", grads="auto", **kwargs):
  return ParallelConfig(grouped_gemm="blocked", moe_dispatch_dtype=dispatch, moe_combine_dtype=combine,
                        moe_exchange_grad_dtype=grads, **kwargs)


EP_LAYOUTS = [((1, 8, 1, 1), "ep"), ((2, 4, 1, 1), "ep"), ((2, 2, 2, 1), "tp_sp"), ((2, 2, 1, 2), "megascale"),
              ((1, 4, 2, 1), "megascale")]
_IDS = [f"{p}-{'x'.join(map(str, s))}" for s, p in EP_LAYOUTS]


@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("load", ["balanced", "dropped"])
@pytest.mark.parametrize("sizes,preset", EP_LAYOUTS, ids=_IDS)
def test_fp8_dispatch_equals_the_op_on_dequantised_tokens(sizes, preset, load, impl):
  x, experts, weights, w = _inputs(load)
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  fn, place = sharded_op(sizes, preset, _fp8(dispatch=FP8, impl=impl))
  assert_matches(output_and_grads(fn, *place(x, experts, weights, w), cotangent),
                 output_and_grads(_moe_on_dequantised_tokens, x, experts, weights, w, cotangent))


def _moe_on_dequantised_tokens(x, experts, weights, w):
  """The one-device op on the tokens' rows quantised; the gradient passes straight through."""
  x_q = _quantised(x.reshape(-1, x.shape[-1])).reshape(x.shape)
  return local_moe(x + jax.lax.stop_gradient(x_q - x), experts, weights, w)


def _use_ragged_exchange(monkeypatch):
  """The GPU's exchange (ragged_all_to_all) on CPU, through test_expert_parallel's emulation of it."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
  monkeypatch.setitem(expert_parallel._EXCHANGES, "padded_all_to_all", expert_parallel._EXCHANGES["ragged_all_to_all"])


@pytest.mark.parametrize("sizes,preset", EP_LAYOUTS[1:2] + EP_LAYOUTS[3:4], ids=_IDS[1:2] + _IDS[3:4])
def test_float8_over_the_ragged_exchange(sizes, preset, monkeypatch):
  """Float8 payloads through ragged_all_to_all, both ways, forward and backward: the dispatch equals the op on
  dequantised tokens, and with float8 gradients the input gradient is the padded exchange's (the same rows
  are quantised; only the exchange differs)."""
  x, experts, weights, w = _inputs("dropped")
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  fn, place, _ = _sharded(sizes, preset, _fp8(dispatch=FP8, combine=FP8, grads=FP8, impl="xla"))
  padded = output_and_grads(fn, *place(x, experts, weights, w), cotangent)
  _use_ragged_exchange(monkeypatch)
  fn, place, _ = _sharded(sizes, preset, _fp8(dispatch=FP8, combine=FP8, grads=FP8, impl="xla"))
  assert_matches(output_and_grads(fn, *place(x, experts, weights, w), cotangent), padded)


def test_fp8_dispatch_gradient_matches_finite_differences_of_the_dequantised_op():
  """<grad, v> against central differences of v -> <F(x_q + eps v), cotangent>, F the one-device MoE and x_q
  the dequantised tokens: the straight-through gradient is the exact gradient of the op at x_q."""
  x, experts, weights, w = _inputs("uneven")
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  direction = jax.random.normal(jax.random.key(3), x.shape)
  fn, place, _ = _sharded((2, 4, 1, 1), "ep", _fp8(dispatch=FP8))
  _, (grad_x, _, _) = output_and_grads(fn, *place(x, experts, weights, w), cotangent)
  x_q = _quantised(x.reshape(-1, x.shape[-1])).reshape(x.shape)
  eps = 1e-2

  def loss(x):
    return float(jnp.sum(local_moe(x, experts, weights, w).astype(jnp.float64) * cotangent))

  with jax.enable_x64():
    finite_difference = (loss(x_q + eps * direction) - loss(x_q - eps * direction)) / (2 * eps)
  analytic = float(jnp.sum(grad_x * direction))
  assert analytic == pytest.approx(finite_difference, rel=1e-3)


def _per_assignment(x, experts, weights, w):
  """(each assignment's expert output [A, D], and the combine) on one device, as moe_local computes them."""
  b, s, d = x.shape
  k = experts.shape[-1]
  token_A = jnp.arange(b * s * k) // k
  y_AD = grouped_ffn.grouped_ffn(x.reshape(-1, d)[token_A], experts.reshape(-1), w, swiglu_hidden, "blocked")
  return y_AD, token_A


@pytest.mark.parametrize("sizes,preset", EP_LAYOUTS[:1] + EP_LAYOUTS[3:4], ids=_IDS[:1] + _IDS[3:4])
def test_fp8_combine_is_within_the_bound_of_the_exact_op(sizes, preset):
  """Each returned row is quantised once, then summed in float32: |error of token t| <= sum over its rows of
  |weight| x the rows' bound."""
  x, experts, weights, w = _inputs("dropped")
  fn, place, _ = _sharded(sizes, preset, _fp8(combine=FP8, impl="xla"))
  got = jax.jit(fn)(*place(x, experts, weights, w))
  want = local_moe(x, experts, weights, w)
  y_AD, token_A = _per_assignment(x, experts, weights, w)
  bound_AD = exchange_formats.float8_error_bound(y_AD) * jnp.abs(weights.reshape(-1))[:, None]
  bound = jnp.zeros((x.shape[0] * x.shape[1], x.shape[2])).at[token_A].add(bound_AD).reshape(x.shape)
  error = np.abs(np.asarray(got - want))
  allowed = np.asarray(bound) * BOUND_SLACK + FP32_MODULE_RTOL * np.abs(np.asarray(want)) + 1e-6
  assert np.all(error <= allowed), np.max(error - allowed)
  assert np.max(error) > 1e-4  # the combine was quantised


@jax.custom_vjp
def _quantise_cotangent(rows_AD):
  return rows_AD


_quantise_cotangent.defvjp(lambda rows_AD: (rows_AD, None), lambda _, g: (_quantised(g),))


def test_fp8_backward_exchanges_quantise_the_cotangent_rows():
  """Float8 gradients of both exchanges: the reference quantises the same cotangent rows on one device (an
  expert output row's cotangent on its way back to the expert, an input row's gradient on its way back to
  its token). The expert GEMMs' summation order differs across layouts, so a row's float8 rounding may
  flip one step: within twice the rows' bound of it, and much closer to it than to the exact gradient."""
  x, experts, weights, w = _inputs("balanced")
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  fn, place, _ = _sharded((2, 4, 1, 1), "ep", _fp8(grads=FP8, impl="xla"))
  got_y, (got_dx, _, _) = output_and_grads(fn, *place(x, experts, weights, w), cotangent)
  b, s, d = x.shape
  k = experts.shape[-1]
  token_A = jnp.arange(b * s * k) // k

  def reference(x, experts, weights, w):
    rows_AD = _quantise_cotangent(x.reshape(-1, d)[token_A])
    y_AD = _quantise_cotangent(grouped_ffn.grouped_ffn(rows_AD, experts.reshape(-1), w, swiglu_hidden, "blocked"))
    return grouped_ffn.combine(y_AD, weights.reshape(-1), token_A, b * s).reshape(b, s, d)

  want_y, (want_dx, _, _) = output_and_grads(reference, x, experts, weights, w, cotangent)
  _, (exact_dx, _, _) = output_and_grads(local_moe, x, experts, weights, w, cotangent)
  np.testing.assert_allclose(got_y, want_y, rtol=FP32_MODULE_RTOL, atol=1e-6)
  # Each token's gradient is the sum of its rows' quantised gradients, the rows computed from the quantised
  # cotangents as the reference computes them.
  rows_AD = x.reshape(-1, d)[token_A]
  _, pullback = jax.vjp(lambda r: grouped_ffn.grouped_ffn(r, experts.reshape(-1), w, swiglu_hidden, "blocked"),
                        rows_AD)
  (dispatched_AD,) = pullback(_quantised(weights.reshape(-1)[:, None] * cotangent.reshape(-1, d)[token_A]))
  bound_T = jnp.zeros((b * s, d)).at[token_A].add(exchange_formats.float8_error_bound(dispatched_AD))
  error = np.abs(np.asarray(got_dx - want_dx))
  allowed = 2 * np.asarray(bound_T).reshape(x.shape) + FP32_MODULE_RTOL * np.abs(np.asarray(want_dx)) + 1e-6
  assert np.all(error <= allowed), np.max(error - allowed)
  assert np.mean(error) < 0.1 * np.mean(np.abs(np.asarray(exact_dx - want_dx)))


@pytest.mark.parametrize("wire_format,row_bytes", [(FP8, 16 + 4), ("bfloat16", 2 * 16)])
def test_compiled_exchanges_move_the_wire_format(wire_format, row_bytes):
  """Forward only: the token all-to-alls of the compiled op move [ep, S] rows of `row_bytes` (float32 rows of
  16 channels: 64 bytes) plus the group sizes, [ep, E/ep] int32."""
  x, experts, weights, w = _inputs("balanced")

  def all_to_all_bytes(parallel):
    fn, place, _ = _sharded((1, 8, 1, 1), "ep", parallel)
    hlo = jax.jit(fn).lower(*place(x, experts, weights, w)).compile().as_text()
    return hlo_collectives.bytes_by_kind(hlo_collectives.collectives(hlo, 8))["all-to-all"]

  slot = B * S // 8 * min(K, 1)  # a device's tokens x min(top_k, experts per device)
  group_sizes = 7 / 8 * 8 * 1 * 4
  plain = all_to_all_bytes(_fp8())
  assert plain == pytest.approx(group_sizes + 2 * 7 / 8 * 8 * slot * 16 * 4)
  compressed = all_to_all_bytes(_fp8(dispatch=wire_format, combine=wire_format))
  assert compressed == pytest.approx(group_sizes + 2 * 7 / 8 * 8 * slot * row_bytes)


def _plan(parallel: ParallelConfig, hardware: Hardware | None = None):
  _, _, mesh = _sharded((1, 8, 1, 1), "ep")
  plan = ParallelPlan.for_mesh(mesh, "ep", parallel)
  return dataclasses.replace(plan, hardware=hardware) if hardware else plan


def test_the_fused_kernels_give_way_to_a_wire_format():
  plan = _plan(ParallelConfig(impl="pallas", kernel_backend="collectives", moe_dispatch_dtype=FP8))
  choice = plan.expert_ffn(8, 128, 256, jnp.bfloat16)
  assert choice.implementation == "all_to_all", choice
  assert "activation dtype" in choice.fallback
  assert choice.dispatch_formats == (FP8, "auto") and choice.combine_formats == ("auto", "auto")
  assert "dispatch in float8_e4m3fn (its gradient in the activation dtype)" in choice.detail
  plain = _plan(ParallelConfig(impl="pallas", kernel_backend="collectives")).expert_ffn(8, 128, 256, jnp.bfloat16)
  assert plain.implementation == "fused"


@pytest.mark.parametrize("field", ["moe_dispatch_dtype", "moe_combine_dtype", "moe_exchange_grad_dtype"])
def test_float8_on_a_gpu_without_float8_is_a_config_error(field):
  a100 = Hardware("gpu", "NVIDIA A100-SXM4-80GB", "8.0", 108)
  with pytest.raises(ConfigError, match=rf"parallel.{field}=.*compute capability 8.9 or newer.*A100.*8.0"):
    _plan(ParallelConfig(**{field: FP8}), a100).expert_ffn(8, 128, 256, jnp.bfloat16)
  # bfloat16 is fine there, float8 on Hopper too.
  assert _plan(ParallelConfig(**{field: "bfloat16"}), a100).expert_ffn(8, 128, 256, jnp.bfloat16)
  h100 = Hardware("gpu", "NVIDIA H100 80GB HBM3", "9.0", 132)
  assert _plan(ParallelConfig(**{field: FP8}), h100).expert_ffn(8, 128, 256, jnp.bfloat16)


def test_a_format_without_expert_parallelism_is_reported_unused():
  _, _, mesh = _sharded((8, 1, 1, 1), "dp")
  choice = ParallelPlan.for_mesh(mesh, "dp", ParallelConfig(moe_dispatch_dtype=FP8)).expert_ffn(1, 128, 256,
                                                                                              jnp.float32)
  assert choice.implementation == "local"
  assert "parallel.moe_dispatch_dtype='float8_e4m3fn' unused: no tokens are exchanged" in choice.fallback
