"""Context-parallel attention with its blocks computed by tokamax's flash attention (sharding/attention_kernels.py).

- On CPU every kind runs the kernel path with tokamax's XLA version (`kernel="xla"`): the blocks, their
  merging by softmax statistics and the custom backward (the kernel's block backward with the merged
  statistics, K/V gradients travelling back round the ring) equal the einsum reference
  (context_parallel.causal_attention on the whole sequence in order), output and dq, dk, dv.
- The plan picks the kernel from the devices and the operands, and says why where it cannot.
- Compiled deviceless for H100s (bf16, GQA, head_dim 128), forward and backward through the op the model
  calls: the blocks are Mosaic GPU kernels, and no float32 [B, heads, S, T] score buffer is left in the
  program (the einsum path has them).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshmoe.analysis import deviceless
from meshmoe.config import MeshConfig, ParallelConfig
from meshmoe.sharding import attention_kernels
from meshmoe.sharding import context_parallel as cp
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import Hardware, ParallelPlan, attention_kernel
from meshmoe.sharding.shardings import use_plan
from tests.model_steps import gpu_mesh
from tests.test_context_parallel import _mesh, _qkv, _spec, assert_sharded_matches
from tests.tolerances import FP32_MODULE_RTOL, assert_close

B, H, S = 2, 8, 32


def _reference_and_grads(q, k, v, ct):
  """causal_attention (the einsum path) over the whole sequence in order, and its input gradients."""
  pos = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
  out, vjp = jax.vjp(lambda q, k, v: cp.causal_attention(q, k, v, pos, pos), q, k, v)
  return out, vjp(ct)


# (kind, mesh shape, mesh axis names, batch axes, sequence axes)
CASES = [
    ("allgather", (2,), ("seq",), (), ("seq",)),
    ("allgather", (2, 4), ("a", "b"), (), ("a", "b")),
    ("allgather", (2, 4), ("data", "seq"), ("data",), ("seq",)),
    ("ring", (4,), ("seq",), (), ("seq",)),
    ("ring", (2, 4), ("data", "seq"), ("data",), ("seq",)),
    ("zigzag_ring", (2,), ("seq",), (), ("seq",)),
    ("zigzag_ring", (8,), ("seq",), (), ("seq",)),
    ("zigzag_ring", (2, 4), ("data", "seq"), ("data",), ("seq",)),
    ("ulysses", (4,), ("seq",), (), ("seq",)),
    ("ulysses", (2, 4), ("a", "b"), (), ("a", "b")),
]


@pytest.mark.parametrize("kind,shape,names,batch_axes,seq_axes", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{'+'.join(c[4])}" + ("-batch" if c[3] else "")
                              for c in CASES])
def test_kernel_path_matches_the_einsum_reference(kind, shape, names, batch_axes, seq_axes):
  mesh = _mesh(shape, names)
  n = int(np.prod([mesh.shape[a] for a in seq_axes]))
  q, k, v, ct = _qkv(B, S, 8, 8 if kind == "ulysses" else 4, H)  # GQA: 8 query heads, 4 key/value heads
  order = cp.zigzag_order(S, n)
  inverse = np.argsort(order)
  pos = jnp.broadcast_to(jnp.asarray(order), (B, S))
  spec = _spec(batch_axes, seq_axes)
  sharding = NamedSharding(mesh, spec)
  args = [jax.device_put(a, sharding) for a in (q[:, order], k[:, order], v[:, order], pos, ct[:, order])]
  attend = jax.shard_map(
      lambda q, k, v, pos: cp.sharded_attention(q, k, v, pos, implementation=kind, axis_names=seq_axes,
                                                kernel="xla"),
      mesh=mesh, in_specs=(spec,) * 4, out_specs=spec)
  assert_sharded_matches(attend, args, inverse, _reference_and_grads(q, k, v, ct), kind)


def test_local_kernel_path_matches_the_einsum_reference():
  q, k, v, ct = _qkv(B, S, 8, 4, H)
  pos = jnp.broadcast_to(jnp.arange(S), (B, S))

  def forward_and_grads(q, k, v, ct):
    attend = lambda q, k, v: cp.sharded_attention(q, k, v, pos, implementation="local", axis_names=(), kernel="xla")
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(ct)

  out, grads = jax.jit(forward_and_grads)(q, k, v, ct)
  expected, ref_grads = _reference_and_grads(q, k, v, ct)
  assert_close(out, expected, FP32_MODULE_RTOL, "local output")
  for name, grad, ref_grad in zip("qkv", grads, ref_grads):
    assert_close(grad, ref_grad, FP32_MODULE_RTOL, f"local d{name}")


def test_blocks_of_one_shape_are_one_kernel_call(monkeypatch):
  # allgather on 4 devices: its 2n+1 = 9 blocks are 2 calls (the 2 diagonal blocks, the 7 full ones); the
  # zigzag ring's are 2 calls at its first step and 1 at each other; the plain ring's 1 per step.
  mesh = _mesh((4,), ("seq",))
  q, k, v, _ = _qkv(1, S, 4, 4, H)
  pos = jnp.broadcast_to(jnp.asarray(cp.zigzag_order(S, 4)), (1, S))
  real = attention_kernels.forward
  for kind, expected_calls, expected_blocks in (("allgather", 2, 9), ("zigzag_ring", 2 + 3, 9), ("ring", 4, 8)):
    calls = []
    monkeypatch.setattr(attention_kernels, "forward", lambda *args: calls.append(args[0].shape[0]) or real(*args))
    jax.eval_shape(jax.shard_map(
        lambda q, k, v, pos: cp.sharded_attention(q, k, v, pos, implementation=kind, axis_names=("seq",),
                                                  kernel="xla"),
        mesh=mesh, in_specs=(P(None, "seq"),) * 4, out_specs=P(None, "seq")), q, k, v, pos)
    assert (len(calls), sum(calls)) == (expected_calls, expected_blocks), (kind, calls)


def test_unknown_kernel_is_refused():
  q, k, v, _ = _qkv(1, 8, 4, 2, H)
  with pytest.raises(ValueError, match="unknown attention kernel 'flash'; known: mosaic, triton, xla"):
    cp.sharded_attention(q, k, v, jnp.arange(8)[None], implementation="local", axis_names=(), kernel="flash")


# The plan's choice.

H100 = Hardware("gpu", "NVIDIA H100 80GB HBM3", "9.0", 132)


@pytest.mark.parametrize("requested,hardware,expected", [
    ("auto", Hardware("cpu", "cpu", "", 0), ("", "")),
    ("tokamax", Hardware("cpu", "cpu", "", 0), ("xla", "")),
    ("einsum", H100, ("", "")),
    ("auto", H100, ("mosaic", "")),
    ("auto", Hardware("gpu", "NVIDIA B200", "10.0", 148), ("mosaic", "")),
    ("auto", Hardware("gpu", "NVIDIA A100-SXM4-80GB", "8.0", 108), ("triton", "")),
])
def test_the_kernel_follows_the_devices(requested, hardware, expected):
  assert attention_kernel(requested, hardware) == expected


def test_a_gpu_without_a_kernel_runs_the_einsum_blocks_and_says_why():
  kernel, why = attention_kernel("auto", Hardware("gpu", "Tesla V100-SXM2-16GB", "7.0", 80))
  assert kernel == "" and "no flash attention kernel for compute capability 7.0" in why


def test_h100_plan_runs_mosaic_for_bf16_and_says_why_not_for_float32():
  mesh = gpu_mesh((2, 1, 1, 4), ("data", "expert", "tensor", "sequence"))
  plan = ParallelPlan.for_mesh(mesh, "megascale", ParallelConfig(impl="xla", attention="ring"))
  choice = plan.attention(jnp.bfloat16, 128)
  assert (choice.implementation, choice.kernel_backend, choice.fallback) == ("zigzag_ring", "mosaic", "")
  assert "tokamax flash attention" in choice.detail
  float32 = plan.attention(jnp.float32, 128)
  assert float32.kernel_backend == "" and "takes bfloat16/float16, not float32" in float32.fallback
  assert "head_dim=512 exceeds" in plan.attention(jnp.bfloat16, 512).fallback
  einsum = ParallelPlan.for_mesh(mesh, "megascale", ParallelConfig(attention_kernel="einsum"))
  assert einsum.attention(jnp.bfloat16, 128).kernel_backend == ""


def test_cpu_plans_keep_the_einsum_blocks_unless_asked():
  mesh = make_mesh(MeshConfig(data=2, expert=2, sequence=2, preset="megascale"))
  assert ParallelPlan.for_mesh(mesh, "megascale").attention(jnp.float32, 8).kernel_backend == ""
  forced = ParallelPlan.for_mesh(mesh, "megascale", ParallelConfig(attention_kernel="tokamax"))
  assert forced.attention(jnp.float32, 8).kernel_backend == "xla"


@pytest.mark.parametrize("preset,sizes,attention", [("megascale", (2, 2, 1, 2), "allgather"),
                                                    ("tp_sp", (2, 1, 2, 2), "ring"),
                                                    ("dp", (8, 1, 1, 1), "allgather")])
def test_the_op_runs_the_plan_s_kernel(preset, sizes, attention):
  """context_parallel.attention under a plan that asks for tokamax (its XLA version on CPU): the same output
  and gradients as under one that does not, through the op's shard_map (unchecked replication there)."""
  data, expert, tensor, sequence = sizes
  mesh = make_mesh(MeshConfig(data=data, expert=expert, tensor=tensor, sequence=sequence, preset=preset))
  q, k, v, ct = _qkv(8, S, 4, 2, H)
  results = {}
  for kernel in ("einsum", "tokamax"):
    plan = ParallelPlan.for_mesh(mesh, preset, ParallelConfig(impl="xla", attention=attention,
                                                               attention_kernel=kernel))
    order = plan.sequence_order(S)
    order = np.arange(S) if order is None else order
    pos = jnp.broadcast_to(jnp.asarray(order), (8, S))

    def forward_and_grads(q, k, v, ct, plan=plan, pos=pos):
      with use_plan(plan):
        out, vjp = jax.vjp(lambda q, k, v: cp.attention(q, k, v, pos), q, k, v)
      return out, vjp(ct)

    results[kernel] = jax.jit(forward_and_grads)(q[:, order], k[:, order], v[:, order], ct[:, order])
    assert plan.attention(q.dtype, H).kernel_backend == ("xla" if kernel == "tokamax" else "")
  for name, actual, expected in zip(["output", "dq", "dk", "dv"], jax.tree.leaves(results["tokamax"]),
                                    jax.tree.leaves(results["einsum"])):
    assert_close(actual, expected, FP32_MODULE_RTOL, name)


# Compiled for H100s without one.

GPU_B, GPU_S, GPU_N, GPU_G, GPU_H = 1, 4096, 8, 2, 128  # c = 512 rows per zigzag chunk on 4 devices


def _score_buffers(hlo: str, c: int) -> list[str]:
  """Float32 arrays of the program with two dimensions of at least c (query and key rows: a score or
  probability buffer; q/k/v/o and the statistics have one, with c larger than the heads and head size)."""
  shapes = set(re.findall(r"\bf32\[([\d,]+)\]", hlo))
  return sorted(f"f32[{dims}]" for dims in shapes if sum(int(d) >= c for d in dims.split(",")) >= 2)


def _h100_attention(kind: str, n: int, attention_kernel: str = "auto", documents: bool = False) -> str:
  """The scheduled HLO of forward and backward of context_parallel.attention (bf16, GQA) on n H100s
  splitting the sequence (`kind`: the plan's attention kind; n = 1: one H100, the sequence whole, local),
  under the plan's kernel; with `documents`, masked within packed documents (their starts an input)."""
  mesh = gpu_mesh((1, 1, 1, n), ("data", "expert", "tensor", "sequence"))
  plan = ParallelPlan.for_mesh(mesh, "megascale" if n > 1 else "dp", ParallelConfig(
      impl="xla", attention=kind if n > 1 else "allgather", attention_kernel=attention_kernel))
  assert plan.attention().implementation == ("local" if n == 1 else {"ring": "zigzag_ring"}.get(kind, kind))
  q_sharding = plan.activation_sharding(cp.QUERY_AXES)
  q = jax.ShapeDtypeStruct((GPU_B, GPU_S, GPU_N, GPU_H), jnp.bfloat16, sharding=q_sharding)
  kv = jax.ShapeDtypeStruct((GPU_B, GPU_S, GPU_G, GPU_H), jnp.bfloat16, sharding=q_sharding)
  pos = jax.ShapeDtypeStruct((GPU_B, GPU_S), jnp.int32, sharding=NamedSharding(mesh, P(*q_sharding.spec[:2])))

  def forward_and_grads(q, k, v, pos, starts=None):
    with use_plan(plan):
      out, vjp = jax.vjp(lambda q, k, v: cp.attention(q, k, v, pos, starts), q, k, v)
    return out, vjp(out)

  with deviceless.targeting(mesh):
    lowered = jax.jit(forward_and_grads).lower(q, kv, kv, pos, *[pos] * documents)
  return deviceless.compile_for_analysis(lowered).as_text()


@pytest.mark.parametrize("kind,n,kernels", [("local", 1, 3), ("allgather", 4, 6), ("ring", 2, 2 + 1 + 2 * (2 + 1))])
def test_h100_program_runs_mosaic_kernels_and_keeps_no_score_buffer(kind, n, kernels):
  # n = 1: local, one causal call forward, tokamax's two backward kernels (dq; dk and dv). allgather: the
  # diagonal and the full blocks, forward and backward. ring (the xla tier's zigzag ring): 2 calls at the
  # first step and 1 at the other, forward and backward.
  hlo = _h100_attention(kind, n)
  assert hlo.count('custom_call_target="mosaic_gpu') == kernels
  assert not _score_buffers(hlo, GPU_S // n // 2), _score_buffers(hlo, GPU_S // n // 2)


@pytest.mark.parametrize("kind,n,kernels", [("local", 1, 3), ("allgather", 4, 6), ("ring", 2, 2 + 1 + 2 * (2 + 1))])
def test_h100_program_masks_documents_in_the_same_kernels(kind, n, kernels):
  """With packed documents (data.document_mask) the same Mosaic calls run, each with the queries' key ranges,
  and still no score buffer."""
  hlo = _h100_attention(kind, n, documents=True)
  assert hlo.count('custom_call_target="mosaic_gpu') == kernels
  assert not _score_buffers(hlo, GPU_S // n // 2), _score_buffers(hlo, GPU_S // n // 2)


def test_h100_einsum_program_has_score_buffers():
  """The check above sees the einsum path's float32 scores (so its silence means something)."""
  hlo = _h100_attention("local", 1, attention_kernel="einsum")
  assert 'custom_call_target="mosaic_gpu' not in hlo
  assert _score_buffers(hlo, GPU_S // 2)


@pytest.mark.slow
def test_h100_train_step_runs_the_attention_kernels():
  """The whole train step (tiny_moe in bf16, head_dim 64, sequence over 2 of 8 H100s, all-gather kind):
  the plan predicts tokamax's Mosaic kernels for attention and the compiled step calls them, forward and
  backward, with the custom VJP under the decoder's rematerialisation."""
  from experiments.configs import tiny_moe
  from meshmoe.training import train_step

  config = tiny_moe.get_config()
  config.mesh = MeshConfig(data=2, expert=2, tensor=1, sequence=2, preset="megascale")
  config.model.dtype, config.model.head_dim, config.model.remat = "bfloat16", 64, "full"
  config.model.max_seq_len = config.train.seq_len = 1024
  config = config.validate(8)
  mesh = make_mesh(config.mesh, deviceless.gpu_devices(8))
  plan = ParallelPlan.build(config, mesh)
  assert (plan.ops["attention"].implementation, plan.ops["attention"].kernel_backend) == ("allgather", "mosaic")
  assert "allgather (mosaic)" in plan.table()
  trainer, state = train_step.create_abstract(config, plan)
  with deviceless.targeting(mesh):
    lowered = trainer.train_step.lower(state, train_step.abstract_batch(config, plan))
  hlo = deviceless.compile_for_analysis(lowered).as_text()
  # Kernels by op name: tokamax's attention forward is flash_attention_sm90, its backward the kernels of the
  # backward pass that are not the grouped GEMM's (ragged_*).
  names = re.findall(r'custom_call_target="mosaic_gpu[^\n]*?op_name="([^"]*)"', hlo)
  forward = [name for name in names if "flash_attention" in name]
  backward = [name for name in names if "transpose(" in name and "flash_attention" not in name and "ragged" not in name]
  assert any("transpose(" not in name for name in forward), names
  assert backward and len(backward) % 2 == 0, names  # each backward call is two kernels: dq; dk and dv
