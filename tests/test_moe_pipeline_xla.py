"""The `xla` tier of expert parallelism (sharding/moe_pipeline.py): chunked dispatch -> GEMM -> combine.

It must be the reference's function: equal to grouped_ffn.moe_local on one device, the whole output and
the gradients, on the layouts and loads of test_expert_parallel.py. Its compiled programs must show the
chunking: on CPU C times the token all-to-alls, each 1/C of the buffer; compiled deviceless for 8 H100s, C
times the ragged-all-to-alls, and a GEMM scheduled while a token exchange is in flight (never so in the reference).
The last tests hold both tiers' GPU exchange to a backward without an all-reduce of its buffers, and the
xla tier's expert-gradient all-reduce to the reference's bytes.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from meshmoe.analysis import deviceless, hlo_collectives, hlo_module
from meshmoe.config import ConfigError, ParallelConfig
from meshmoe.models.layers import swiglu_hidden
from meshmoe.sharding import expert_parallel, grouped_ffn, moe_pipeline
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.shardings import use_plan
from tests.test_expert_parallel import (D, E, LAYOUTS, _inputs, _sharded, assert_matches, local_moe, output_and_grads,
                                        sharded_op)
from tests.model_steps import gpu_mesh

AXES = ("data", "expert", "tensor", "sequence")
_IDS = [f"{p}-{'x'.join(map(str, s))}" for s, p in LAYOUTS]


def _xla(chunks: int, grouped_gemm: str = "blocked") -> ParallelConfig:
  return ParallelConfig(impl="xla", moe_chunks=chunks, grouped_gemm=grouped_gemm)


def _assert_matches_one_device(sizes, preset, load, parallel):
  x, experts, weights, w = _inputs(load)
  cotangent = jax.random.normal(jax.random.key(9), x.shape)
  fn, place = sharded_op(sizes, preset, parallel)
  assert_matches(output_and_grads(fn, *place(x, experts, weights, w), cotangent),
                 output_and_grads(local_moe, x, experts, weights, w, cotangent))


def test_chunks_are_contiguous_clamped_and_differ_by_at_most_one_token():
  sizes = lambda bounds: [hi - lo for lo, hi in zip(bounds, bounds[1:])]
  assert sizes(moe_pipeline.chunk_bounds(10, 3)) == [3, 3, 4]
  assert sizes(moe_pipeline.chunk_bounds(8, 3)) == [2, 3, 3]  # the tests' 8 tokens per device: uneven
  assert sizes(moe_pipeline.chunk_bounds(16, 3)) == [5, 5, 6]  # tp_sp after the gather: uneven
  assert sizes(moe_pipeline.chunk_bounds(3, 5)) == [1, 1, 1]
  assert moe_pipeline.chunk_bounds(7, 1) == [0, 7]


# 3 chunks split the tokens unevenly (the harder case) under every load; 2 (the default) evenly.
@pytest.mark.parametrize("load,chunks", [("balanced", 2), ("balanced", 3), ("uneven", 3), ("dropped", 3)])
@pytest.mark.parametrize("sizes,preset", LAYOUTS, ids=_IDS)
def test_xla_tier_matches_one_device(sizes, preset, load, chunks):
  _assert_matches_one_device(sizes, preset, load, _xla(chunks))


@pytest.mark.parametrize("load", ["balanced", "uneven", "dropped"])
def test_xla_tier_with_ragged_dot_matches_one_device(load):
  _assert_matches_one_device((2, 4, 1, 1), "ep", load, _xla(3, grouped_gemm="ragged_dot"))


# The GPU kernels' grouped GEMM path (on CPU XLA's ragged dot for each form: the same sorting, masking and
# VJP typing as on GPUs) under shard_map with checked replication, on every layout: expert axis 1 (local),
# expert parallelism, expert-tensor parallelism.
@pytest.mark.parametrize("impl", ["reference", "xla"])
@pytest.mark.parametrize("sizes,preset", LAYOUTS, ids=_IDS)
def test_kernels_grouped_gemm_matches_one_device(sizes, preset, impl):
  _assert_matches_one_device(sizes, preset, "dropped", ParallelConfig(impl=impl, grouped_gemm="kernels"))


def test_more_chunks_than_tokens_is_one_chunk_per_token():
  _assert_matches_one_device((1, 8, 1, 1), "ep", "dropped", _xla(64))


def test_unknown_tier_is_an_error():
  with pytest.raises(ConfigError, match="parallel.impl='triton' is invalid: one of 'reference', 'xla', 'pallas'"):
    _sharded((1, 8, 1, 1), "ep", ParallelConfig(impl="triton"))


# --- Compiled programs ----------------------------------------------------------------------------------

_ALL_TO_ALL = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) all-to-all\(")


def _all_to_alls(hlo: str) -> tuple[list[float], int]:
  """Result bytes of each all-to-all of floats (tokens), and the number of integer ones (group sizes)."""
  tokens, sizes = [], 0
  for line in hlo.splitlines():
    if m := _ALL_TO_ALL.match(line):
      if "f32[" in m[1]:
        tokens.append(hlo_module.shape_bytes(m[1]))
      else:
        sizes += 1
  return tokens, sizes


@pytest.mark.parametrize("chunks", [2, 3])
@pytest.mark.parametrize("sizes,preset", [((1, 8, 1, 1), "ep"), ((2, 2, 1, 2), "megascale"),
                                          ((2, 2, 2, 1), "tp_sp")])
def test_cpu_program_has_chunks_times_the_token_all_to_alls_each_a_chunk_of_the_buffer(sizes, preset, chunks):
  x, experts, weights, w = _inputs("balanced")

  def compiled(parallel):
    fn, place, _ = _sharded(sizes, preset, parallel)
    return jax.jit(fn).lower(*place(x, experts, weights, w)).compile().as_text()

  reference, pipelined = compiled(None), compiled(_xla(chunks))
  (dispatch_bytes, return_bytes), ref_sizes = _all_to_alls(reference)
  assert dispatch_bytes == return_bytes and ref_sizes == 1
  token_bytes, group_sizes = _all_to_alls(pipelined)
  assert group_sizes == chunks, "one group-size exchange per chunk"
  # Dispatch and return per chunk, each ep x (the chunk's peer slot) rows: the reference's buffer split in
  # proportion to the chunk's tokens (uneven chunks with 3).
  ep, (_, _, d), k = sizes[1], x.shape, experts.shape[-1]
  per_token = min(k, w.num_experts // ep)  # rows one token can send one peer (expert_parallel.peer_slot)
  num_tokens = int(dispatch_bytes) // (ep * per_token * d * 4)  # the reference's buffer: ep x S rows of D floats
  bounds = moe_pipeline.chunk_bounds(num_tokens, chunks)
  want = sorted(2 * [dispatch_bytes * (hi - lo) / num_tokens for lo, hi in zip(bounds, bounds[1:])])
  assert sorted(token_bytes) == want
  assert sum(token_bytes) == dispatch_bytes + return_bytes
  assert len(set(token_bytes)) == (2 if chunks == 3 else 1), "3 chunks of these tokens are uneven, 2 even"
  # Chunking comes after the expert-tensor gather of the tokens (tp_sp), which stays one whole gather;
  # the other layouts gather no tokens at all.
  assert pipelined.count(" all-gather(") == reference.count(" all-gather(")
  if preset != "tp_sp":
    assert " all-gather(" not in pipelined


# What the runner's GPU flags turn on: XLA's latency-hiding scheduler, which moves each asynchronous
# collective's start early and its done late. XLA's default schedule leaves most exchanges synchronous.
_SCHEDULER = {"xla_gpu_enable_latency_hiding_scheduler": True,
              "xla_gpu_experimental_parallel_collective_overlap_limit": 2}


def _h100(sizes, preset, parallel, grad=False, tokens_dtype=jnp.float32) -> hlo_module.HloModule:
  """The op compiled deviceless for 8 H100s (grouped GEMM "auto": the measured table's kernels for bfloat16
  tokens, the blocked GEMM for float32; exchanges ragged_all_to_all). Weights are float32, as the model's parameters;
  `tokens_dtype` is the compute dtype."""
  mesh = gpu_mesh(sizes, AXES)
  plan = ParallelPlan.for_mesh(mesh, preset, parallel)
  x, experts, weights, _ = _inputs("dropped")
  # Widths of 128 (only the shapes are compiled): rows of whole 16-byte units in bfloat16, which the GPU
  # kernels copy with TMA, in whole tiles of JAX's Hopper kernels (sharding/gpu_kernel_table.py).
  width = 128
  x = jnp.zeros((*x.shape[:-1], width), tokens_dtype)
  w = grouped_ffn.ExpertWeights(*(jnp.zeros((E, width, width)) for _ in range(3)))
  tokens = plan.activation_sharding(("act_batch", "act_seq", None))
  param = lambda names: NamedSharding(mesh, plan.param_spec(names))
  abstract = lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
  w = grouped_ffn.ExpertWeights(abstract(w.gate_EDF, param(("exp", "embed", "exp_mlp"))),
                                abstract(w.up_EDF, param(("exp", "embed", "exp_mlp"))),
                                abstract(w.down_EFD, param(("exp", "exp_mlp", "embed"))))

  def fn(x, experts, weights, w):
    with use_plan(plan):
      return expert_parallel.moe_ffn(x, experts, weights, w, swiglu_hidden)

  loss = lambda x, experts, weights, w: jnp.sum(fn(x, experts, weights, w) ** 2)
  args = (abstract(x, tokens), abstract(experts, tokens), abstract(weights, tokens), w)
  program = jax.grad(loss, argnums=(0, 2, 3)) if grad else fn
  with deviceless.targeting(mesh):
    lowered = jax.jit(program).lower(*args)
  return hlo_module.parse(deviceless.compile_for_analysis(lowered, _SCHEDULER).as_text())


def _runs_a_dot(module: hlo_module.HloModule, instruction: hlo_module.Instruction) -> bool:
  """Whether a scheduled instruction is a GEMM: a dot, a library GEMM call (cuBLAS, or a Mosaic GPU kernel:
  tokamax's grouped GEMM), or a fusion around a dot."""
  if instruction.opcode == "dot":
    return True
  if instruction.opcode == "custom-call":
    return "gemm" in instruction.attributes or "mosaic_gpu" in instruction.attributes
  return any(_runs_a_dot(module, inner) for callee in instruction.callees if callee in module.computations
             for inner in module.computations[callee].instructions)


def _gemms_during_token_exchanges(module: hlo_module.HloModule) -> int:
  """GEMMs scheduled between the start and the done of an asynchronous ragged-all-to-all."""
  entry = next(c for c in module.scheduled_computations() if c.is_entry)
  sequence = entry.instructions
  found = 0
  for index, start in enumerate(sequence):
    if start.opcode == "ragged-all-to-all-start":
      end = next(j for j in range(index + 1, len(sequence)) if start.name in sequence[j].operands)
      found += sum(_runs_a_dot(module, i) for i in sequence[index + 1:end])
  return found


def _count(module: hlo_module.HloModule, opcodes: tuple[str, ...]) -> int:
  return sum(i.opcode in opcodes for _, i in module.instructions())


@pytest.mark.parametrize("sizes,preset", [((1, 8, 1, 1), "ep"), ((4, 2, 1, 1), "ep")])
def test_h100_program_overlaps_a_token_exchange_with_a_gemm(sizes, preset):
  """Without the pipeline's barrier XLA merges the chunks' GEMMs into one, which waits for every dispatch:
  this finds no overlap then. 2 and 3 chunks in one test, so that the reference tier's program (the same
  for both) is compiled once."""
  ragged = ("ragged-all-to-all", "ragged-all-to-all-start")
  reference = _h100(sizes, preset, None, tokens_dtype=jnp.bfloat16)
  assert _count(reference, ragged) == 2
  assert _gemms_during_token_exchanges(reference) == 0  # dispatch -> GEMM -> return, each waiting
  for chunks in (2, 3):
    pipelined = _h100(sizes, preset, _xla(chunks, grouped_gemm="auto"), tokens_dtype=jnp.bfloat16)
    assert _count(pipelined, ragged) == 2 * chunks, chunks
    assert _gemms_during_token_exchanges(pipelined) > 0, chunks


def test_h100_expert_gradients_are_summed_in_the_compute_dtype_once():
  """bfloat16 tokens, float32 weights (the model's mixed precision), on a layout where the expert weights
  are the same on both data rows, so their gradient is summed over `data`. The xla tier's chunks share one
  cast of the weights: were each chunk's GEMM to cast and mark them itself, autodiff would sum each chunk's
  bfloat16 gradient on its own and XLA would join the sums into one float32 all-reduce, twice the bytes of
  the reference tier's one sum."""
  def all_reduce_bytes(parallel):
    module = _h100((2, 4, 1, 1), "ep", parallel, grad=True, tokens_dtype=jnp.bfloat16)
    return hlo_collectives.bytes_by_kind(hlo_collectives.collectives(module, 8)).get("all-reduce", 0.0)

  reference_tier = all_reduce_bytes(None)
  assert reference_tier > 0
  assert all_reduce_bytes(_xla(2, grouped_gemm="auto")) == pytest.approx(reference_tier)


def _loop_carried(computation: hlo_module.Computation, name: str) -> bool:
  """Whether value `name` of `computation`, followed back through copies and bitcasts, is one of the values
  its loop carries (an element of the computation's parameter)."""
  by_name = computation.by_name()
  instruction = by_name.get(name)
  while instruction is not None and instruction.opcode in ("copy", "bitcast"):
    instruction = by_name.get(instruction.operands[0])
  if instruction is None or instruction.opcode != "get-tuple-element":
    return False
  source = by_name.get(instruction.operands[0])
  return source is not None and source.opcode == "parameter"


@pytest.mark.parametrize("parallel", [None, _xla(2, grouped_gemm="auto")], ids=["reference", "xla"])
def test_h100_exchange_buffers_are_made_in_each_layer(parallel):
  """Three scanned, rematerialised layers' backward, compiled deviceless for 8 H100s. A ragged_all_to_all
  writes into an `output` operand; given constant zeros (as jax's own transpose rule does), XLA hoisted
  them out of the layer loops and carried them through, in the memory it sets apart for collectives, from
  the first layer's forward to the last one's backward (moe_1b, tp_sp: 2.7 GB). Each exchange's buffer must
  be made inside its loop iteration.

  The same program (the gradient in the tokens, the routing weights and the experts) holds the exchange's
  backward to no all-reduce: ragged_all_to_all types its result like its `output` operand; given an invariant
  jnp.zeros, the result would pass for one value on every device and the backward would psum its cotangent
  over all devices (wrong gradients, and an all-reduce of every exchange buffer). Under `ep` nothing needs
  an all-reduce. (This was test_h100_backward_sums_no_exchange_buffer_over_devices, on one float32 layer.)"""
  layers = 3
  mesh = gpu_mesh((1, 8, 1, 1), AXES)
  plan = ParallelPlan.for_mesh(mesh, "ep", parallel)
  x, experts, weights, _ = _inputs("dropped")
  tokens = plan.activation_sharding(("act_batch", "act_seq", None))
  abstract = lambda a, sharding: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
  param = lambda names: NamedSharding(mesh, plan.param_spec((None, *names)))
  stacked = [jax.ShapeDtypeStruct((layers, *shape), jnp.float32, sharding=param(names)) for shape, names in
             [((E, D, 16), ("exp", "embed", "exp_mlp")), ((E, D, 16), ("exp", "embed", "exp_mlp")),
              ((E, 16, D), ("exp", "exp_mlp", "embed"))]]

  def loss(x, experts, weights, w):
    def layer(h, w_layer):
      with use_plan(plan):
        y = expert_parallel.moe_ffn(h, experts, weights, grouped_ffn.ExpertWeights(*w_layer), swiglu_hidden)
      return h + y.astype(h.dtype), None
    h, _ = jax.lax.scan(jax.checkpoint(layer), x, tuple(w))
    return jnp.sum(h.astype(jnp.float32) ** 2)

  args = (abstract(x.astype(jnp.bfloat16), tokens), abstract(experts, tokens), abstract(weights, tokens), stacked)
  with deviceless.targeting(mesh):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 2, 3))).lower(*args)
  module = hlo_module.parse(deviceless.compile_for_analysis(lowered, _SCHEDULER).as_text())
  assert _count(module, ("all-reduce", "all-reduce-start")) == 0
  exchanges = [(c, i) for c, i in module.instructions() if i.opcode in ("ragged-all-to-all", "ragged-all-to-all-start")]
  assert len(exchanges) >= 4  # the forward's two, the backward's recomputed two and their transposes
  carried = [i.name for c, i in exchanges if _loop_carried(c, i.operands[1])]
  assert not carried, f"exchanges writing into loop-carried buffers: {carried}"
