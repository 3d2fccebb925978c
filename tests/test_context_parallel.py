"""Context-parallel attention (sharding/context_parallel.py) against jax.nn.dot_product_attention.

The reference is jax.nn.dot_product_attention(..., is_causal=True) on the whole sequence in natural order
on one device. The sharded kinds see the sequence in zigzag order, split over 2, 4 or 8 CPU devices (one
or two mesh axes, with and without a batch split); their output rows and input gradients are put back in
natural order before the comparison.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshmoe.sharding import context_parallel as cp
from tests.tolerances import FP32_MODULE_RTOL, assert_close

B, H = 2, 8
# The CPU backend's LLVM optimisations take about half the compile time of the unrolled sharded programs
# (the all-gather kind's 2n+1 blocks, forward and backward) and do not change the arithmetic.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _qkv(b, s, n, g, h, seed=0):
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(kq, (b, s, n, h), jnp.float32), jax.random.normal(kk, (b, s, g, h), jnp.float32),
          jax.random.normal(kv, (b, s, g, h), jnp.float32), jax.random.normal(kc, (b, s, n, h), jnp.float32))


@jax.jit
def _reference(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@jax.jit
def _reference_and_grads(q, k, v, ct):
  out, vjp = jax.vjp(_reference, q, k, v)
  return out, vjp(ct)


def _mesh(shape, names):
  return Mesh(np.array(jax.devices()[:int(np.prod(shape))]).reshape(shape), names)


# zigzag_order


@pytest.mark.parametrize("seq_len,n", [(8, 1), (12, 1), (8, 2), (32, 4), (48, 8), (16, 8)])
def test_zigzag_order_gives_each_shard_an_early_and_a_late_chunk(seq_len, n):
  order = cp.zigzag_order(seq_len, n)
  assert order.dtype == np.int32 and order.shape == (seq_len,)
  np.testing.assert_array_equal(np.sort(order), np.arange(seq_len))  # a permutation
  if n == 1:
    np.testing.assert_array_equal(order, np.arange(seq_len))
    return
  c = seq_len // (2 * n)
  chunks = np.arange(seq_len).reshape(2 * n, c)
  for d, shard in enumerate(order.reshape(n, 2 * c)):
    np.testing.assert_array_equal(shard, np.concatenate([chunks[d], chunks[2 * n - 1 - d]]))


@pytest.mark.parametrize("seq_len,n", [(10, 2), (12, 4), (8, 8)])
def test_zigzag_order_rejects_indivisible_length(seq_len, n):
  with pytest.raises(ValueError, match=str(seq_len)):
    cp.zigzag_order(seq_len, n)


# causal_attention (one device)


def test_causal_attention_sorted_positions_matches_reference():
  q, k, v, _ = _qkv(B, 16, 4, 2, H)
  pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (B, 16))
  out = jax.jit(cp.causal_attention)(q, k, v, pos, pos)
  assert_close(out, _reference(q, k, v), FP32_MODULE_RTOL, "causal_attention, sorted positions")


def test_causal_attention_follows_positions_not_order():
  q, k, v, _ = _qkv(B, 16, 4, 2, H, seed=1)
  rng = np.random.default_rng(0)
  q_order, kv_order = rng.permutation(16), rng.permutation(16)  # queries and keys shuffled differently
  q_pos, k_pos = (jnp.broadcast_to(jnp.asarray(o, jnp.int32), (B, 16)) for o in (q_order, kv_order))
  out = jax.jit(cp.causal_attention)(q[:, q_order], k[:, kv_order], v[:, kv_order], q_pos, k_pos)
  assert_close(out[:, np.argsort(q_order)], _reference(q, k, v), FP32_MODULE_RTOL,
               "causal_attention, shuffled positions")


def test_causal_attention_keeps_query_dtype():
  q, k, v, _ = _qkv(1, 8, 4, 2, H)
  pos = jnp.arange(8, dtype=jnp.int32)[None]
  bf16 = [a.astype(jnp.bfloat16) for a in (q, k, v)]
  out = jax.eval_shape(cp.causal_attention, *bf16, pos, pos)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape


def test_local_implementation_is_attention_over_the_whole_sequence():
  q, k, v, _ = _qkv(B, 16, 4, 2, H)
  pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (B, 16))
  assert_close(cp.sharded_attention(q, k, v, pos, implementation="local", axis_names=()), _reference(q, k, v),
               FP32_MODULE_RTOL, "local attention")
  with pytest.raises(ValueError, match="local attention takes no mesh axes"):
    cp.sharded_attention(q, k, v, pos, implementation="local", axis_names=("seq",))


def test_sharded_attention_rejects_unknown_implementation():
  q, k, v, _ = _qkv(1, 8, 4, 2, H)
  with pytest.raises(ValueError, match="unknown context-parallel attention 'flash'; known: local, allgather"):
    cp.sharded_attention(q, k, v, jnp.arange(8)[None], implementation="flash", axis_names=())


# sharded_attention inside shard_map

# (mesh shape, mesh axis names, batch axes, sequence axes)
LAYOUTS = [
    ((2,), ("seq",), (), ("seq",)),
    ((4,), ("seq",), (), ("seq",)),
    ((8,), ("seq",), (), ("seq",)),
    ((2, 4), ("a", "b"), (), ("a", "b")),  # the sequence over two axes: device index a * 4 + b
    ((2, 4), ("data", "seq"), ("data",), ("seq",)),  # the batch split too
]
KINDS = ("allgather", "ring", "ulysses")  # each kind's reference-tier implementation has the kind's name
CASES = [(kind, *layout) for kind in KINDS for layout in LAYOUTS]


def _spec(batch_axes, seq_axes):
  dims = [None if not axes else axes[0] if len(axes) == 1 else axes for axes in (batch_axes, seq_axes)]
  return P(*dims)


def _sharded_fn(mesh, batch_axes, seq_axes, kind):
  """q, k, v, positions (zigzag order, global) -> output (zigzag order, global), by shard_map."""
  spec = _spec(batch_axes, seq_axes)
  return jax.shard_map(
      lambda q, k, v, pos: cp.sharded_attention(q, k, v, pos, implementation=kind, axis_names=seq_axes),
      mesh=mesh, in_specs=(spec, spec, spec, spec), out_specs=spec)


@pytest.mark.parametrize("kind,shape,names,batch_axes,seq_axes", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{'+'.join(c[4])}"
                              + ("-batch" if c[3] else "") for c in CASES])
def test_sharded_attention_matches_reference(kind, shape, names, batch_axes, seq_axes):
  mesh = _mesh(shape, names)
  n = int(np.prod([mesh.shape[a] for a in seq_axes]))
  s = 32
  # Ulysses splits the key/value heads over the sequence devices: it needs G % n == 0, so G = N = 8 there.
  q, k, v, ct = _qkv(B, s, 8, 8 if kind == "ulysses" else 4, H)
  order = cp.zigzag_order(s, n)
  inverse = np.argsort(order)
  pos = jnp.broadcast_to(jnp.asarray(order), (B, s))
  sharding = NamedSharding(mesh, _spec(batch_axes, seq_axes))
  args = [jax.device_put(a, sharding) for a in (q[:, order], k[:, order], v[:, order], pos, ct[:, order])]
  attend = _sharded_fn(mesh, batch_axes, seq_axes, kind)
  assert_sharded_matches(attend, args, inverse, _reference_and_grads(q, k, v, ct), kind)


def test_ulysses_rejects_kv_heads_not_divisible_by_sequence_devices():
  mesh = _mesh((4,), ("seq",))
  q, k, v, _ = _qkv(1, 16, 4, 2, H)  # G = 2 key/value heads over 4 devices
  pos = jnp.broadcast_to(jnp.asarray(cp.zigzag_order(16, 4)), (1, 16))
  with pytest.raises(ValueError, match=r"\b2\b.*\b4\b"):
    jax.jit(_sharded_fn(mesh, (), ("seq",), "ulysses"))(q, k, v, pos)


@pytest.mark.parametrize("kind,collective", [("allgather", "all-gather"), ("ring", "collective-permute"),
                                             ("ulysses", "all-to-all")])
def test_compiled_program_uses_the_kind_s_collective(kind, collective):
  mesh = _mesh((4,), ("seq",))
  q, k, v, _ = _qkv(1, 16, 4, 4, H)
  pos = jnp.broadcast_to(jnp.asarray(cp.zigzag_order(16, 4)), (1, 16))
  hlo = jax.jit(_sharded_fn(mesh, (), ("seq",), kind)).lower(q, k, v, pos).compile().as_text()
  assert collective in hlo, f"{kind}: no {collective} in the compiled program"


def _count(jaxpr, primitive: str) -> int:
  """Executions of `primitive` in a jaxpr: nested equations (the shard_map body) included, a scan's body
  (lax.fori_loop with static bounds) counted once per iteration."""
  total = 0
  for eqn in jaxpr.eqns:
    total += eqn.primitive.name == primitive
    repeats = eqn.params["length"] if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          total += repeats * _count(inner, primitive)
  return total


@pytest.mark.parametrize("n", [2, 4])
def test_work_per_device(n):
  # allgather: 2n+1 causal blocks of c x c (two matmuls each), not the 4n of the full square; ring: n
  # dense blocks and n-1 transfers of (k, v, positions).
  mesh = _mesh((n,), ("seq",))
  q, k, v, _ = _qkv(1, 16, 4, 4, H)
  pos = jnp.broadcast_to(jnp.asarray(cp.zigzag_order(16, n)), (1, 16))
  jaxprs = {kind: jax.make_jaxpr(_sharded_fn(mesh, (), ("seq",), kind))(q, k, v, pos).jaxpr
            for kind in ("allgather", "ring")}
  assert _count(jaxprs["allgather"], "dot_general") == 2 * (2 * n + 1)
  assert _count(jaxprs["ring"], "dot_general") == 2 * n
  assert _count(jaxprs["ring"], "ppermute") == 3 * (n - 1)


def assert_sharded_matches(attend, args, inverse, reference, what: str) -> None:
  """`attend(q, k, v, *rest)` and its gradients in q, k, v for the cotangent `args[-1]`, compiled from `args`
  (q, k, v, *rest, cotangent; rows in zigzag order), against `reference` = (output, (dq, dk, dv)) in natural
  order: the rows are put back by `inverse` first."""

  def forward_and_grads(q, k, v, *rest_and_cotangent):
    *rest, cotangent = rest_and_cotangent
    out, vjp = jax.vjp(lambda q, k, v: attend(q, k, v, *rest), q, k, v)
    return out, vjp(cotangent)

  out, grads = jax.jit(forward_and_grads).lower(*args).compile(_FAST_COMPILE)(*args)
  expected, ref_grads = reference
  assert_close(out[:, inverse], expected, FP32_MODULE_RTOL, f"{what} output")
  for name, grad, ref_grad in zip("qkv", grads, ref_grads):
    assert_close(grad[:, inverse], ref_grad, FP32_MODULE_RTOL, f"{what} d{name}")
