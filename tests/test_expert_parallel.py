"""Expert parallelism (sharding/expert_parallel.py) equals the one-device MoE arithmetic on 8 CPU devices.

The reference is grouped_ffn.moe_local on one device, itself checked against the naive per-token reference
in test_moe.py: the output tensor element by element and the gradients of the inputs, the combine weights
and the expert weights. Loads are made uneven on purpose: some experts get no tokens, one gets most of
them, and some assignments are dropped (expert id E), as capacity mode produces.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshmoe.config import MeshConfig, ParallelConfig
from meshmoe.models.layers import swiglu_hidden
from meshmoe.sharding import expert_parallel, grouped_ffn
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.shardings import use_plan
from tests.tolerances import FP32_MODULE_RTOL, assert_close

B, S, D, F, E, K = 8, 8, 16, 12, 8, 2

LAYOUTS = [
    ((1, 8, 1, 1), "ep"), ((2, 4, 1, 1), "ep"), ((8, 1, 1, 1), "dp"), ((2, 2, 2, 1), "tp_sp"),
    ((1, 4, 2, 1), "tp_sp"), ((2, 2, 1, 2), "megascale"), ((1, 2, 2, 2), "megascale"),
    ((1, 4, 1, 2), "megascale"), ((2, 2, 2, 1), "fsdp"),
]


def _inputs(load: str):
  keys = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(keys[0], (B, S, D), jnp.float32)
  if load == "uneven":  # experts 5..7 get nothing, expert 0 most of the first choices
    first = jnp.where(jax.random.uniform(keys[1], (B, S)) < 0.7, 0, jax.random.randint(keys[2], (B, S), 1, 5))
    experts = jnp.stack([first, (first + 1) % 5], axis=-1)
  else:
    experts = jnp.argsort(jax.random.uniform(keys[1], (B, S, E)), axis=-1)[..., :K]
  if load == "dropped":  # a third of the assignments dropped by capacity
    experts = jnp.where(jax.random.uniform(keys[3], (B, S, K)) < 0.33, E, experts)
  weights = jax.random.uniform(keys[4], (B, S, K), jnp.float32)
  w_keys = jax.random.split(keys[5], 3)
  w = grouped_ffn.ExpertWeights(0.3 * jax.random.normal(w_keys[0], (E, D, F)),
                             0.3 * jax.random.normal(w_keys[1], (E, D, F)),
                             0.3 * jax.random.normal(w_keys[2], (E, F, D)))
  return x, experts.astype(jnp.int32), weights, w


def local_moe(x, experts, weights, w):
  """The one-device reference."""
  return grouped_ffn.moe_local(x, experts, weights, w, swiglu_hidden, "blocked")


# One jitted gradient program per op function: tests that run the same op (local_moe, or one layout's op
# from `sharded_op`) on other inputs of the same shapes share its compile, which is most of their time.
_GRADIENT_PROGRAMS: dict = {}


def output_and_grads(fn, x, experts, weights, w, cotangent):
  """(fn's output, the gradients of <output, cotangent> with respect to x, weights and w)."""
  if fn not in _GRADIENT_PROGRAMS:
    def loss(x, weights, w, experts, cotangent):
      y = fn(x, experts, weights, w)
      return jnp.sum(y * cotangent), y
    _GRADIENT_PROGRAMS[fn] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  (_, y), grads = _GRADIENT_PROGRAMS[fn](x, weights, w, experts, cotangent)
  return y, grads


def assert_matches(got, want) -> None:
  """`output_and_grads` results equal: the whole output tensor, then every gradient."""
  (y, grads), (ref_y, ref_grads) = got, want
  assert_close(y, ref_y, FP32_MODULE_RTOL, "output")
  for name, got_grad, want_grad in zip(("x", "weights", "w"), grads, ref_grads):
    for leaf_got, leaf_want in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
      assert_close(leaf_got, leaf_want, FP32_MODULE_RTOL, f"grad {name}")


def _sharded(sizes, preset, parallel: ParallelConfig | None = None):
  """The op on a mesh of `sizes` run by the plan of `preset` and `parallel` (default: the reference tier,
  blocked GEMM), and how to place its inputs."""
  data, expert, tensor, sequence = sizes
  mesh = make_mesh(MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset),
                   jax.devices())
  plan = ParallelPlan.for_mesh(mesh, preset, parallel or ParallelConfig(grouped_gemm="blocked"))

  def fn(x, experts, weights, w):
    with use_plan(plan):
      return expert_parallel.moe_ffn(x, experts, weights, w, swiglu_hidden)

  def place(x, experts, weights, w):
    tokens = plan.activation_sharding(("act_batch", "act_seq", None))
    names = {"gate_EDF": ("exp", "embed", "exp_mlp"), "up_EDF": ("exp", "embed", "exp_mlp"),
             "down_EFD": ("exp", "exp_mlp", "embed")}
    w = grouped_ffn.ExpertWeights(*(jax.device_put(getattr(w, n), NamedSharding(mesh, plan.param_spec(axes)))
                                    for n, axes in names.items()))
    return (jax.device_put(x, tokens), jax.device_put(experts, tokens), jax.device_put(weights, tokens), w)

  return fn, place, mesh


_SHARDED_OPS: dict = {}


def sharded_op(sizes, preset, parallel: ParallelConfig | None = None):
  """`_sharded`'s (op, place), made once per layout and configuration so that its compiled programs are
  shared by the tests that use it. A test that changes what tracing sees (a monkeypatched collective)
  must call `_sharded` for a fresh op instead."""
  key = (sizes, preset, repr(parallel))
  if key not in _SHARDED_OPS:
    _SHARDED_OPS[key] = _sharded(sizes, preset, parallel)[:2]
  return _SHARDED_OPS[key]


@pytest.mark.parametrize("load", ["balanced", "uneven", "dropped"])
@pytest.mark.parametrize("sizes,preset", LAYOUTS, ids=[f"{p}-{'x'.join(map(str, s))}" for s, p in LAYOUTS])
def test_expert_parallel_matches_one_device(sizes, preset, load):
  x, experts, weights, w = _inputs(load)
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  fn, place = sharded_op(sizes, preset)
  assert_matches(output_and_grads(fn, *place(x, experts, weights, w), cotangent),
                 output_and_grads(local_moe, x, experts, weights, w, cotangent))


def test_experts_receiving_no_tokens_get_zero_gradient():
  x, experts, weights, w = _inputs("uneven")
  fn, place = sharded_op((1, 8, 1, 1), "ep")
  _, (_, _, grad_w) = output_and_grads(fn, *place(x, experts, weights, w), jnp.ones_like(x))
  assert np.all(np.asarray(grad_w.gate_EDF)[5:] == 0)
  assert np.any(np.asarray(grad_w.gate_EDF)[0] != 0)


@pytest.mark.parametrize("sizes,preset", [((1, 8, 1, 1), "ep"), ((2, 2, 1, 2), "megascale")])
def test_dispatch_is_all_to_all_not_a_gather_of_the_tokens(sizes, preset):
  x, experts, weights, w = _inputs("balanced")
  fn, place, _ = _sharded(sizes, preset)
  hlo = jax.jit(fn).lower(*place(x, experts, weights, w)).compile().as_text()
  assert "all-to-all" in hlo
  assert "all-gather" not in hlo, "the expert-parallel dispatch must not gather tokens"


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name, axis_index_groups=None):
  """jax.lax.ragged_all_to_all's definition, built from all_gathers and scatters (XLA:CPU has no ragged
  all-to-all): sender p's rows operand_p[input_offsets_p[me] :][: send_sizes_p[me]] land at
  output[output_offsets_p[me] :]."""
  del recv_sizes, axis_index_groups  # implied by the senders' sizes
  me = jax.lax.axis_index(axis_name)
  operands = jax.lax.all_gather(operand, axis_name)
  read_at, sizes, write_at = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
  rows = jnp.arange(operand.shape[0])
  for peer in range(operands.shape[0]):
    source = jnp.minimum(read_at[peer, me] + rows, operand.shape[0] - 1)
    target = jnp.where(rows < sizes[peer, me], write_at[peer, me] + rows, output.shape[0])  # past the end: dropped
    output = output.at[target].set(operands[peer][source], mode="drop")
  return output


_RAGGED_LAYOUTS = [((1, 8, 1, 1), "ep"), ((2, 4, 1, 1), "ep"), ((2, 2, 2, 1), "tp_sp"), ((2, 2, 1, 2), "megascale")]


@pytest.mark.parametrize("load", ["uneven", "dropped"])
@pytest.mark.parametrize("sizes,preset", _RAGGED_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}" for s, p in _RAGGED_LAYOUTS])
def test_ragged_exchange_matches_one_device(sizes, preset, load, monkeypatch):
  """The GPU's exchange (ragged_all_to_all, with the custom VJP that sends cotangents back where their rows
  came from) on CPU through an emulation of the collective: output and gradients equal the one-device op."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
  monkeypatch.setitem(expert_parallel._EXCHANGES, "padded_all_to_all", expert_parallel._EXCHANGES["ragged_all_to_all"])
  x, experts, weights, w = _inputs(load)
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  fn, place, _ = _sharded(sizes, preset)
  assert_matches(output_and_grads(fn, *place(x, experts, weights, w), cotangent),
                 output_and_grads(local_moe, x, experts, weights, w, cotangent))
