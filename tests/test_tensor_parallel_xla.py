"""The `xla` tier of the tensor-parallel projections (ring collective matmuls) equals the reference tier and
plain jnp on one device, forward and gradients, on 8 CPU devices; its compiled program passes blocks
with collective-permutes where the reference all-gathers and reduce-scatters.

A "block" here is attention's projections (q, k, v through one project_in, an elementwise mix, the output
projection), a residual add, then a SwiGLU-shaped MLP pair, so one compiled program per layout covers
project_in with several weights, project_out over two contracted dimensions and over one, and their
gradients.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshmoe.analysis import deviceless
from meshmoe.config import MeshConfig, ParallelConfig
from meshmoe.sharding import collective_matmul, tensor_parallel
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.shardings import use_plan
from tests.tolerances import FP32_MODULE_RTOL, assert_close
from tests.model_steps import gpu_mesh

B, S, D, N, H, F = 4, 16, 8, 8, 4, 16
QKV = [("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim"), ("embed", "kv_heads", "head_dim")]
OUT = ("heads", "head_dim", "embed")
GATE_UP = [("embed", "mlp"), ("embed", "mlp")]
DOWN = ("mlp", "embed")
NAMES = [*QKV, OUT, *GATE_UP, DOWN]

# (data, expert, tensor, sequence), preset. megascale splits heads over `tensor` but the sequence over
# `expert` x `sequence`: nothing to gather, so the xla tier falls back to the reference computation.
LAYOUTS = [
    ((2, 2, 2, 1), "tp_sp"), ((1, 1, 8, 1), "tp_sp"), ((1, 2, 4, 1), "tp_sp"), ((2, 1, 2, 2), "tp_sp"),
    ((1, 1, 4, 2), "tp_sp"), ((1, 4, 2, 1), "megascale"),
]
IDS = [f"{p}-{'x'.join(map(str, s))}" for s, p in LAYOUTS]
AXES = ("data", "expert", "tensor", "sequence")
# The CPU backend's LLVM optimisations take much of the compile time of these small unrolled programs and
# do not change the arithmetic.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _inputs():
  keys = jax.random.split(jax.random.key(0), 8)
  shapes = [(D, N, H), (D, N, H), (D, N, H), (N, H, D), (D, F), (D, F), (F, D)]
  weights = [jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0]) for k, shape in zip(keys, shapes)]
  return jax.random.normal(keys[7], (B, S, D), jnp.float32), weights


def _block(x, wq, wk, wv, wo, wg, wu, wd):
  q, k, v = tensor_parallel.project_in(x, [wq, wk, wv], QKV)
  attn = tensor_parallel.project_out(q * k + v, wo, OUT)
  gate, up = tensor_parallel.project_in(x + attn, [wg, wu], GATE_UP)
  mlp = tensor_parallel.project_out(jax.nn.silu(gate) * up, wd, DOWN)
  return q, k, v, attn, mlp


def _value_and_grads(block, x, weights):
  """Outputs of `block` and the gradients of sum(outputs * fixed random cotangents) for x and weights."""

  def forward_and_grads(x, weights):
    outs, vjp = jax.vjp(lambda x, weights: block(x, *weights), x, weights)
    keys = jax.random.split(jax.random.key(1), len(outs))
    cotangents = tuple(jax.random.normal(key, o.shape, o.dtype) for key, o in zip(keys, outs))
    return outs, vjp(cotangents)

  return jax.jit(forward_and_grads).lower(x, weights).compile(_FAST_COMPILE)(x, weights)


@functools.cache
def _one_device():
  return _value_and_grads(_block, *_inputs())


def _sharded(sizes, preset, impl):
  """_block under the plan of `preset` and tier `impl` on the layout, and x and the weights placed as the
  plan says."""
  data, expert, tensor, sequence = sizes
  mesh = make_mesh(MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset),
                   jax.devices())
  plan = ParallelPlan.for_mesh(mesh, preset, ParallelConfig(impl=impl))

  def block(*args):
    with use_plan(plan):
      return _block(*args)

  x_sharding = plan.activation_sharding(("act_batch", "act_seq", None))
  x, weights = _inputs()
  weights = [jax.device_put(w, NamedSharding(mesh, plan.param_spec(names))) for w, names in zip(weights, NAMES)]
  return block, jax.device_put(x, x_sharding), weights


def _compare(actual, expected, what):
  (outs, (dx, dweights)), (ref_outs, (ref_dx, ref_dweights)) = actual, expected
  for name, out, ref in zip(("q", "k", "v", "attention out", "mlp out"), outs, ref_outs):
    assert_close(out, ref, FP32_MODULE_RTOL, f"{what}: {name}")
  assert_close(dx, ref_dx, FP32_MODULE_RTOL, f"{what}: dx")
  for names, dw, ref in zip(NAMES, dweights, ref_dweights):
    assert_close(dw, ref, FP32_MODULE_RTOL, f"{what}: d{names}")


@pytest.mark.parametrize("sizes,preset", LAYOUTS, ids=IDS)
def test_xla_tier_matches_reference_tier_and_one_device(sizes, preset):
  xla = _value_and_grads(*_sharded(sizes, preset, "xla"))
  reference = _value_and_grads(*_sharded(sizes, preset, "reference"))
  _compare(xla, _one_device(), "xla vs one device")
  _compare(xla, reference, "xla vs reference")


# The ring functions on their own, over one mesh axis and over two (linear index a * 4 + b): against
# jax.lax.all_gather / psum_scatter with the same axes, forward and gradients.

RING_MESHES = [((2,), ("a",)), ((3,), ("a",)), ((8,), ("a",)), ((2, 4), ("a", "b"))]


@pytest.mark.parametrize("shape,names", RING_MESHES, ids=["x".join(map(str, m[0])) for m in RING_MESHES])
def test_ring_functions_match_the_collectives(shape, names):
  t = int(np.prod(shape))
  mesh = Mesh(np.array(jax.devices()[:t]).reshape(shape), names)
  keys = jax.random.split(jax.random.key(2), 4)
  x = jax.random.normal(keys[0], (2, 2 * t, D))  # 2 rows per device
  w1, w2 = jax.random.normal(keys[1], (D, 3, 2)), jax.random.normal(keys[2], (D, 5))
  wo = jax.random.normal(keys[3], (3, 2, D))
  split = P(None, names)

  def ring(x, w1, w2, wo):
    a, b = collective_matmul.allgather_matmul(x, [w1, w2], names)
    return a, b, collective_matmul.matmul_reducescatter(a, wo, names)

  def collectives(x, w1, w2, wo):
    gathered = jax.lax.all_gather(x, names, axis=1, tiled=True)
    a, b = jnp.einsum("bsd,dnh->bsnh", gathered, w1), gathered @ w2
    partial_sums = jnp.einsum("bsnh,nhd->bsd", a, wo)
    return a, b, jax.lax.psum_scatter(partial_sums, names, scatter_dimension=1, tiled=True)

  def value_and_grads(body):
    # The weights vary over the ring like x (collective_matmul's precondition). The gathered results are
    # the same [B, t*S, ...] on every device; out_specs stack the copies along the sequence.
    vary = lambda x, *ws: body(x, *(jax.lax.pcast(w, names, to="varying") for w in ws))
    fn = jax.shard_map(vary, mesh=mesh, in_specs=(split, P(), P(), P()), out_specs=(split, split, split))
    return _value_and_grads(fn, x, [w1, w2, wo])

  expected = value_and_grads(collectives)
  actual = value_and_grads(ring)
  (outs, (dx, dws)), (ref_outs, (ref_dx, ref_dws)) = actual, expected
  for name, out, ref in zip(("a", "b", "reduce-scattered"), outs, ref_outs):
    assert_close(out, ref, FP32_MODULE_RTOL, name)
  assert_close(dx, ref_dx, FP32_MODULE_RTOL, "dx")
  for name, dw, ref in zip(("dw1", "dw2", "dwo"), dws, ref_dws):
    assert_close(dw, ref, FP32_MODULE_RTOL, name)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_compiled_program_passes_blocks_instead_of_gathering_and_scattering(impl):
  # Forward and backward of the block on tp_sp 1x2x4x1: the reference all-gathers x (forward) and the
  # output gradients (backward) and reduce-scatters partial sums and input gradients; the xla tier does
  # all of it with collective-permutes. (The weight gradients' all-reduce over `expert` stays in both.)
  block, x, weights = _sharded((1, 2, 4, 1), "tp_sp", impl)

  def forward_and_grads(x, weights):
    outs, vjp = jax.vjp(lambda x, weights: block(x, *weights), x, weights)
    return outs, vjp(outs)

  hlo = deviceless.compile_for_analysis(jax.jit(forward_and_grads).lower(x, weights)).as_text()
  collectives = {op: f" {op}(" in hlo or f" {op}-start(" in hlo
                 for op in ("all-gather", "reduce-scatter", "collective-permute")}
  xla = impl == "xla"
  assert collectives == {"all-gather": not xla, "reduce-scatter": not xla, "collective-permute": xla}, impl


# What the xla tier is for: on GPUs each transfer runs while a matmul computes. Compiled deviceless for 8
# H100s (the CUDA PJRT plugin, no GPU), nearly every collective-permute of the block's forward and backward
# is asynchronous with a matmul between its start and its done (seen: all but 1 of 56 on jax 0.11.2, all
# but 3 on 0.12; XLA's scheduler decides). Without the rings' chain of steps (collective_matmul._after) XLA
# merges the per-block matmuls into one and almost no transfer overlaps a matmul.

_MATMUL = re.compile(r'"kind":"[^"]*gemm|__cublas')


def overlapped_transfers(hlo: str) -> tuple[int, list[str]]:
  """(collective-permutes, those not overlapped with a matmul) in the scheduled computations of `hlo`
  (the entry and loop bodies): a synchronous one, or a start with no matmul before its done."""
  total, exposed = 0, []
  for computation in re.split(r"\n(?=\S)", hlo):  # computations start at column 0
    lines = computation.splitlines()
    sync = [line.strip()[:100] for line in lines if " collective-permute(" in line]
    starts = {m[1]: i for i, line in enumerate(lines)
              if (m := re.search(r"(%\S+) = .* collective-permute-start\(", line))}
    total += len(sync) + len(starts)
    exposed += sync
    for name, at in starts.items():
      done = next(i for i, line in enumerate(lines) if f"collective-permute-done({name})" in line)
      if not any(_MATMUL.search(line) for line in lines[at + 1:done]):
        exposed.append(name)
  return total, exposed


def test_h100_program_overlaps_the_transfers_with_matmuls():
  mesh = gpu_mesh((1, 1, 8, 1), AXES)
  b, s, d = 2, 1024, 1024
  plan = ParallelPlan.for_mesh(mesh, "tp_sp", ParallelConfig(impl="xla"))
  x = jax.ShapeDtypeStruct((b, s, d), jnp.bfloat16, sharding=plan.activation_sharding(("act_batch", "act_seq", None)))
  shapes = [(d, N, 32), (d, N, 32), (d, N, 32), (N, 32, d), (d, 4 * d), (d, 4 * d), (4 * d, d)]
  placements = [NamedSharding(mesh, plan.param_spec(names)) for names in NAMES]
  weights = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=placement)
             for shape, placement in zip(shapes, placements)]

  def forward_and_grads(x, weights):
    with use_plan(plan):
      outs, vjp = jax.vjp(lambda x, weights: _block(x, *weights), x, weights)
    return outs, vjp(outs)

  total, exposed = overlapped_transfers(deviceless.compile_for_analysis(jax.jit(forward_and_grads).lower(x, weights)).as_text())
  # Per ring of 8 (4 clockwise and 3 counter-clockwise steps) 7 transfers; 4 rings forward, 4 backward.
  assert total >= 7 * 8, total
  assert len(exposed) <= total // 10, exposed
