"""Loop-aware HLO analysis (hlo_module, hlo_flops, hlo_collectives): run counts, matmul FLOPs, overlap.

References: XLA's cost_analysis() of the same program with its loop unrolled (where it is exact), and
hand-written scheduled modules in the shapes GPU compiles produce.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshmoe.analysis import hlo_collectives, hlo_flops, hlo_module


def _layers(x, ws, unroll):
  def layer(x, w):
    return jnp.tanh(x @ w), None
  return jax.lax.scan(layer, x, ws, unroll=unroll)[0]


@pytest.mark.parametrize("grad", [False, True])
def test_matmul_flops_count_each_loop_iteration(grad):
  x, ws = jnp.ones((64, 32)), jnp.ones((6, 32, 32))
  f = (lambda x, ws, u: _layers(x, ws, u)) if not grad else \
      (lambda x, ws, u: jax.grad(lambda x, ws: _layers(x, ws, u).sum(), argnums=(0, 1))(x, ws))
  rolled = jax.jit(lambda x, ws: f(x, ws, 1)).lower(x, ws).compile()
  unrolled = jax.jit(lambda x, ws: f(x, ws, True)).lower(x, ws).compile()
  per_matmul = 2 * 64 * 32 * 32
  expected = 6 * per_matmul * (3 if grad else 1)  # forward; backward adds dx and dw
  assert hlo_flops.matmul_flops(rolled.as_text()) == expected
  assert hlo_flops.matmul_flops(unrolled.as_text()) == expected
  # XLA's own count sees the loop body once: what this module exists to correct.
  assert rolled.cost_analysis()["flops"] < expected / 2


def test_collectives_inside_a_loop_count_per_iteration():
  mesh = jax.make_mesh((8,), ("a",), axis_types=(jax.sharding.AxisType.Explicit,))

  def body(x):  # [4, 16] per device, summed over the 8 devices 5 times
    step = lambda _, y: jax.lax.pcast(jax.lax.psum(y, "a") * 0.125, "a", to="varying")
    return jax.lax.fori_loop(0, 5, step, x)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("a"), out_specs=P("a")))
  x = jax.device_put(np.ones((32, 16), np.float32), NamedSharding(mesh, P("a")))
  found = hlo_collectives.collectives(f.lower(x).compile().as_text(), 8)
  assert [c.kind for c in found] == ["all-reduce"] and found[0].count == 5
  assert hlo_collectives.bytes_by_kind(found)["all-reduce"] == pytest.approx(5 * 2 * 7 / 8 * 4 * 16 * 4)


SCHEDULED = """
HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%gemm (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %d = f32[64,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%triton_ar (q: f32[1024]) -> f32[1024] {
  %q = f32[1024]{0} parameter(0)
  ROOT %ar = f32[1024]{0} all-reduce(%q), replica_groups=[1,8]<=[8], to_apply=%add
}

%body (t: (s32[], f32[64,64], f32[16,64])) -> (s32[], f32[64,64], f32[16,64]) {
  %t = (s32[], f32[64,64]{1,0}, f32[16,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = f32[64,64]{1,0} get-tuple-element(%t), index=1
  %x = f32[16,64]{1,0} get-tuple-element(%t), index=2
  %ag = (f32[16,64]{1,0}, f32[64,64]{1,0}) all-gather-start(%x), replica_groups=[2,4]<=[8], dimensions={0}
  %mm = f32[64,64]{1,0} fusion(%w, %w), kind=kCustom, calls=%gemm
  %agd = f32[64,64]{1,0} all-gather-done(%ag)
  %next = (f32[16,64]{1,0}, f32[16,64]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  ROOT %out = (s32[], f32[64,64]{1,0}, f32[16,64]{1,0}) tuple(%i, %mm, %x)
}

%cond (t: (s32[], f32[64,64], f32[16,64])) -> pred[] {
  %t = (s32[], f32[64,64]{1,0}, f32[16,64]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (w: f32[64,64], x: f32[16,64], v: f32[1024]) -> f32[1024] {
  %w = f32[64,64]{1,0} parameter(0)
  %x = f32[16,64]{1,0} parameter(1)
  %v = f32[1024]{0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,64]{1,0}, f32[16,64]{1,0}) tuple(%zero, %w, %x)
  %loop = (s32[], f32[64,64]{1,0}, f32[16,64]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %fs = ((f32[1024]{0}), f32[1024]{0}) fusion-start(%v), kind=kCustom, calls=%triton_ar
  %fd = f32[1024]{0} fusion-done(%fs)
  %rs = f32[128]{0} reduce-scatter(%fd), replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add, backend_config={"collective_backend_config":{"is_sync":true}}
  ROOT %r = f32[1024]{0} all-reduce(%v), replica_groups=[1,8]<=[8], to_apply=%add
}
"""


def test_overlap_and_run_counts_in_a_scheduled_module():
  found = {c.kind: c for c in hlo_collectives.collectives(SCHEDULED, 8)}
  gather, permute = found["all-gather"], found["collective-permute"]
  # A GEMM sits between the gather's start and done. The permute's done would come in the next iteration,
  # but no compute follows its start in this one: exposed.
  assert (gather.count, gather.result_bytes, gather.overlapped) == (4, 64 * 64 * 4, True)
  assert (permute.count, permute.result_bytes, permute.overlapped) == (4, 16 * 64 * 4, False)
  # The all-reduce inside the Triton collective fusion has nothing between its start and done.
  reductions = [c for c in hlo_collectives.collectives(SCHEDULED, 8) if c.kind == "all-reduce"]
  assert [(c.result_bytes, c.overlapped) for c in reductions] == [(4096, False), (4096, False)]
  assert found["reduce-scatter"].overlapped is False
  assert hlo_flops.matmul_flops(SCHEDULED) == 4 * 2 * 64 ** 3
  fraction = hlo_collectives.overlap_fraction(list(hlo_collectives.collectives(SCHEDULED, 8)))
  assert fraction == pytest.approx(gather.bytes / sum(c.bytes for c in hlo_collectives.collectives(SCHEDULED, 8)))


def test_a_start_whose_done_is_in_the_next_iteration_overlaps_the_compute_after_it():
  pipelined = SCHEDULED.replace(
      "  ROOT %out = (s32[], f32[64,64]{1,0}, f32[16,64]{1,0}) tuple(%i, %mm, %x)",
      "  %mm2 = f32[64,64]{1,0} fusion(%w, %w), kind=kCustom, calls=%gemm\n"
      "  ROOT %out = (s32[], f32[64,64]{1,0}, f32[16,64]{1,0}) tuple(%i, %mm2, %x)")
  permute = next(c for c in hlo_collectives.collectives(pipelined, 8) if c.kind == "collective-permute")
  assert permute.overlapped
  assert hlo_flops.matmul_flops(pipelined) == 2 * 4 * 2 * 64 ** 3


def test_tuple_elements_and_shape_bytes():
  shape = "((f32[2,4]{1,0}, bf16[8]{0}), f32[16]{0}, /*index=2*/s32[])"
  assert hlo_module.tuple_elements(shape) == ["(f32[2,4]{1,0}, bf16[8]{0})", "f32[16]{0}", "s32[]"]
  assert hlo_module.shape_bytes(shape) == 2 * 4 * 4 + 8 * 2 + 16 * 4 + 4


def test_bookkeeping_between_start_and_done_hides_nothing():
  elementwise = SCHEDULED.replace(
      "%gemm (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {",
      "%scale (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {\n"
      "  %e0 = f32[64,64]{1,0} parameter(0)\n  %e1 = f32[64,64]{1,0} parameter(1)\n"
      "  ROOT %e = f32[64,64]{1,0} multiply(%e0, %e1)\n}\n\n"
      "%gemm (p0: f32[64,64], p1: f32[64,64]) -> f32[64,64] {").replace(
      "%mm = f32[64,64]{1,0} fusion(%w, %w), kind=kCustom, calls=%gemm",
      "%mm = f32[64,64]{1,0} fusion(%w, %w), kind=kLoop, calls=%scale")
  gather = next(c for c in hlo_collectives.collectives(elementwise, 8) if c.kind == "all-gather")
  assert not gather.overlapped
