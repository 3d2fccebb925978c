"""The embedding lookup's placed gradient (sharding/embedding_lookup.py): on layouts whose table is split over
axes that split the tokens, the table's gradient equals jnp.take's on one device (bit for bit where no
partial sums remain) and no collective of the compiled gradient carries a whole table; elsewhere jnp.take's
own gradient runs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshmoe.config import MeshConfig
from meshmoe.sharding import embedding_lookup
from meshmoe.sharding.shardings import use_plan
from tests.model_steps import plan_for
from tests.test_model_sharded import small_config
from tests.tolerances import FP32_MODEL_RTOL, assert_close

MESH_FIELDS = ("data", "expert", "tensor", "sequence")
# (mesh sizes, preset, weight storage, token axes the table leaves unsplit (`rest`))
PLACED = [((2, 2, 2, 1), "tp_sp", "preset", ("data", "expert")),  # V over `tensor`, which splits the sequence
          ((2, 2, 2, 1), "tp_sp", "data", ("expert",)),  # V over `tensor`, D over `data`
          ((2, 2, 2, 1), "tp_sp", "all", ()),
          ((2, 2, 1, 2), "megascale", "data", ("expert", "sequence"))]


def _plan(sizes, preset, storage):
  config = small_config()
  config.mesh = MeshConfig(**dict(zip(MESH_FIELDS, sizes)), preset=preset, weight_storage=storage)
  return config, plan_for(config.validate(8))


def _inputs(config):
  m, t = config.model, config.train
  rng = np.random.default_rng(0)
  table = rng.standard_normal((m.vocab_size, m.embed_dim)).astype(np.float32)
  tokens = rng.integers(0, m.vocab_size, (t.global_batch_size, t.seq_len)).astype(np.int32)
  tokens[0, :4] = 7  # repeated tokens: their gradients add up in one row
  weights = rng.standard_normal((t.global_batch_size, t.seq_len, m.embed_dim)).astype(np.float32)
  return table, tokens, weights


def _loss(table, tokens, weights):
  x = embedding_lookup.lookup(table, tokens, jnp.bfloat16)
  return jnp.sum(x.astype(jnp.float32) * weights)


def _placed_gradient(plan, table, tokens, weights):
  """The table's gradient under `plan`, the inputs placed as the model places them, and its compiled text."""
  stream = NamedSharding(plan.mesh, plan.activation_spec(("act_batch", "act_seq", "act_embed")))
  args = (jax.device_put(table, NamedSharding(plan.mesh, plan.param_spec(embedding_lookup.TABLE))),
          jax.device_put(tokens, NamedSharding(plan.mesh, plan.activation_spec(embedding_lookup.TOKENS))),
          jax.device_put(weights, stream))
  with use_plan(plan):
    gradient = jax.jit(jax.grad(_loss))
    compiled = gradient.lower(*args).compile()
  return np.asarray(compiled(*args)), compiled.as_text()


@pytest.mark.parametrize("sizes,preset,storage,rest", PLACED,
                         ids=[f"{p}-{s}-{'x'.join(map(str, m))}" for m, p, s, _ in PLACED])
def test_placed_gradient_equals_take_and_moves_no_whole_table(sizes, preset, storage, rest):
  config, plan = _plan(sizes, preset, storage)
  layout = embedding_lookup.gradient_layout(plan)
  assert layout is not None and layout.rest == rest
  table, tokens, weights = _inputs(config)
  gradient, text = _placed_gradient(plan, table, tokens, weights)
  reference = np.asarray(jax.jit(jax.grad(_loss))(table, tokens, weights))
  if rest:  # partial sums of the slices, added over `rest`: float32 rounding
    assert_close(gradient, reference, FP32_MODEL_RTOL, "table gradient")
  else:
    np.testing.assert_array_equal(gradient, reference)
  whole_table = f"f32[{config.model.vocab_size},{config.model.embed_dim}]"
  collectives = [line for line in text.splitlines()
                 if re.search(r"= \S+ (all-reduce|reduce-scatter|all-gather|all-to-all)\(", line)]
  assert collectives and not [line for line in collectives if whole_table in line.split("=")[1].split("(")[0]]


@pytest.mark.parametrize("sizes,preset,storage", [((8, 1, 1, 1), "fsdp", "preset"), ((4, 2, 1, 1), "ep", "preset")])
def test_jnp_take_where_the_table_does_not_split_over_token_axes_or_gspmd_looks_up_locally(sizes, preset, storage):
  """fsdp: D split exactly like the batch (GSPMD's local lookup and all-to-all); ep: the table whole."""
  _, plan = _plan(sizes, preset, storage)
  assert embedding_lookup.gradient_layout(plan) is None
