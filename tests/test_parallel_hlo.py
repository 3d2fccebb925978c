"""The compiled whole-model program of `ep` and `megascale` moves tokens with all-to-alls, never by
gathering hidden states: on 8 CPU devices (padded all-to-all) and compiled deviceless for 8 H100s
(ragged-all-to-all; needs the `deviceless` extra, which the test command installs). Experts stored split
along D are gathered in the compute dtype and their gradient is reduce-scattered (deviceless)."""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from meshmoe.analysis import deviceless, hlo_collectives
from meshmoe.config import MeshConfig
from meshmoe.models.decoder import Transformer, combine_loss_terms
from meshmoe.models.layers import swiglu_hidden
from meshmoe.sharding import grouped_ffn
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.training import train_step
from tests.test_model_sharded import small_config
from tests.model_steps import gpu_mesh

LAYOUTS = [((1, 8, 1, 1), "ep"), ((2, 2, 1, 2), "megascale"), ((1, 4, 2, 1), "megascale")]
AXES = ("data", "expert", "tensor", "sequence")


def _token_set_collectives(hlo: str, config) -> list[str]:
  """Collectives that assemble the hidden states of the whole batch on a device: an all-gather or an
  all-reduce (GSPMD's gather in disguise: masked copies summed) over more than one device, with a float
  result shaped [B, S, D],
  [B*S, D] or [B*S*K, D] (every token or every assignment of the global batch)."""
  b, s, d = config.train.global_batch_size, config.train.seq_len, config.model.embed_dim
  shapes = {f"{b},{s},{d}", f"{b * s},{d}", f"{b * s * config.model.moe.top_k},{d}"}
  pattern = re.compile(r"= \(?[bf]\w*\[([\d,]+)\][^=]* (?:all-gather|all-reduce)(?:-start)?\(")
  return [line.strip()[:160] for line in hlo.splitlines()
          if (m := pattern.search(line)) and m[1] in shapes
          and hlo_collectives.collectives(line, 8)[0].group_size > 1  # XLA leaves some 1-device no-ops
          # A weight's gradient summed over data parallelism (the transpose of a shard_map input that is
          # replicated) can share the shape by coincidence: it is no token traffic.
          and "psum_invariant" not in line]


def _compiled_loss_and_grad(config, mesh) -> str:
  """HLO text of d(loss)/d(params) (the train step's loss), from abstract parameters and batch on `mesh`."""
  plan = ParallelPlan.build(config, mesh)
  abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(0)))
  graphdef, params, others = nnx.split(abstract, nnx.Param, ...)
  is_variable = lambda x: isinstance(x, nnx.Variable)
  params = jax.tree.map(lambda v, s: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s)), params,
                        plan.param_shardings(params), is_leaf=is_variable)
  tokens = jax.ShapeDtypeStruct((config.train.global_batch_size, config.train.seq_len), jnp.int32,
                                sharding=plan.batch_sharding())

  def loss(params, others, inputs, targets):
    batch = {"inputs": inputs, "targets": targets, "mask": jnp.ones(inputs.shape, jnp.float32)}
    terms = train_step.loss_terms(graphdef, params, others, batch, plan)
    return combine_loss_terms(terms, config.model.moe, terms["tokens"], num_microbatches=1)

  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  replicated = jax.tree.map(lambda v: v.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=whole)), others,
                            is_leaf=is_variable)
  with deviceless.targeting(mesh):
    lowered = jax.jit(jax.grad(loss)).lower(params, replicated, tokens, tokens)
  return deviceless.compile_for_analysis(lowered).as_text()


def _config(sizes, preset):
  config = small_config()
  config.mesh = MeshConfig(**dict(zip(AXES, sizes)), preset=preset)
  return config.validate(8)


@pytest.mark.parametrize("sizes,preset", LAYOUTS, ids=[f"{p}-{'x'.join(map(str, s))}" for s, p in LAYOUTS])
def test_cpu_program_uses_all_to_all_and_gathers_no_hidden_states(sizes, preset):
  config = _config(sizes, preset)
  hlo = _compiled_loss_and_grad(config, make_mesh(config.mesh, jax.devices()))
  assert re.search(r" all-to-all\(", hlo)
  assert not _token_set_collectives(hlo, config)


# `ep` compiled for H100s is test_h100_program_gathers_stored_experts_...'s program (ep over data=2 x expert=4,
# experts stored split along D, bfloat16, remat full), which these checks also hold: one compile fewer.
H100_LAYOUTS = [(sizes, preset) for sizes, preset in LAYOUTS if preset != "ep"]


@pytest.mark.parametrize("sizes,preset", H100_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, s))}" for s, p in H100_LAYOUTS])
def test_h100_program_uses_ragged_all_to_all_and_gathers_no_hidden_states(sizes, preset):
  config = _config(sizes, preset)
  hlo = _compiled_loss_and_grad(config, gpu_mesh(sizes, AXES))
  assert "ragged-all-to-all" in hlo
  assert not _token_set_collectives(hlo, config)


def test_the_detector_finds_gspmds_gather_of_the_tokens():
  """The check above can fail: the one-device dispatch (a global sort) left to GSPMD gathers the tokens."""
  config = _config((8, 1, 1, 1), "dp")
  mesh = make_mesh(config.mesh, jax.devices())
  b, s, d, k = config.train.global_batch_size, config.train.seq_len, config.model.embed_dim, 2
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(AXES))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  x = jax.ShapeDtypeStruct((b, s, d), jnp.float32, sharding=split)
  experts = jax.ShapeDtypeStruct((b, s, k), jnp.int32, sharding=split)
  weights = jax.ShapeDtypeStruct((b, s, k), jnp.float32, sharding=split)
  w = grouped_ffn.ExpertWeights(*(jax.ShapeDtypeStruct(shape, jnp.float32, sharding=whole)
                                  for shape in [(8, d, 16), (8, d, 16), (8, 16, d)]))
  global_view = lambda x, e, g, w: grouped_ffn.moe_local(x, e, g, w, swiglu_hidden, "blocked")
  hlo = deviceless.compile_for_analysis(jax.jit(global_view).lower(x, experts, weights, w)).as_text()
  assert _token_set_collectives(hlo, config)


def _collective_arrays(hlo: str, kind: str) -> set[tuple[str, int]]:
  """(dtype, number of elements) of every array in the types of the `kind` collectives of `hlo` (for an
  asynchronous one, its operands' and results')."""
  found = set()
  for line in hlo.splitlines():
    if m := re.search(rf"= (.*?) {kind}(?:-start)?\(", line):
      found |= {(dtype, math.prod(int(n) for n in dims.split(",") if n))
                for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", m[1])}
  return found


def test_h100_program_gathers_stored_experts_in_bfloat16_and_reduce_scatters_their_gradient():
  """Experts stored split along D (mesh.weight_storage="data") are gathered inside the MoE op in the compute
  dtype, in the forward and again in the remat'd backward, and their gradient is reduce-scattered. Left to
  GSPMD at the op's boundary, the recomputed forward gathered them in float32 and the gradient was
  all-reduced whole, then sliced. The tokens travel in ragged all-to-alls and no hidden states are gathered
  (test_h100_program_uses_ragged_all_to_all_...'s `ep` case, checked on this program)."""
  config = _config((2, 4, 1, 1), "ep")
  config.mesh.weight_storage = "data"
  config.model.dtype, config.model.remat = "bfloat16", "full"
  config.model.moe.expert_mlp_dim = 48  # so that no other weight has an expert weight's size
  config = config.validate(8)
  hlo = _compiled_loss_and_grad(config, gpu_mesh((2, 4, 1, 1), AXES))
  assert "ragged-all-to-all" in hlo
  assert not _token_set_collectives(hlo, config)
  moe = config.model.moe
  whole = moe.num_experts // 4 * config.model.embed_dim * moe.expert_mlp_dim  # one weight on one device
  gathered = _collective_arrays(hlo, "all-gather")
  assert ("bf16", whole) in gathered and ("f32", whole) not in gathered, gathered
  assert ("bf16", whole // 2) in _collective_arrays(hlo, "reduce-scatter")
  summed = {size for _, size in _collective_arrays(hlo, "all-reduce")}
  assert not summed & {whole, 2 * whole, 3 * whole}, summed
