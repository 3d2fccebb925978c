"""The `xla` tier of ring attention (sharding/context_parallel.py) against jax.nn.dot_product_attention.

As in test_context_parallel.py: the reference is causal attention over the whole sequence in natural order
on one device; the sharded ring sees the sequence in zigzag order split over 2, 4 or 8 CPU devices (one or
two mesh axes, with and without a batch split), and its output rows and input gradients are put back in
natural order before the comparison. The executed FLOPs show that the causal quarter blocks are skipped,
and the program compiled for 8 H100s that the transfers overlap matmuls.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshmoe.analysis import deviceless, hlo_flops
from meshmoe.config import MeshConfig, ParallelConfig
from meshmoe.sharding import context_parallel as cp
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.shardings import use_plan
from tests.test_context_parallel import (LAYOUTS, _count, _mesh, _qkv, _reference_and_grads, _spec,
                                         assert_sharded_matches)
from tests.test_tensor_parallel_xla import overlapped_transfers
from tests.model_steps import gpu_mesh

B, H = 2, 8


def _sharded_fn(mesh, batch_axes, seq_axes, implementation="zigzag_ring"):
  """q, k, v, positions (zigzag order, global) -> output (zigzag order, global), by shard_map."""
  spec = _spec(batch_axes, seq_axes)

  def attend(q, k, v, pos):
    return cp.sharded_attention(q, k, v, pos, implementation=implementation, axis_names=seq_axes)

  return jax.shard_map(attend, mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec)


@pytest.mark.parametrize("shape,names,batch_axes,seq_axes", LAYOUTS,
                         ids=[f"{'x'.join(map(str, c[0]))}-{'+'.join(c[3])}" + ("-batch" if c[2] else "")
                              for c in LAYOUTS])
def test_xla_ring_matches_reference(shape, names, batch_axes, seq_axes):
  mesh = _mesh(shape, names)
  n = int(np.prod([mesh.shape[a] for a in seq_axes]))
  s = 32
  q, k, v, ct = _qkv(B, s, 8, 4, H)
  order = cp.zigzag_order(s, n)
  inverse = np.argsort(order)
  pos = jnp.broadcast_to(jnp.asarray(order), (B, s))
  sharding = NamedSharding(mesh, _spec(batch_axes, seq_axes))
  args = [jax.device_put(a, sharding) for a in (q[:, order], k[:, order], v[:, order], pos, ct[:, order])]
  attend = _sharded_fn(mesh, batch_axes, seq_axes)
  assert_sharded_matches(attend, args, inverse, _reference_and_grads(q, k, v, ct), "xla ring")


def _flops(implementation, n):
  mesh = _mesh((n,), ("seq",))
  q, k, v, _ = _qkv(1, 16 * n, 4, 4, 16)
  pos = jnp.broadcast_to(jnp.asarray(cp.zigzag_order(16 * n, n)), (1, 16 * n))
  compiled = jax.jit(_sharded_fn(mesh, (), ("seq",), implementation)).lower(q, k, v, pos).compile()
  # Matmul FLOPs counted per loop iteration: XLA's cost_analysis counts the all-gather kind's loops once.
  return hlo_flops.matmul_flops(compiled.as_text())


@pytest.mark.parametrize("n", [4, 8])
def test_xla_ring_computes_only_the_causal_blocks(n):
  # 2n+1 quarter blocks per device like the all-gather kind, against the reference ring's n dense blocks
  # (4n quarters): 9/16 at n = 4, 17/32 at n = 8.
  ring_xla, allgather, ring_reference = (_flops(implementation, n) for implementation in
                                         ("zigzag_ring", "allgather", "ring"))
  assert abs(ring_xla / allgather - 1) < 0.1, (ring_xla, allgather)
  assert ring_xla < 0.65 * ring_reference, (ring_xla, ring_reference)


def test_attention_op_runs_what_the_plan_says_for_the_tier():
  # The op models call, under tp_sp with the sequence over 4 `sequence` devices: the xla ring traces 2n+1
  # blocks of two matmuls each, the reference ring n; both n-1 transfers of (k, v, positions).
  mesh = make_mesh(MeshConfig(data=1, expert=2, tensor=1, sequence=4, preset="tp_sp"), jax.devices())
  q, k, v, _ = _qkv(2, 32, 4, 4, H)
  pos = jnp.broadcast_to(jnp.asarray(cp.zigzag_order(32, 4)), (2, 32))

  def jaxpr(impl):
    plan = ParallelPlan.for_mesh(mesh, "tp_sp", ParallelConfig(impl=impl, attention="ring"))
    assert plan.attention().implementation == {"xla": "zigzag_ring", "reference": "ring"}[impl]
    # A fresh function each time: tracing caches by function and shapes, and the plan is not part of that
    # key.
    with use_plan(plan):
      return jax.make_jaxpr(lambda *args: cp.attention(*args))(q, k, v, pos).jaxpr

  xla, reference = jaxpr("xla"), jaxpr("reference")
  assert _count(xla, "dot_general") == 2 * (2 * 4 + 1) and _count(reference, "dot_general") == 2 * 4
  assert _count(xla, "ppermute") == _count(reference, "ppermute") == 3 * 3


@pytest.mark.parametrize("kind", ["allgather", "ulysses"])
def test_other_kinds_run_the_same_implementation_in_every_tier(kind):
  mesh = make_mesh(MeshConfig(data=1, expert=2, tensor=1, sequence=4, preset="tp_sp"), jax.devices())
  chosen = {ParallelPlan.for_mesh(mesh, "tp_sp", ParallelConfig(impl=impl, attention=kind)).attention()
            for impl in ("reference", "xla", "pallas")}
  assert {choice.implementation for choice in chosen} == {kind}


@pytest.mark.parametrize("implementation", ["ring", "zigzag_ring"])
def test_h100_program_overlaps_the_transfers_with_matmuls(implementation):
  # Compiled deviceless for 8 H100s, forward and backward: the zigzag ring (xla tier) has a matmul between
  # the start and the done of every collective-permute. The plain ring's independent steps let XLA merge its score
  # matmuls across steps, so that most of its transfers overlap nothing (seen: 22 of 32).
  mesh = gpu_mesh((8,), ("seq",))
  sharding = NamedSharding(mesh, P(None, "seq"))
  q = jax.ShapeDtypeStruct((1, 4096, 8, 64), jnp.bfloat16, sharding=sharding)
  pos = jax.ShapeDtypeStruct((1, 4096), jnp.int32, sharding=sharding)
  attend = _sharded_fn(mesh, (), ("seq",), implementation)

  def forward_and_grads(q, k, v, pos):
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, pos), q, k, v)
    return out, vjp(out)

  total, exposed = overlapped_transfers(deviceless.compile_for_analysis(jax.jit(forward_and_grads).lower(q, q, q, pos)).as_text())
  assert total >= 2 * 7, total  # 7 transfers of (k, v, positions) forward, 7 of (dk, dv) backward
  if implementation == "zigzag_ring":
    assert not exposed, exposed
  else:
    assert len(exposed) > total // 2, exposed
