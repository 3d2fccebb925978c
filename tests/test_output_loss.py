"""The chunked output-layer cross-entropy (models/output.py) against optax's on the whole logits, and the
compiled program it gives at a large vocabulary.

The reference is the pre-chunking loss: the model's float32 logits [B, S, V] (`Transformer.__call__`, what
generation uses) and optax.softmax_cross_entropy_with_integer_labels, differentiated by autodiff. Loss and
gradients of every parameter within FP32_MODEL_RTOL (a whole model), tied and untied, on one device and on
layouts that split the batch, the sequence and the stored vocabulary, with masked tokens.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from meshmoe.analysis import cost_memory, deviceless, hlo_module
from meshmoe.config import MeshConfig
from meshmoe.models import output
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.rules import logical_to_spec
from meshmoe.sharding.shardings import use_plan
from meshmoe.training import model_state, train_step
from tests.model_steps import gpu_mesh, init_model, plan_for
from tests.test_model_sharded import small_config
from tests.tolerances import FP32_MODEL_RTOL, FP32_MODULE_RTOL, assert_close

AXES = ("data", "expert", "tensor", "sequence")


def test_chunk_counts_take_the_fewest_chunks_that_fit():
  v = 1000  # 4000 bytes of logits per token
  assert output.chunk_counts(2, 16, v, 0) == (1, 1)  # no budget: the whole
  assert output.chunk_counts(2, 16, v, 32 * 4000) == (1, 1)  # all 32 tokens fit
  assert output.chunk_counts(2, 16, v, 31 * 4000) == (1, 2)  # 16 tokens per chunk
  assert output.chunk_counts(2, 16, v, 6 * 4000) == (1, 8)  # 4 tokens: 8 divides 16, 6 would not
  assert output.chunk_counts(2, 16, v, 1 * 4000) == (2, 16)  # one token: the rows are cut too
  assert output.chunk_counts(2, 16, v, 100) == (2, 16)  # less than a token: one token per chunk
  assert output.chunk_counts(3, 5, v, 4 * 4000) == (1, 5)  # 3 tokens a chunk: 4 would not divide
  assert output.chunk_counts(3, 5, v, 2 * 4000) == (3, 5)  # 1 token a chunk: 2 would not divide


def _batch(config, seed: int):
  b, s, v = config.train.global_batch_size, config.train.seq_len, config.model.vocab_size
  keys = jax.random.split(jax.random.key(seed), 2)
  tokens = jax.random.randint(keys[0], (b, s + 1), 0, v)
  mask = (jax.random.uniform(keys[1], (b, s)) > 0.25).astype(jnp.float32)  # some tokens masked out
  return tokens[:, :-1], tokens[:, 1:], mask


def _loss_and_grads(config, plan, loss_fn, placed_batch):
  """loss_fn(graphdef, params, others, batch) and its gradient in every parameter, from the model `config`
  initialises."""
  graphdef, params, others = nnx.split(init_model(config, plan), nnx.Param, ...)
  batch = dict(zip(("inputs", "targets", "mask"), placed_batch))
  value, grads = jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, p, others, batch, plan)))(params)
  return float(value), {"/".join(map(str, path)): np.asarray(g) for path, g in nnx.to_flat_state(grads)}


def _chunked(graphdef, params, others, batch, plan):
  """The train step's cross-entropy (train_step.loss_terms: the batch in the plan's sequence order)."""
  return train_step.loss_terms(graphdef, params, others, batch, plan)["ce_sum"]


def _reference(graphdef, params, others, batch, plan):
  with use_plan(plan):
    logits_BSV, _ = nnx.merge(graphdef, params, others)(batch["inputs"])
  ce_BS = optax.softmax_cross_entropy_with_integer_labels(logits_BSV, batch["targets"])
  return jnp.sum(ce_BS * batch["mask"])


_REFERENCES: dict[tuple[bool, int], tuple[float, dict]] = {}


def _check(config, plan, seed=0):
  """The chunked loss on `plan` against the reference on one device."""
  tokens, targets, mask = _batch(config, seed)
  sharding = plan.batch_sharding()
  placed = [jax.device_put(a, sharding) for a in (tokens, targets, mask)]
  loss, grads = _loss_and_grads(config, plan, _chunked, placed)
  key = (config.model.tie_embeddings, seed)  # the same model and batch for every chunking and layout
  if key not in _REFERENCES:
    one_device = dataclasses.replace(config, mesh=MeshConfig(data=1, preset="dp"))
    _REFERENCES[key] = _loss_and_grads(one_device, plan_for(one_device, jax.devices()[:1]), _reference,
                                       (tokens, targets, mask))
  ref_loss, ref_grads = _REFERENCES[key]
  assert_close(loss, ref_loss, FP32_MODEL_RTOL, "loss")
  assert grads.keys() == ref_grads.keys()
  for name, ref in ref_grads.items():
    assert_close(grads[name], ref, FP32_MODEL_RTOL, f"grad {name}")


def _config(tied: bool, chunk_bytes: int, mesh: MeshConfig):
  """small_config's vocabulary (64 entries: 256 bytes of logits a token) and batch (8 x 16), one dense
  layer (the output layer is what is tested; its input gradient still reaches the layer and the
  embedding)."""
  config = small_config()
  config.model.num_layers, config.model.num_dense_layers = 1, 1
  config.model.tie_embeddings, config.model.logits_chunk_bytes = tied, chunk_bytes
  config.mesh = mesh
  return config


@pytest.mark.parametrize("tied,chunk_bytes", [(False, 0), (False, 256 * 3), (True, 256 * 32), (True, 256)],
                         ids=["untied-whole", "untied-2_tokens", "tied-32_tokens", "tied-1_token"])
def test_chunked_loss_and_grads_equal_optax_on_one_device(tied, chunk_bytes):
  """128 tokens [8, 16] in 1, 64 (a budget of 3 tokens: one position of 2 rows a chunk, the rows cut too),
  4 (4 positions of 8 rows) or 128 chunks (one token each)."""
  config = _config(tied, chunk_bytes, MeshConfig(data=1, preset="dp"))
  _check(config, plan_for(config, jax.devices()[:1]))


# Layouts that split the batch, the sequence (tp_sp: over `sequence`, zigzag-ordered, and `tensor`), the
# stored vocabulary (tp_sp) or the model dimension of the embedding table (fsdp).
LAYOUTS = [((8, 1, 1, 1), "dp", False), ((2, 1, 2, 2), "tp_sp", False), ((2, 2, 1, 2), "megascale", True),
           ((2, 2, 2, 1), "fsdp", True), pytest.param((2, 2, 2, 1), "tp_sp", True, marks=pytest.mark.slow)]


@pytest.mark.parametrize("sizes,preset,tied", LAYOUTS,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else
                         {True: "tied", False: "untied"}.get(v, v))
def test_chunked_loss_and_grads_equal_optax_on_sharded_layouts(sizes, preset, tied):
  """Two tokens a chunk on each device, against the reference on one device."""
  config = _config(tied, 256 * 2, MeshConfig(**dict(zip(AXES, sizes)), preset=preset)).validate(8)
  plan = plan_for(config)
  local = plan.activation_sharding(output.LOGITS).shard_shape((8, 16, 64))
  assert np.prod(output.chunk_counts(*local, 256 * 2)) > 1
  _check(config, plan)


# --- the compiled program at a large vocabulary --------------------------------------------------------

VOCAB = 131072


def _large_vocab_config(chunk_bytes: int, sizes=(8, 1, 1, 1), preset="dp"):
  """One dense layer (a fast compile) with a 131,072-entry untied output layer and 1,024 tokens per
  device: their float32 logits are 512 MiB."""
  config = small_config()
  m = config.model
  m.vocab_size, m.num_layers, m.num_dense_layers, m.logits_chunk_bytes = VOCAB, 1, 1, chunk_bytes
  config.train.global_batch_size, config.train.seq_len, m.max_seq_len = 8, 1024, 1024
  config.mesh = MeshConfig(**dict(zip(AXES, sizes)), preset=preset)
  return config.validate(8)


def _compiled_loss_and_grad(config, loss_fn=_chunked):
  """The cross-entropy's gradient in every parameter (by default the train step's, else `loss_fn`'s),
  compiled deviceless for 8 H100s."""
  mesh = gpu_mesh([config.mesh.sizes()[a] for a in AXES], AXES)
  plan = ParallelPlan.build(config, mesh)
  graphdef, params, others = model_state.abstract_model_state(config, plan)
  grad_shardings = plan.param_shardings(params)

  def loss_and_grad(params, others, batch):
    value, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, others, batch, plan))(params)
    return value, jax.lax.with_sharding_constraint(grads, grad_shardings)

  with deviceless.targeting(mesh):
    lowered = jax.jit(loss_and_grad).lower(params, others, train_step.abstract_batch(config, plan))
  return deviceless.compile_for_analysis(lowered)


def _float32_buffers(hlo_text: str) -> set[tuple[int, ...]]:
  """Shapes of every float32 array an instruction of the compiled module produces (tuple elements too)."""
  shapes = set()
  for _, instruction in hlo_module.parse(hlo_text).instructions():
    for match in re.finditer(r"\bf32\[([\d,]*)\]", instruction.shape):
      shapes.add(tuple(int(d) for d in match[1].split(",") if d))
  return shapes


def test_h100_program_never_holds_the_whole_logits():
  """Compiled deviceless for 8 H100s (dp: 1,024 tokens per device): the whole logits [1024, V] float32 (in
  any arrangement of their dimensions) exist in the optax program and never with 64 MiB chunks (128
  tokens), where no vocabulary-sized buffer but the weight-sized ones exceeds a chunk; the
  vocabulary-sized collective (the weight gradient's all-reduce) runs once, not once per chunk; the
  temporary memory drops by at least the logits and their gradient less one chunk of each, and the cost
  model's memory is within 20% of the compiled program's (the logits dominate this model's activations)."""
  tokens_per_device, chunk_bytes = 1024, 64 * 2**20
  before = _compiled_loss_and_grad(_large_vocab_config(0), _reference)
  config = _large_vocab_config(chunk_bytes)
  chunked = _compiled_loss_and_grad(config)

  def logits_sized(hlo_text, tokens):
    return [s for s in _float32_buffers(hlo_text) if VOCAB in s and np.prod(s) == tokens * VOCAB]

  assert logits_sized(before.as_text(), tokens_per_device)  # the detector sees them
  assert not logits_sized(chunked.as_text(), tokens_per_device)
  assert logits_sized(chunked.as_text(), chunk_bytes // (4 * VOCAB))
  weight_sized = {(32, VOCAB), (1, 1, 32, VOCAB)}  # the weight gradient and its part
  assert not [s for s in _float32_buffers(chunked.as_text())
              if VOCAB in s and 4 * np.prod(s) > chunk_bytes and s not in weight_sized]

  module = hlo_module.parse(chunked.as_text())
  vocab_collectives = [(c.name, i.opcode) for c, i in module.instructions()
                       if re.match(r"(all-reduce|all-gather|reduce-scatter)(-start)?$", i.opcode)
                       and str(VOCAB) in i.shape]
  assert vocab_collectives and all(module.multiplicity[c] == 1 for c, _ in vocab_collectives), vocab_collectives

  logits_bytes = tokens_per_device * VOCAB * 4
  memory = chunked.memory_analysis()
  saved = before.memory_analysis().temp_size_in_bytes - memory.temp_size_in_bytes
  assert saved >= 0.9 * 2 * (logits_bytes - chunk_bytes), (saved, logits_bytes)
  # The compiled function takes the parameters and returns their gradients: no optimizer state.
  modelled = cost_memory.memory_per_device(config, ParallelPlan.build(config, gpu_mesh((8, 1, 1, 1), AXES)))
  peak = memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
  assert abs((modelled.params + modelled.gradients + modelled.activations) / peak - 1) <= 0.20, (peak, modelled)


class _RulesOnly:
  """A stand-in for a parallel plan that answers only where activations go: what `constrain` reads."""

  def __init__(self, mesh, rules):
    self.mesh, self.rules = mesh, rules

  def activation_sharding(self, logical):
    return jax.sharding.NamedSharding(self.mesh, logical_to_spec(logical, self.rules))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logits_split_over_the_vocabulary(tied):
  """No preset splits the logits' vocabulary today (tp_sp's sequence split takes `tensor` first), so rules
  that do: tokens over `data`, the vocabulary over `tensor` (each chunk's log-sum-exp and target logit
  are then sums over devices). Loss and gradients against optax on the whole logits, 1e-5 (one module)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "tensor"))
  plan = _RulesOnly(mesh, {"act_batch": ("data",), "act_vocab": ("tensor",), "act_embed": ()})
  b, s, d, v = 4, 8, 16, 64
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (b, s, d))
  weight = jax.random.normal(keys[1], (v, d) if tied else (d, v))
  targets = jax.random.randint(keys[2], (b, s), 0, v)
  mask = (jax.random.uniform(keys[3], (b, s)) > 0.25).astype(jnp.float32)
  assert output.chunk_counts(*plan.activation_sharding(output.LOGITS).shard_shape((b, s, v)), 4 * 16 * 4) == (1, 4)

  def chunked(x, weight, mask):
    with use_plan(plan):
      return output.cross_entropy_sum(x, weight, targets, mask, tied=tied, chunk_bytes=4 * 16 * 4)

  def reference(x, weight, mask):
    ce = optax.softmax_cross_entropy_with_integer_labels(output.logits(x, weight, tied), targets)
    return jnp.sum(ce * mask)

  got = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1, 2)))(x, weight, mask)
  want = jax.value_and_grad(reference, argnums=(0, 1, 2))(x, weight, mask)
  assert_close(got[0], want[0], FP32_MODULE_RTOL, "loss")
  for name, g, w in zip(("x", "weight", "mask"), got[1], want[1]):
    assert_close(g, w, FP32_MODULE_RTOL, f"grad {name}")
