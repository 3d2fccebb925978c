"""The Flux kernels: all-gather + GEMM (pallas_kernels/allgather_matmul) and GEMM + reduce-scatter
(pallas_kernels/matmul_reducescatter), each other's backward.

- protocol: the twins (each kernel's protocol.py on simulated thread blocks) on rings of 2 (two blocks per
  device), 4 (beside independent rings; and under skewed arrival orders) and 8 CPU devices (one ring over
  two mesh axes, in the gradient test), equal the plain-collective reference, and the race detector finds
  nothing in any kernel (conftest.py); the same protocol with one wait left out is caught (the harness
  can fail);
- gradients: the fused custom VJP (each op's backward is the other op's kernel) equals jax.vjp of the
  reference, for inputs and weights, and so does the op's output;
- build: the Mosaic GPU kernels, forward and backward, compile for 8 H100s without a GPU, and the compiled
  program moves its blocks inside the kernels (no all-gather or reduce-scatter left);
- numerics: the Mosaic GPU kernels' compute path in the Mosaic GPU interpreter equals the reference.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from meshmoe.analysis import deviceless
from meshmoe.pallas_kernels import mosaic_tiles
from meshmoe.pallas_kernels.allgather_matmul import api as allgather_api, mosaic_gpu as allgather_mosaic
from meshmoe.pallas_kernels.allgather_matmul import tpu as allgather_tpu
from meshmoe.pallas_kernels.matmul_reducescatter import api as scatter_api, mosaic_gpu as scatter_mosaic
from meshmoe.pallas_kernels.matmul_reducescatter import tpu as scatter_tpu
from tests.pallas_kernels import harness
from tests.pallas_kernels.harness import SPEC_ALL
from tests.tolerances import FP32_MODULE_RTOL, assert_close

M, K, N = 8, 16, 24


def _per_device_inputs(n: int, p: int):
  """x [n*M, K], y [n*p, M, K] and w [n*K, N]: every device its own rows, blocks and weight."""
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (n * M, K), jnp.float32)
  y = jax.random.normal(keys[1], (n * p, M, K), jnp.float32)
  w = jax.random.normal(keys[2], (n * K, N), jnp.float32) / np.sqrt(K)
  return x, y, w


# Rings as (mesh shape over ("a", "b"), the ring's axes). The ring of 2, the only one with two simulated blocks per device (most_twin_blocks), and a
# ring of 4 on one axis beside independent rings on the other. The ring of 8 over two mesh axes (positions
# running over both: what rings of 8 and 2 x 2 added) runs both kernels, forward and backward, in
# test_fused_gradients_equal_the_reference, which checks their outputs too; a ring of 4 alone has no case
# that 4-of-4x2 lacks.
TWIN_RINGS = [((2, 1), ("a",)), ((4, 2), ("a",))]


@pytest.mark.parametrize("mesh_shape, axes", TWIN_RINGS, ids=["2", "4-of-4x2"])
def test_twins_equal_the_reference_without_races(mesh_shape, axes):
  mesh = harness.cpu_mesh(mesh_shape)
  blocks = harness.most_twin_blocks(mesh)
  n, p = mesh.size, harness.ring_size(mesh, axes)
  x, y, w = _per_device_inputs(n, p)
  run = lambda fn: harness.per_device(fn, mesh, (SPEC_ALL, SPEC_ALL), SPEC_ALL)

  gathered = run(lambda x, w: allgather_tpu.allgather_matmul(x, w, axes, num_blocks=blocks,
                                                            tiles=harness.TWIN_TILES)[0])(x, w)
  expected = run(lambda x, w: allgather_api.allgather_matmul(x, w, axes, backend="collectives"))(x, w)
  assert_close(gathered, expected, FP32_MODULE_RTOL, "all-gather GEMM")

  scattered = run(lambda y, w: scatter_tpu.matmul_reducescatter(y, w, axes, num_blocks=blocks,
                                                               tiles=harness.TWIN_TILES))(y, w)
  expected = run(lambda y, w: scatter_api.matmul_reducescatter(y, w, axes, backend="collectives"))(y, w)
  assert_close(scattered, expected, FP32_MODULE_RTOL, "GEMM reduce-scatter")


def test_twin_returns_the_gathered_blocks_in_ring_order():
  mesh = harness.cpu_mesh((4, 1))
  x, _, w = _per_device_inputs(4, 4)
  blocks = harness.per_device(lambda x, w: allgather_tpu.allgather_matmul(
      x, w, ("a",), num_blocks=1, tiles=harness.TWIN_TILES)[1], mesh, (SPEC_ALL, SPEC_ALL), SPEC_ALL)(x, w)
  expected = np.tile(np.asarray(x).reshape(1, 4, M, K), (4, 1, 1, 1)).reshape(16, M, K)
  np.testing.assert_array_equal(blocks, expected)


# The ring of 8 over two mesh axes: the op's output (the forward kernel) and both gradients (the other
# kernel) of each op, against the reference.
@pytest.mark.parametrize("mesh_shape, axes", [((2, 4), ("a", "b"))], ids=["2x4"])
def test_fused_gradients_equal_the_reference(mesh_shape, axes):
  mesh = harness.cpu_mesh(mesh_shape)
  n, p = mesh.size, harness.ring_size(mesh, axes)
  x, y, w = _per_device_inputs(n, p)
  keys = jax.random.split(jax.random.key(1), 2)
  dout_gathered = jax.random.normal(keys[0], (n * p, M, N), jnp.float32)
  dout_scattered = jax.random.normal(keys[1], (n * M, N), jnp.float32)

  def vjp(op, backend):
    def per_device(a, w, dout):
      out, pullback = jax.vjp(lambda a, w: op(a, w, axes, backend=backend, tiles=harness.TWIN_TILES,
                                                 num_sms=harness.most_twin_blocks(mesh)), a, w)
      return out, pullback(dout)
    return harness.per_device(per_device, mesh, (SPEC_ALL,) * 3, (SPEC_ALL, (SPEC_ALL, SPEC_ALL)))

  for op, a, dout in ((allgather_api.allgather_matmul, x, dout_gathered),
                      (scatter_api.matmul_reducescatter, y, dout_scattered)):
    fused_out, fused = vjp(op, "tpu_interpret")(a, w, dout)
    expected_out, expected = vjp(op, "collectives")(a, w, dout)
    assert_close(fused_out, expected_out, FP32_MODULE_RTOL, f"{op.__name__} output")
    for got, want, name in zip(fused, expected, ("input", "weight")):
      assert_close(got, want, FP32_MODULE_RTOL, f"{op.__name__} {name} gradient")


@pytest.mark.parametrize("slow_devices", [(0,), (1, 3)], ids=["device-0-late", "devices-1-3-late"])
def test_twins_are_exact_under_skewed_arrival_orders(slow_devices):
  """Some devices send late (their puts wait first), so tiles arrive in other orders than the ring's."""
  mesh = harness.cpu_mesh((4, 1))
  x, y, w = _per_device_inputs(4, 4)
  run = lambda fn: harness.per_device(fn, mesh, (SPEC_ALL, SPEC_ALL), SPEC_ALL)
  with harness.late_puts(slow_devices):
    gathered = run(lambda x, w: allgather_tpu.allgather_matmul(x, w, ("a",), num_blocks=1,
                                                              tiles=harness.TWIN_TILES)[0])(x, w)
    scattered = run(lambda y, w: scatter_tpu.matmul_reducescatter(y, w, ("a",), num_blocks=1,
                                                                 tiles=harness.TWIN_TILES))(y, w)
  assert_close(gathered, run(lambda x, w: allgather_api.allgather_matmul(x, w, ("a",), backend="collectives"))(x, w),
               FP32_MODULE_RTOL, "all-gather GEMM")
  assert_close(scattered, run(lambda y, w: scatter_api.matmul_reducescatter(y, w, ("a",), backend="collectives"))(
      y, w), FP32_MODULE_RTOL, "GEMM reduce-scatter")


def test_race_detector_catches_the_protocol_with_a_wait_left_out():
  """The harness can fail: the all-gather protocol with the notice waits left out (the blocks that read a
  row tile another block landed no longer wait for it) is flagged, and so is the kernel's verdict."""
  mesh = harness.cpu_mesh((2, 1))
  x, _, w = _per_device_inputs(2, 2)
  with harness.waits_left_out("await_notice"):
    harness.per_device(lambda x, w: allgather_tpu.allgather_matmul(x, w, ("a",), num_blocks=2,
                                                                  tiles=harness.TWIN_TILES)[0],
                       mesh, (SPEC_ALL, SPEC_ALL), SPEC_ALL)(x, w)
  assert harness.take_race_verdicts() == ["allgather_matmul"]


def test_unsupported_names_the_shape_that_does_not_tile():
  assert allgather_api.unsupported(128, 128, 256, jnp.bfloat16) is None
  assert "N=100" in allgather_api.unsupported(128, 128, 100, jnp.bfloat16)
  assert "dtype float32" in scatter_api.unsupported(128, 128, 256, jnp.float32)
  # The backward's transposed weight must tile too: K = 96 is a multiple of block_k (64)? No: and it is
  # the backward GEMM's output width, a multiple of block_n (128)? No.
  assert "K=96" in allgather_api.unsupported(128, 96, 256, jnp.bfloat16)
  big = mosaic_tiles.Tiles(block_n=256, stages=8)
  assert "shared memory" in allgather_api.unsupported(128, 512, 512, jnp.bfloat16, big)


@pytest.mark.slow
@pytest.mark.parametrize("tiles", [mosaic_tiles.DEFAULT_TILES, mosaic_tiles.HOPPER_TILES],
                         ids=["one-warpgroup", "warp-specialised"])
def test_mosaic_kernels_compile_for_8_h100s_forward_and_backward(tiles):
  """Warp-specialised: Hopper's 128 x 256 tiles, a producer and two consumers (gpu_warp_specialized.py)."""
  mesh = harness.h100_mesh(8)
  m, k, n = 128, 256, 256
  x = harness.abstract(mesh, (8 * m, k), jnp.bfloat16, P("x"))
  y = harness.abstract(mesh, (8 * 8, m, k), jnp.bfloat16, P("x"))
  w = harness.abstract(mesh, (8 * k, n), jnp.bfloat16, P("x"))

  def loss_and_grads(op):
    def per_device(a, w):
      loss, grads = jax.value_and_grad(
          lambda a, w: jnp.sum(op(a, w, "x", backend="mosaic_gpu", num_sms=harness.h100_sms(),
                                  tiles=tiles).astype(jnp.float32)),
          argnums=(0, 1))(a, w)
      return loss[None], grads
    return harness.per_device(per_device, mesh, (P("x"), P("x")), (P("x"), (P("x"), P("x"))), check_vma=True)

  for op, a in ((allgather_api.allgather_matmul, x), (scatter_api.matmul_reducescatter, y)):
    hlo = deviceless.compile_for_analysis(loss_and_grads(op).lower(a, w)).as_text()
    assert hlo.count('custom_call_target="mosaic_gpu') >= 2, f"{op.__name__}: forward and backward kernels"
    for collective in ("all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
      assert f" {collective}(" not in hlo and f" {collective}-start(" not in hlo, (op.__name__, collective)


@pytest.mark.parametrize("num_blocks,tiles", [(1, mosaic_tiles.DEFAULT_TILES), (3, mosaic_tiles.DEFAULT_TILES),
                                              (2, mosaic_tiles.Tiles(64, 128, 64, 2, consumers=2))],
                         ids=["1-block", "3-blocks", "warp-specialised"])
def test_mosaic_compute_path_equals_the_reference(num_blocks, tiles):
  """Warp-specialised: a producer and two consumers of 64 columns each (gpu_warp_specialized.py)."""
  mesh = harness.one_device_ring()
  m, k, n = 128, 128, 256  # 2 x 2 output tiles of 2 K steps, spread over `num_blocks` blocks
  keys = jax.random.split(jax.random.key(2), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
  y = jax.random.normal(keys[1], (1, m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(keys[2], (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  spec = P("x")
  run = lambda fn, in_specs: harness.per_device(fn, mesh, in_specs, spec)

  options = dict(num_blocks=num_blocks, tiles=tiles, interpret=harness.GPU_INTERPRET)
  out, gathered = run(lambda x, w: allgather_mosaic.allgather_matmul(x, w, ("x",), **options), (spec, P()))(x, w)
  expected = run(lambda x, w: allgather_api.allgather_matmul(x, w, "x", backend="collectives"), (spec, P()))(x, w)
  assert_close(out.astype(jnp.float32), expected.astype(jnp.float32), harness.BF16_RTOL, "all-gather GEMM")
  np.testing.assert_array_equal(np.asarray(gathered[0]), np.asarray(x), "the gathered block is my own")

  out = run(lambda y, w: scatter_mosaic.matmul_reducescatter(y, w, ("x",), **options), (spec, P()))(y, w)
  expected = run(lambda y, w: scatter_api.matmul_reducescatter(y, w, "x", backend="collectives"), (spec, P()))(y, w)
  assert_close(out.astype(jnp.float32), expected.astype(jnp.float32), harness.BF16_RTOL, "GEMM reduce-scatter")
