"""The CPU's blocked grouped expert FFN (sharding/blocked_gemm.py): capacity blocks plus overflow tiles.

Forward and gradients are held to a dense reference that multiplies every row by every expert and keeps
its own expert's result (independent of the sorting, blocks and tiles), fp32, 1e-5 relative, over routings
drawn by hypothesis: empty experts, every row on one expert, rows of no expert (padding), blocks sized
for fewer or more rows than are routed, tiles of several heights. The layout itself is checked to put
every routed row in exactly one place and to need no overflow tile under balanced routing.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from meshmoe.models.layers import swiglu_hidden
from meshmoe.sharding import blocked_gemm, grouped_ffn
from meshmoe.sharding.grouped_ffn import ExpertWeights
from tests.tolerances import FP32_MODULE_RTOL, assert_close

R, D, F, E = 48, 8, 12, 4
_rng = np.random.default_rng(0)
X_RD = jnp.asarray(_rng.normal(size=(R, D)), jnp.float32)
DY_RD = jnp.asarray(_rng.normal(size=(R, D)), jnp.float32)
W = ExpertWeights(*(jnp.asarray(_rng.normal(size=shape) * 0.3, jnp.float32)
                    for shape in ((E, D, F), (E, D, F), (E, F, D))))


def _dense_reference(x_RD, expert_R, w: ExpertWeights):
  """Every row through every expert, then its own expert's output (zeros for id E)."""
  gate_REF = jnp.einsum("rd,edf->ref", x_RD, w.gate_EDF)
  up_REF = jnp.einsum("rd,edf->ref", x_RD, w.up_EDF)
  y_RED = jnp.einsum("ref,efd->red", swiglu_hidden(gate_REF, up_REF), w.down_EFD)
  return jnp.einsum("red,re->rd", y_RED, jax.nn.one_hot(expert_R, E))


@pytest.fixture(scope="module")
def compiled():
  """Value and gradients of <y, dy> for each (tile rows, routed rows); compiled once per pair."""
  cache = {}

  def get(tile_rows: int, routed_rows: int):
    if (tile_rows, routed_rows) not in cache:
      def loss(x, w, expert_R):
        y = grouped_ffn.grouped_ffn(x, expert_R, w, swiglu_hidden, "blocked", tile_rows, routed_rows=routed_rows)
        return jnp.sum(y * DY_RD), y
      cache[tile_rows, routed_rows] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    return cache[tile_rows, routed_rows]

  return get


ROUTINGS = st.one_of(
    st.lists(st.integers(0, E), min_size=R, max_size=R),  # any mix, padding rows (id E) included
    st.lists(st.integers(1, 2), min_size=R, max_size=R),  # experts 0 and 3 empty
    st.integers(0, E).map(lambda e: [e] * R),  # every row on one expert, or none routed at all
)


@settings(max_examples=12, deadline=None)
@given(expert_R=ROUTINGS, tile_rows=st.sampled_from([1, 4, 16]), routed_rows=st.sampled_from([0, 12, 40]))
def test_forward_and_gradients_match_dense_reference(compiled, expert_R, tile_rows, routed_rows):
  expert_R = jnp.asarray(expert_R, jnp.int32)
  (_, y_RD), (dx_RD, dw) = compiled(tile_rows, routed_rows)(X_RD, W, expert_R)
  reference = lambda x, w: jnp.sum(_dense_reference(x, expert_R, w) * DY_RD)
  dx_ref, dw_ref = jax.grad(reference, argnums=(0, 1))(X_RD, W)
  assert_close(y_RD, _dense_reference(X_RD, expert_R, W), FP32_MODULE_RTOL, "y")
  assert_close(dx_RD, dx_ref, FP32_MODULE_RTOL, "dx")
  for name in ("gate_EDF", "up_EDF", "down_EFD"):
    if float(jnp.max(jnp.abs(getattr(dw_ref, name)))) == 0.0:  # no row routed at all
      assert float(jnp.max(jnp.abs(getattr(dw, name)))) == 0.0, name
    else:
      assert_close(getattr(dw, name), getattr(dw_ref, name), FP32_MODULE_RTOL, name)


def _placements(expert_R: np.ndarray, capacity: int, tile_rows: int) -> np.ndarray:
  """How many times the layout computes each input row (blocks + overflow tiles' own rows)."""
  order_R = np.argsort(expert_R, kind="stable")
  sizes_E = np.bincount(expert_R, minlength=E + 1)[:E]
  lay = blocked_gemm.layout(jnp.asarray(order_R, jnp.int32), jnp.asarray(sizes_E, jnp.int32), capacity, tile_rows)
  lay = jax.tree.map(np.asarray, lay)
  count = np.bincount(lay.source_EC.ravel(), minlength=R + 1)[:R]
  for m in range(int(lay.tiles.used)):
    start, end = lay.tiles.start_M[m], lay.tiles.end_M[m]
    for position in range(start, min(start + tile_rows, end)):
      count[lay.source_P[position]] += 1
  return count


@pytest.mark.parametrize("tile_rows", [1, 5, 16])
@pytest.mark.parametrize("routing", ["balanced", "skewed", "one_expert", "with_padding"])
def test_every_routed_row_is_computed_once(routing, tile_rows):
  rows = np.arange(R)
  expert_R = {"balanced": rows % E, "skewed": np.minimum(rows // 7, E - 1), "one_expert": np.full(R, 2),
              "with_padding": np.where(rows % 3 == 0, E, rows % E)}[routing]
  capacity = blocked_gemm.capacity_rows(R, E)
  np.testing.assert_array_equal(_placements(expert_R, capacity, tile_rows), (expert_R < E).astype(int))


def test_balanced_routing_needs_no_overflow_and_worst_case_fits_the_table():
  capacity = blocked_gemm.capacity_rows(R, E)
  balanced = blocked_gemm.layout(jnp.arange(R, dtype=jnp.int32), jnp.full((E,), R // E, jnp.int32), capacity, 4)
  assert int(balanced.tiles.used) == 0
  # Every row on one expert: R - C rows overflow, in whole tiles, within the static table.
  one = blocked_gemm.layout(jnp.arange(R, dtype=jnp.int32), jnp.asarray([R, 0, 0, 0], jnp.int32), capacity, 5)
  assert int(one.tiles.used) == -(-(R - capacity) // 5) <= one.tiles.expert_M.shape[0]
  assert blocked_gemm.computed_rows(R, R, E, 5) == E * capacity
  assert blocked_gemm.computed_rows(R, R, E, 5, worst_case=True) == E * capacity + one.tiles.expert_M.shape[0] * 5
