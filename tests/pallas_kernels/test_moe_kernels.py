"""The Comet kernels: MoE dispatch + grouped GEMM (pallas_kernels/moe_dispatch_gemm) and grouped GEMM +
return to the owners (pallas_kernels/moe_gemm_return), each other's backward, on the tile plan of
pallas_kernels/moe_routing.py.

- plan and composition: dispatch -> SwiGLU -> return -> combine equals a NumPy per-assignment MoE for
  routings drawn by hypothesis (empty experts, one expert taking everything, dropped assignments, devices
  that send nothing), with the reference backends;
- protocol: the twins (each kernel's protocol.py on simulated thread blocks) on rings of 2 (two blocks per
  device) and 8 CPU devices equal the references for uneven and empty groups, and on 4 under skewed
  arrival orders, and the race detector finds nothing in any kernel (conftest.py); the protocol with its
  arrival waits left out is caught;
- SwiGLU fused into the dispatch kernel (moe_dispatch_gemm/swiglu.py): the layer equals the NumPy MoE on
  a ring of 2, and on 4 in both gradient modes (the gradient tests), without races;
- gradients: the fused custom VJPs (each op's backward runs the other's kernel; the fused SwiGLU's
  recomputes gate and up per tile) equal jax.vjp of the references, and the fused layer's output the
  NumPy MoE;
- build: the Mosaic GPU kernels of a whole MoE layer, forward and backward (with the grouped weight-gradient
  kernel), compile for 8 H100s without a GPU, with no all-to-all left in the program;
- numerics: the Mosaic GPU kernels' compute path (the SwiGLU epilogue and its gradient kernel too) in the
  Mosaic GPU interpreter equals the references.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from meshmoe.analysis import deviceless, kernel_resources
from meshmoe.pallas_kernels import moe_routing, mosaic_tiles, ring
from meshmoe.pallas_kernels.moe_dispatch_gemm import api as dispatch_api, mosaic_gpu as dispatch_mosaic
from meshmoe.pallas_kernels.moe_dispatch_gemm import reference as dispatch_reference, tpu as dispatch_tpu
from meshmoe.pallas_kernels.moe_gemm_return import api as return_api, mosaic_gpu as return_mosaic
from meshmoe.pallas_kernels.moe_gemm_return import tpu as return_tpu
from meshmoe.pallas_kernels.mosaic_tiles import DEFAULT_TILES, Tiles
from tests.pallas_kernels import harness
from tests.tolerances import FP32_MODULE_RTOL, assert_close

E_LOCAL, TOKENS, TOP_K, D, F, TM = 2, 12, 2, 16, 24, 8
SPEC = P("a")
TWIN_TILES = Tiles(block_m=TM, block_n=8, block_k=8)
# Simulated thread blocks per device for each ring size (more blocks, more interpreter threads).
TWIN_BLOCKS = {p: harness.most_twin_blocks(harness.cpu_mesh((p, 1))) for p in (2, 4, 8)}


def _routing(case: str, p: int, rng: np.random.Generator) -> np.ndarray:
  """[p * TOKENS, TOP_K] global expert ids (p * E_LOCAL marks a dropped assignment)."""
  experts = rng.integers(0, p * E_LOCAL, (p, TOKENS, TOP_K))
  if case == "one_expert_takes_all":
    experts[:] = 1
  elif case == "uneven_with_drops":
    experts[0] = p * E_LOCAL  # device 0 sends nothing
    experts[1, :, 0], experts[1, :, 1] = 3 % (p * E_LOCAL), p * E_LOCAL  # one expert, half dropped
    experts[2:, :4] = 0  # expert 0 overloaded, others possibly empty
  return experts.reshape(p * TOKENS, TOP_K).astype(np.int32)


def _parameters(p: int, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (p * TOKENS, D), jnp.float32)
  combine = jax.random.uniform(keys[1], (p * TOKENS, TOP_K), jnp.float32)
  gate = jax.random.normal(keys[2], (p * E_LOCAL, D, F), jnp.float32) / np.sqrt(D)
  up = jax.random.normal(keys[3], (p * E_LOCAL, D, F), jnp.float32) / np.sqrt(D)
  down = jax.random.normal(keys[4], (p * E_LOCAL, F, D), jnp.float32) / np.sqrt(F)
  return x, combine, gate, up, down


def _moe_layer(dispatch_backend: str, return_backend: str, num_blocks: int = 1, swiglu: str | None = None):
  """A whole expert-parallel MoE layer per device, on the given backends; with `swiglu` (its gradient's
  mode), SwiGLU fused into the dispatch kernel (else computed between the kernels)."""
  options = dict(tiles=TWIN_TILES, num_sms=num_blocks)

  def layer(x_TD, experts_TK, combine_TK, gate, up, down):
    t, k = experts_TK.shape
    token_A = jnp.arange(t * k) // k
    plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("a",), E_LOCAL, TM)
    if swiglu:
      h = dispatch_api.dispatch_swiglu(x_TD[token_A], gate, up, plan, "a", tile_rows=TM, backend=dispatch_backend,
                                       gradient=swiglu, **options)
    else:
      g, u = dispatch_api.dispatch_gemm(x_TD[token_A], (gate, up), plan, "a", tile_rows=TM,
                                        backend=dispatch_backend, **options)
      h = jax.nn.silu(g) * u
    y_AD = return_api.gemm_return((h,), (down,), plan, "a", backend=return_backend, **options)
    weighted = y_AD * combine_TK.reshape(-1)[:, None]
    return jnp.zeros((t, y_AD.shape[1]), y_AD.dtype).at[token_A].add(weighted)

  return layer


def _numpy_moe(x, experts, combine, gate, up, down) -> np.ndarray:
  x, combine, gate, up, down = (np.asarray(a, np.float64) for a in (x, combine, gate, up, down))
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for k, e in enumerate(experts[t]):
      if e < gate.shape[0]:
        g, u = x[t] @ gate[e], x[t] @ up[e]
        out[t] += combine[t, k] * ((g / (1 + np.exp(-g))) * u) @ down[e]
  return out


@functools.cache
def _reference_layer(p: int):
  """The layer on the reference backends on a ring of p, jitted once: every example of a ring size has the
  same shapes, so the examples share one compile (a fresh jit per example compiled it 25 times)."""
  return harness.per_device(_moe_layer("collectives", "collectives"), harness.cpu_mesh((p, 1)), (SPEC,) * 6, SPEC)


@settings(max_examples=25, deadline=None)
@given(p=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31 - 1),
       skew=st.sampled_from(["uniform", "one_expert", "sparse", "drops"]))
def test_plan_moves_every_assignment_to_its_expert_and_back(p, seed, skew):
  rng = np.random.default_rng(seed)
  num_experts = p * E_LOCAL
  if skew == "uniform":
    experts = rng.integers(0, num_experts, (p * TOKENS, TOP_K))
  elif skew == "one_expert":
    experts = np.full((p * TOKENS, TOP_K), rng.integers(0, num_experts))
  elif skew == "sparse":  # most experts empty
    experts = rng.choice(rng.choice(num_experts, 2, replace=False), (p * TOKENS, TOP_K))
  else:
    experts = np.where(rng.random((p * TOKENS, TOP_K)) < 0.5, num_experts, rng.integers(0, num_experts, (p * TOKENS, TOP_K)))
  experts = experts.astype(np.int32)
  x, combine, gate, up, down = _parameters(p, seed % 1000)
  out = _reference_layer(p)(x, experts, combine, gate, up, down)
  assert_close(out, _numpy_moe(x, experts, combine, gate, up, down), FP32_MODULE_RTOL, f"{skew} p={p}")


def _twin_stages(num_blocks: int, interpret=ring.INTERPRET_PARAMS):
  """The twin kernels with this many simulated blocks per device and the tests' tiles."""
  dispatch = functools.partial(dispatch_tpu.dispatch_gemm, num_blocks=num_blocks, tiles=TWIN_TILES,
                               interpret=interpret)
  gemm_return = functools.partial(return_tpu.gemm_return, num_blocks=num_blocks, tiles=TWIN_TILES,
                                  interpret=interpret)
  return dispatch, gemm_return


# On a ring of 2, the only ring size with two simulated blocks per device (TWIN_BLOCKS: tiles and items owned
# mod B), random loads (then the layer through the ops' API too) and every token to one expert (3 tiles from
# each sender, 6 into one expert; the other device receives nothing). On 8 (a node: up to 7 peers sending
# to a device) the two loads that stress the protocol most, every token to one expert and uneven loads with
# drops. Rings of 4 added no case (one block per device, fewer peers than 8); the layer on 4 runs in the
# gradient and arrival-order tests below. Uneven loads on 2 move no row between devices (device 0 sends
# nothing, device 1 only to its own expert 3); on 2 blocks they run in the fused SwiGLU test. Random loads
# on 8 took a minute and add no case.
TWIN_CASES = [("random", 2), ("one_expert_takes_all", 2), ("one_expert_takes_all", 8), ("uneven_with_drops", 8)]


@pytest.mark.parametrize("case,p", TWIN_CASES, ids=[f"{case}-{p}" for case, p in TWIN_CASES])
def test_twins_equal_the_references_without_races(p, case):
  mesh = harness.cpu_mesh((p, 1))
  experts = _routing(case, p, np.random.default_rng(p))
  x, combine, gate, up, down = _parameters(p)
  twin_dispatch, twin_return = _twin_stages(TWIN_BLOCKS[p])

  def stages(dispatch, gemm_return):
    def per_device(x_TD, experts_TK, gate, up, down):
      t, k = experts_TK.shape
      plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("a",), E_LOCAL, TM)
      xs = moe_routing.send_buffer(x_TD[jnp.arange(t * k) // k], plan, TM, plan.send_dst.shape[0])
      xr, g, u = dispatch(xs, (gate, up), plan, ("a",))
      return xr, g, u, gemm_return((jax.nn.silu(g) * u,), (down,), plan, ("a",))
    return harness.per_device(per_device, mesh, (SPEC,) * 5, (SPEC,) * 4)

  twins = stages(twin_dispatch, twin_return)(x, experts, gate, up, down)
  references = stages(dispatch_api.reference.dispatch_gemm, return_api.reference.gemm_return)(
      x, experts, gate, up, down)
  for got, want, name in zip(twins, references, ("received rows", "gate", "up", "returned rows")):
    assert_close(got, want, FP32_MODULE_RTOL, name)
  if case != "random":
    return  # the kernels through the ops' API: once per ring size here (uneven routings: the tests below)
  out = harness.per_device(_moe_layer("tpu_interpret", "tpu_interpret", TWIN_BLOCKS[p]), mesh, (SPEC,) * 6,
                           SPEC)(x, experts, combine, gate, up, down)
  assert_close(out, _numpy_moe(x, experts, combine, gate, up, down), FP32_MODULE_RTOL, "MoE layer")


# Two blocks per device here; on a ring of 4 both modes' forward kernels run in
# test_fused_gradients_equal_the_reference, which checks the layer's output against the NumPy MoE too, and
# the SwiGLU epilogue is local compute: the exchange around it is the plain dispatch's (8 devices: the twins).
@pytest.mark.parametrize("p,mode", [(2, "recompute")])
def test_fused_swiglu_twins_equal_the_numpy_moe_without_races(p, mode):
  mesh = harness.cpu_mesh((p, 1))
  experts = _routing("uneven_with_drops", p, np.random.default_rng(p + 20))
  x, combine, gate, up, down = _parameters(p, seed=4)
  layer = _moe_layer("tpu_interpret", "tpu_interpret", TWIN_BLOCKS[p], swiglu=mode)
  out = harness.per_device(layer, mesh, (SPEC,) * 6, SPEC)(x, experts, combine, gate, up, down)
  assert_close(out, _numpy_moe(x, experts, combine, gate, up, down), FP32_MODULE_RTOL, "MoE layer")


@pytest.mark.parametrize("slow_devices", [(0,), (1, 2)], ids=["device-0-late", "devices-1-2-late"])
def test_twins_are_exact_under_skewed_arrival_orders(slow_devices):
  """Some devices send late, so tiles land in other orders than the plan's; an uneven routing with drops."""
  p = 4
  mesh = harness.cpu_mesh((p, 1))
  experts = _routing("uneven_with_drops", p, np.random.default_rng(11))
  x, combine, gate, up, down = _parameters(p, seed=2)
  with harness.late_puts(slow_devices):
    out = harness.per_device(_moe_layer("tpu_interpret", "tpu_interpret", TWIN_BLOCKS[p]), mesh, (SPEC,) * 6, SPEC)(
        x, experts, combine, gate, up, down)
  assert_close(out, _numpy_moe(x, experts, combine, gate, up, down), FP32_MODULE_RTOL, "MoE layer")


def test_race_detector_catches_the_protocol_with_its_arrival_waits_left_out():
  """The harness can fail: dispatch + GEMM whose landing blocks read received tiles without awaiting them.
  DMAs run as they start here: delayed until awaited, the unawaited ones would never write at all."""
  p = 4
  mesh = harness.cpu_mesh((p, 1))
  experts = _routing("random", p, np.random.default_rng(3))
  x, _, gate, up, _ = _parameters(p)
  dispatch, _ = _twin_stages(TWIN_BLOCKS[p], dataclasses.replace(ring.INTERPRET_PARAMS, dma_execution_mode="eager"))

  def per_device(x_TD, experts_TK, gate, up):
    t, k = experts_TK.shape
    plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("a",), E_LOCAL, TM)
    xs = moe_routing.send_buffer(x_TD[jnp.arange(t * k) // k], plan, TM, plan.send_dst.shape[0])
    return dispatch(xs, (gate, up), plan, ("a",))[1]

  with harness.waits_left_out("await_arrival"):
    harness.per_device(per_device, mesh, (SPEC,) * 4, SPEC)(x, experts, gate, up)
  assert harness.take_race_verdicts() == ["moe_dispatch_gemm"]


# Uneven loads with drops (empty groups, a device that sends nothing, an overloaded expert) on a ring of 4, one
# block per device: each of the three backward passes (plain, SwiGLU recomputed, SwiGLU kept). Each run also
# checks the fused layer's output (its forward kernels, SwiGLU ones included) against the NumPy MoE.
@pytest.mark.parametrize("case,swiglu", [("uneven_with_drops", None), ("uneven_with_drops", "recompute"),
                                         ("uneven_with_drops", "keep")])
def test_fused_gradients_equal_the_reference(case, swiglu):
  p = 4
  mesh = harness.cpu_mesh((p, 1))
  experts = _routing(case, p, np.random.default_rng(7))
  x, combine, gate, up, down = _parameters(p, seed=3)

  def layer_and_grads(backend, swiglu=None):
    def per_device(x_TD, experts_TK, combine_TK, gate, up, down):
      layer = _moe_layer(backend, backend, swiglu=swiglu)
      out, pullback = jax.vjp(lambda x, g, u, d: layer(x, experts_TK, combine_TK, g, u, d), x_TD, gate, up, down)
      return out, pullback(2 * out)  # the gradients of sum(out ** 2)
    return harness.per_device(per_device, mesh, (SPEC,) * 6, (SPEC, (SPEC,) * 4))

  out, fused = layer_and_grads("tpu_interpret", swiglu)(x, experts, combine, gate, up, down)
  assert_close(out, _numpy_moe(x, experts, combine, gate, up, down), FP32_MODULE_RTOL, "MoE layer")
  _, expected = layer_and_grads("collectives")(x, experts, combine, gate, up, down)
  for got, want, name in zip(fused, expected, ("tokens", "gate", "up", "down")):
    assert_close(got, want, FP32_MODULE_RTOL, f"gradient of {name}")


def test_unsupported_names_what_does_not_tile():
  assert dispatch_api.unsupported(256, [128, 128], jnp.bfloat16) is None
  assert "F0=100" in dispatch_api.unsupported(256, [100], jnp.bfloat16)
  assert "D=96" in return_api.unsupported([128], 96, jnp.bfloat16)
  assert "dtype float32" in return_api.unsupported([128], 256, jnp.float32)


@pytest.mark.slow
def test_mosaic_kernels_of_a_moe_layer_compile_for_8_h100s_forward_and_backward():
  mesh = harness.h100_mesh(8)
  tokens, d, f = 96, 256, 128
  spec = P("x")
  shapes = [((8 * tokens, d), jnp.bfloat16), ((8 * tokens, TOP_K), jnp.int32), ((8 * tokens, TOP_K), jnp.float32),
            ((8 * E_LOCAL, d, f), jnp.bfloat16), ((8 * E_LOCAL, d, f), jnp.bfloat16), ((8 * E_LOCAL, f, d), jnp.bfloat16)]
  args = [harness.abstract(mesh, shape, dtype, spec) for shape, dtype in shapes]

  def per_device(x_TD, experts_TK, combine_TK, gate, up, down):
    def layer(x_TD, gate, up, down):
      t, k = experts_TK.shape
      token_A = jnp.arange(t * k) // k
      plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("x",), E_LOCAL, 64)
      h = dispatch_api.dispatch_swiglu(x_TD[token_A], gate, up, plan, "x", tile_rows=64, backend="mosaic_gpu",
                                       num_sms=harness.h100_sms())
      y_AD = return_api.gemm_return((h,), (down,), plan, "x", backend="mosaic_gpu", num_sms=harness.h100_sms())
      return jnp.sum(y_AD.astype(jnp.float32) * combine_TK.reshape(-1)[:, None])
    loss, grads = jax.value_and_grad(layer, argnums=(0, 1, 2, 3))(x_TD, gate, up, down)
    return loss[None], grads

  hlo = deviceless.compile_for_analysis(harness.per_device(
      per_device, mesh, (spec,) * 6, (spec, (spec,) * 4), check_vma=True).lower(*args)).as_text()
  # Two kernels forward; backward, two kernels, the SwiGLU gradient and three grouped weight gradients.
  assert hlo.count('custom_call_target="mosaic_gpu') >= 8
  for collective in ("all-to-all", "ragged-all-to-all", "collective-permute", "reduce-scatter"):
    assert f" {collective}(" not in hlo and f" {collective}-start(" not in hlo, collective


# Warp-specialised blocks (gpu_warp_specialized.py): a producer and two consumers of 64 columns each; with
# 128-row tiles, SwiGLU's steps split by rows (each consumer multiplies its 64 rows by gate and up).
WS_TILES = Tiles(64, 128, 64, 2, consumers=2)
WS_ROW_SPLIT_TILES = Tiles(128, 128, 64, 2, consumers=2)


@pytest.mark.parametrize("num_blocks,transposed,tiles", [(1, False, DEFAULT_TILES), (3, False, DEFAULT_TILES),
                                                         (3, True, DEFAULT_TILES), (3, False, WS_TILES),
                                                         (2, True, WS_TILES)],
                         ids=["1-block", "3-blocks", "transposed", "ws", "ws-transposed"])
def test_mosaic_compute_path_equals_the_reference(num_blocks, transposed, tiles):
  """With `transposed`, the kernels get the weights stored transposed and multiply them transposed (as
  the backward passes do). The return kernel sums two products per tile (h @ down + roll(h) @ down2), as
  the SwiGLU layer's backward does with the gate's and the up projection's gradients."""
  mesh = harness.one_device_ring()
  tokens, d, f, e_local = 96, 256, 128, 3
  rng = np.random.default_rng(num_blocks)
  experts = rng.integers(0, e_local, (tokens, TOP_K)).astype(np.int32)
  experts[:10] = e_local  # dropped
  keys = jax.random.split(jax.random.key(5), 4)
  x = jax.random.normal(keys[0], (tokens, d), jnp.float32).astype(jnp.bfloat16)
  gate = (jax.random.normal(keys[1], (e_local, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
  down, down2 = ((jax.random.normal(k, (e_local, f, d), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
                 for k in keys[2:])

  def stages(dispatch, gemm_return):
    def per_device(x_TD, experts_TK, gate, down, down2):
      t, k = experts_TK.shape
      plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("x",), e_local, 64)
      xs = moe_routing.send_buffer(x_TD[jnp.arange(t * k) // k], plan, 64, plan.send_dst.shape[0])
      xr, h = dispatch(xs, (gate,), plan, ("x",))
      return xr, h, gemm_return((h, jnp.roll(h, 1, axis=1)), (down, down2), plan, ("x",))
    return harness.per_device(per_device, mesh, (P("x"),) * 5, (P("x"),) * 3)

  options = dict(num_blocks=num_blocks, transposed=transposed, tiles=tiles, interpret=harness.GPU_INTERPRET)
  stored = (lambda w: jnp.swapaxes(w, 1, 2)) if transposed else (lambda w: w)
  kernel = lambda xs, ws, plan, axes: dispatch_mosaic.dispatch_gemm(xs, tuple(map(stored, ws)), plan, axes, **options)
  back = lambda hs, ws, plan, axes: return_mosaic.gemm_return(hs, tuple(map(stored, ws)), plan, axes, **options)
  got = stages(kernel, back)(x, experts, gate, down, down2)
  want = stages(dispatch_api.reference.dispatch_gemm, return_api.reference.gemm_return)(x, experts, gate, down,
                                                                                          down2)
  for g, w, name in zip(got, want, ("received rows", "products", "returned rows")):
    assert_close(g.astype(jnp.float32), w.astype(jnp.float32), harness.BF16_RTOL, name)


@pytest.mark.parametrize("tiles", [DEFAULT_TILES, WS_TILES, WS_ROW_SPLIT_TILES],
                         ids=["one-warpgroup", "warp-specialised", "ws-split-by-rows"])
def test_mosaic_swiglu_epilogue_and_its_gradient_kernel_equal_the_reference(tiles):
  """The "keep" epilogue (hidden units, gate and up) and the "recompute" gradient kernel."""
  assert WS_ROW_SPLIT_TILES.splits_gate_up and not WS_TILES.splits_gate_up
  mesh = harness.one_device_ring()
  tokens, d, f, e_local, tm = 96, 256, 128, 3, tiles.block_m
  rng = np.random.default_rng(1)
  experts = rng.integers(0, e_local, (tokens, TOP_K)).astype(np.int32)
  experts[:10] = e_local  # dropped
  keys = jax.random.split(jax.random.key(6), 4)
  x, dh = (jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16)
           for k, shape in zip(keys[:2], [(tokens, d), (moe_routing.sizes(tokens * TOP_K, 1, e_local, tm)[1] * tm, f)]))
  gate, up = ((jax.random.normal(k, (e_local, d, f), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16) for k in keys[2:])

  def stages(dispatch, gradient):
    def per_device(x_TD, experts_TK, dh_RF, gate, up):
      t, k = experts_TK.shape
      plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("x",), e_local, tm)
      xs = moe_routing.send_buffer(x_TD[jnp.arange(t * k) // k], plan, tm, plan.send_dst.shape[0])
      xr, *products = dispatch(xs, (gate, up), plan, ("x",))
      return (*products, *gradient(xr, dh_RF, gate, up, plan))
    return harness.per_device(per_device, mesh, (P("x"),) * 5, (P("x"),) * 5)

  got = stages(functools.partial(dispatch_mosaic.dispatch_gemm, num_blocks=3, swiglu="keep", tiles=tiles,
                                 interpret=harness.GPU_INTERPRET),
               functools.partial(dispatch_mosaic.swiglu_gradient, num_blocks=3, tiles=tiles,
                                 interpret=harness.GPU_INTERPRET))(
      x, experts, dh, gate, up)
  def reference(*args):  # (xr, hidden units, gate, up)
    xr, gate, up = dispatch_reference.dispatch_gemm(*args)
    return xr, dispatch_reference.dispatch_gemm(*args, swiglu=True)[1], gate, up

  want = stages(reference, dispatch_reference.swiglu_gradient)(x, experts, dh, gate, up)
  for g, w, name in zip(got, want, ("hidden units", "gate", "up", "gate gradient", "up gradient")):
    assert_close(g.astype(jnp.float32), w.astype(jnp.float32), harness.BF16_RTOL, name)


def _at_mixtral_widths(tokens: int):
  """(8 H100s, the ring's spec, abstract tokens, expert ids and one expert's gate, up and down per device) at
  Mixtral-8x7B's widths: d_model 4096, expert width 14336 over tensor=4."""
  mesh, spec, d, f = harness.h100_mesh(8), P("x"), 4096, 3584
  shapes = [((8 * tokens, d), jnp.bfloat16), ((8 * tokens, TOP_K), jnp.int32),
            ((8, d, f), jnp.bfloat16), ((8, d, f), jnp.bfloat16), ((8, f, d), jnp.bfloat16)]
  return mesh, spec, [harness.abstract(mesh, shape, dtype, spec) for shape, dtype in shapes]


@pytest.mark.slow
def test_warp_specialised_kernels_of_a_moe_layer_compile_for_8_h100s_at_mixtral_widths(tmp_path, monkeypatch):
  """Hopper's layout (mosaic_tiles.HOPPER_TILES: 128 x 256 tiles, a producer and two consumers, 128-row tiles
  in the plan) at Mixtral-8x7B's widths over tensor=4, forward and backward: every kernel of the layer,
  with its semaphores, handoffs and signals on a ring of 8, compiles for H100s, and ptxas spills no
  register in any (the SwiGLU kernels and the two-product return kernel did: kernel_resources.py)."""
  monkeypatch.setenv(kernel_resources.DUMP_DIRECTORY, str(tmp_path))
  tiles = mosaic_tiles.HOPPER_TILES
  mesh, spec, args = _at_mixtral_widths(tokens=128)

  def per_device(x_TD, experts_TK, gate, up, down):
    def layer(x_TD, gate, up, down):
      t, k = experts_TK.shape
      plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("x",), 1, tiles.block_m)
      options = dict(backend="mosaic_gpu", num_sms=harness.h100_sms(), tiles=tiles)
      h = dispatch_api.dispatch_swiglu(x_TD[jnp.arange(t * k) // k], gate, up, plan, "x", tile_rows=tiles.block_m,
                                       **options)
      return jnp.sum(return_api.gemm_return((h,), (down,), plan, "x", **options).astype(jnp.float32))
    loss, grads = jax.value_and_grad(layer, argnums=(0, 1, 2, 3))(x_TD, gate, up, down)
    return loss[None], grads

  # The kernels' ptxas logs are written as they compile: compile_for_analysis never reads this one from
  # its cache while MOSAIC_GPU_DUMP_TO is set.
  hlo = deviceless.compile_for_analysis(harness.per_device(
      per_device, mesh, (spec,) * 5, (spec, (spec,) * 4), check_vma=True).lower(*args)).as_text()
  assert hlo.count('custom_call_target="mosaic_gpu') >= 8
  kernels = kernel_resources.read(tmp_path)
  assert {k["name"].rsplit("_", 1)[0] for k in kernels} == {
      "moe_dispatch_gemm", "moe_dispatch_gemm_swiglu_gradient_kernel", "moe_gemm_return", "grouped_weight_gradient"}
  assert [k for k in kernels if k["spill_store_bytes"] or k["spill_load_bytes"]] == []


@pytest.mark.slow
def test_mosaic_kernels_lower_at_full_size_widths():
  """Mixtral-8x7B's widths on 8 devices (d_model 4096, expert width 14336 over tensor=4): the kernels'
  column loops are loops in the kernel, not unrolled per column (unrolled, 8 peers x 32 column copies
  overflowed Mosaic GPU's recursive layout inference)."""
  mesh, spec, args = _at_mixtral_widths(tokens=64)

  def per_device(x_TD, experts_TK, gate, up, down):
    t, k = experts_TK.shape
    plan = moe_routing.make_tile_plan(experts_TK.reshape(-1), ("x",), 1, 64)
    h = dispatch_api.dispatch_swiglu(x_TD[jnp.arange(t * k) // k], gate, up, plan, "x", tile_rows=64,
                                     backend="mosaic_gpu", num_sms=harness.h100_sms())
    return return_api.gemm_return((h,), (down,), plan, "x", backend="mosaic_gpu", num_sms=harness.h100_sms())

  lowered = harness.per_device(per_device, mesh, (spec,) * 5, spec, check_vma=True).lower(*args)
  assert lowered.as_text().count("mosaic_gpu") >= 2
