"""The HLO collective parser on hand-written lines in each of XLA's spellings, and on a compiled program."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from meshmoe.analysis import hlo_collectives

LINES = """
  %all-gather.1 = f32[8,64]{1,0} all-gather(%p), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %ag-start = (f32[2,64]{1,0}, f32[8,64]{1,0}) all-gather-start(%p), replica_groups=[2,4]<=[8], dimensions={0}
  %ag-done = f32[8,64]{1,0} all-gather-done(%ag-start)
  %rs = bf16[4,16]{1,0} reduce-scatter(%q), replica_groups=mesh['data'=2,'expert'=4] {'expert'}, dimensions={0}
  ROOT %ar = (f32[10]{0}, s32[6]{0}) all-reduce(%a, %b), replica_groups={}, to_apply=%add
  %a2a = (f32[1,16]{1,0}, f32[1,16]{1,0}) all-to-all(%x, %y), replica_groups={{0,1},{2,3},{4,5},{6,7}}
  %cp = f32[32]{0} collective-permute(%z), source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %add.3 = f32[8,64]{1,0} add(%all-gather.1, %all-gather.1)
"""


def test_parses_every_spelling_and_counts_async_pairs_once():
  found = hlo_collectives.collectives(LINES, num_devices=8)
  assert [(c.kind, c.group_size, c.result_bytes) for c in found] == [
      ("all-gather", 4, 8 * 64 * 4),
      ("all-gather", 4, 8 * 64 * 4),  # the done's result (the start's tuple holds operand and result)
      ("reduce-scatter", 4, 4 * 16 * 2),
      ("all-reduce", 8, 10 * 4 + 6 * 4),
      ("all-to-all", 2, 2 * 16 * 4),
      ("collective-permute", 4, 32 * 4),
  ]
  by_kind = hlo_collectives.bytes_by_kind(found)
  assert by_kind["all-gather"] == pytest.approx(2 * 3 / 4 * 8 * 64 * 4)
  assert by_kind["reduce-scatter"] == pytest.approx(3 * 4 * 16 * 2)
  assert by_kind["all-reduce"] == pytest.approx(2 * 7 / 8 * 64)
  assert by_kind["all-to-all"] == pytest.approx(1 / 2 * 128)
  assert by_kind["collective-permute"] == pytest.approx(128)


def test_compiled_shard_map_collectives_have_their_textbook_sizes():
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

  def body(x):  # x: [4, 32] per device
    gathered = jax.lax.all_gather(x, "b", axis=0, tiled=True)  # [16, 32]
    scattered = jax.lax.psum_scatter(gathered, "b", scatter_dimension=0, tiled=True)  # [4, 32]
    return jax.lax.psum(scattered, "a")

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P("b")))
  x = jax.device_put(np.ones((32, 32), np.float32), NamedSharding(mesh, P(("a", "b"))))
  found = hlo_collectives.bytes_by_kind(hlo_collectives.collectives(f.lower(x).compile().as_text(), 8))
  block = 4 * 32 * 4
  assert found["all-gather"] == pytest.approx(3 / 4 * 4 * block)
  assert found["reduce-scatter"] == pytest.approx(3 * block)
  assert found["all-reduce"] == pytest.approx(2 * 1 / 2 * block)
  assert np.asarray(f(x))[0, 0] == 8.0  # 4 gathered copies summed per b-group, then over a
