"""Document masking of packed rows (data.document_mask): attention within documents, through every
context-parallel kind and kernel path, and through the model and the data pipeline.

- The op (sharding/context_parallel.py): every kind, with the einsum blocks and with the kernel path
  (tokamax's XLA version of the flash kernels on CPU), on a sequence split over devices in zigzag order,
  against attention computed separately for each document (its own tokens, causal), output and dq, dk, dv.
  The documents cross the devices' chunk boundaries, and include one-token documents.
- The model (GQA and MLA, dense and MoE layers): on several layouts and tiers, a packed batch with
  document masking gives the loss, router statistics and gradients of the same documents as separate
  rows on one device (positions restarting, or continuing from the document's place in the row).
- The pipeline: each token's document start follows the end-of-document tokens of the packed row.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshmoe.sharding import context_parallel as cp
from tests.test_context_parallel import _mesh, _qkv, _spec, assert_sharded_matches
from tests.tolerances import FP32_MODEL_RTOL, assert_close

B, H, S = 2, 8, 32
# Document lengths of each row: boundaries inside and across the chunks of 2, 4 and 8 devices (chunks of
# 16, 8 and 2 rows), one-token documents, and a row that is one document.
DOCUMENTS = [[5, 1, 14, 1, 11], [S]]


def document_starts(lengths_per_row: list[list[int]]) -> np.ndarray:
  """[rows, sum(lengths)] int32: each token's place of its document's first token."""
  return np.stack([np.repeat(np.cumsum([0] + lengths[:-1]), lengths) for lengths in lengths_per_row]).astype(np.int32)


def _attend_within(q, k, v):
  """Causal softmax attention of one document's tokens alone (GQA by repeating key/value heads)."""
  groups = q.shape[-2] // k.shape[-2]
  k, v = jnp.repeat(k, groups, axis=-2), jnp.repeat(v, groups, axis=-2)
  scores = jnp.einsum("snh,tnh->nst", q, k) / np.sqrt(q.shape[-1])
  visible = np.tril(np.ones((len(q), len(k)), bool))
  p = jax.nn.softmax(jnp.where(visible, scores, -np.inf), axis=-1)
  return jnp.einsum("nst,tnh->snh", p, v)


def _per_document(q, k, v):
  rows = []
  for b, lengths in enumerate(DOCUMENTS):
    bounds = np.cumsum([0] + lengths)
    rows.append(jnp.concatenate([_attend_within(q[b, a:e], k[b, a:e], v[b, a:e])
                                 for a, e in zip(bounds[:-1], bounds[1:])]))
  return jnp.stack(rows)


@jax.jit
def _reference_and_grads(q, k, v, ct):
  out, vjp = jax.vjp(_per_document, q, k, v)
  return out, vjp(ct)


# (kind, mesh shape, mesh axis names, batch axes, sequence axes)
CASES = [
    ("local", (1,), ("seq",), (), ()),
    ("allgather", (4,), ("seq",), (), ("seq",)),
    ("allgather", (2, 4), ("data", "seq"), ("data",), ("seq",)),
    ("ring", (4,), ("seq",), (), ("seq",)),
    ("zigzag_ring", (2,), ("seq",), (), ("seq",)),
    ("zigzag_ring", (8,), ("seq",), (), ("seq",)),
    ("zigzag_ring", (2, 4), ("data", "seq"), ("data",), ("seq",)),
    ("ulysses", (4,), ("seq",), (), ("seq",)),
    ("ulysses", (2, 4), ("a", "b"), (), ("a", "b")),
]


@pytest.mark.parametrize("kernel", ["", "xla"], ids=["einsum", "kernel"])
@pytest.mark.parametrize("kind,shape,names,batch_axes,seq_axes", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" + ("-batch" if c[3] else "") for c in CASES])
def test_every_kind_attends_within_documents(kind, shape, names, batch_axes, seq_axes, kernel):
  mesh = _mesh(shape, names)
  n = int(np.prod([mesh.shape[a] for a in seq_axes]))
  q, k, v, ct = _qkv(B, S, 8, 8 if kind == "ulysses" else 4, H)  # GQA but for Ulysses (it splits the kv heads)
  order = cp.zigzag_order(S, n)
  inverse = np.argsort(order)
  pos = jnp.broadcast_to(jnp.asarray(order), (B, S))
  starts = jnp.asarray(document_starts(DOCUMENTS))[:, order]
  spec = _spec(batch_axes, seq_axes)
  sharding = NamedSharding(mesh, spec)
  args = [jax.device_put(a, sharding) for a in (q[:, order], k[:, order], v[:, order], pos, starts, ct[:, order])]
  attend = jax.shard_map(
      lambda q, k, v, pos, starts: cp.sharded_attention(q, k, v, pos, implementation=kind, axis_names=seq_axes,
                                                        kernel=kernel, starts_BS=starts),
      mesh=mesh, in_specs=(spec,) * 5, out_specs=spec)
  assert_sharded_matches(attend, args, inverse, _reference_and_grads(q, k, v, ct), kind)


def test_without_the_mask_documents_see_each_other():
  """The reference is not plain causal attention: the test above fails if the starts are ignored."""
  q, k, v, _ = _qkv(B, S, 8, 4, H)
  pos = jnp.broadcast_to(jnp.arange(S), (B, S))
  causal = cp.causal_attention(q, k, v, pos, pos)
  assert np.max(np.abs(np.asarray(causal - _per_document(q, k, v)))) > 0.1


# The model: a packed batch with its documents masked apart against the same documents as separate rows.

MODEL_LEN = 16
MESH_FIELDS = ("data", "expert", "tensor", "sequence")
# (mesh sizes, preset, tier, layer schedule, attention kind, attention kernel, attention). Each runs a kind of
# context-parallel attention the others do not, inside the whole model, with the sequence split or whole.
MODEL_LAYOUTS = [((2, 4, 1, 1), "ep", "xla", "sequential", "allgather", "einsum", "gqa"),
                 ((2, 2, 1, 2), "megascale", "reference", "two_halves", "ring", "einsum", "gqa"),
                 ((1, 2, 1, 4), "megascale", "xla", "sequential", "ring", "einsum", "mla"),  # the zigzag ring
                 ((2, 2, 1, 2), "megascale", "reference", "sequential", "allgather", "tokamax", "gqa"),
                 ((2, 2, 1, 2), "megascale", "reference", "sequential", "ulysses", "einsum", "mla")]


def _model_config(attention: str, restart: bool):
  from tests.test_model_sharded import small_config

  config = small_config()  # a dense layer, then an MoE layer with a shared expert; dropless
  config.train.seq_len = MODEL_LEN
  config.data.document_mask, config.data.restart_positions = True, restart
  if attention == "mla":
    config.model.attention, config.model.q_lora_rank, config.model.kv_lora_rank = "mla", 16, 16
    config.model.qk_nope_head_dim, config.model.qk_rope_head_dim, config.model.v_head_dim = 8, 8, 8
    config.model.num_kv_heads = config.model.num_heads
  return config


def _packed_batch(rows: int):
  """Rows of MODEL_LEN tokens, each cut into random documents (one-token ones included), and the lengths."""
  rng = np.random.default_rng(11)
  lengths = []
  for _ in range(rows):
    cuts = np.sort(rng.choice(np.arange(1, MODEL_LEN), size=rng.integers(1, 5), replace=False))
    lengths.append(np.diff(np.concatenate([[0], cuts, [MODEL_LEN]])).tolist())
  lengths[0] = [3, 1, 1, 11]
  tokens = rng.integers(1, 64, (rows, MODEL_LEN + 1), np.int32)
  return tokens[:, :-1], tokens[:, 1:], lengths


def _model_terms(config, devices, batch, positions=None):
  """train_step.loss_terms of `batch` under `config`'s layout (decoder.lm_loss_terms with `positions`, on one
  device, for the reference)."""
  from flax import nnx

  from meshmoe.models.decoder import lm_loss_terms
  from meshmoe.sharding.shardings import use_plan
  from meshmoe.training import train_step
  from tests.model_steps import init_model, plan_for

  plan = plan_for(config.validate(len(devices)), devices)
  graphdef, params, others = nnx.split(init_model(config, plan), nnx.Param, ...)
  if positions is not None:
    def terms_of(params, others, batch):
      with use_plan(plan):
        return lm_loss_terms(nnx.merge(graphdef, params, others), batch["inputs"], batch["targets"], batch["mask"],
                             positions)
  else:
    batch = jax.device_put(batch, plan.batch_sharding())
    terms_of = lambda params, others, batch: train_step.loss_terms(graphdef, params, others, batch, plan,
                                                                  restart_positions=config.data.restart_positions)
  return jax.tree.map(np.asarray, jax.jit(terms_of)(params, others, batch))


def _separate_documents(restart: bool, attention: str):
  """The packed batch's documents as rows of their own, padded (masked) to MODEL_LEN, on one device, at
  positions from 0 (restart) or from their place in the packed row."""
  from meshmoe.config import MeshConfig

  config = _model_config(attention, restart)
  inputs, targets, lengths = _packed_batch(config.train.global_batch_size)
  rows = [(b, a, e) for b, row in enumerate(lengths) for a, e in zip(np.cumsum([0] + row[:-1]), np.cumsum(row))]
  pad = lambda source: np.stack([np.pad(source[b, a:e], (0, MODEL_LEN - (e - a))) for b, a, e in rows])
  mask = np.stack([np.arange(MODEL_LEN) < e - a for _, a, e in rows]).astype(np.float32)
  positions = np.stack([np.arange(MODEL_LEN) + (0 if restart else a) for _, a, _ in rows]).astype(np.int32)
  config.mesh = MeshConfig(data=1, preset="dp")
  config.train.global_batch_size = len(rows)
  config.data.document_mask = config.data.restart_positions = False
  batch = {"inputs": jnp.asarray(pad(inputs)), "targets": jnp.asarray(pad(targets)), "mask": jnp.asarray(mask)}
  return _model_terms(config, jax.devices()[:1], batch, jnp.asarray(positions))


@pytest.mark.parametrize("restart", [True, False], ids=["restarting", "row_positions"])
@pytest.mark.parametrize("sizes,preset,impl,schedule,kind,kernel,attention", MODEL_LAYOUTS,
                         ids=[f"{p}-{'x'.join(map(str, m))}-{k}-{kern}-{a}" for m, p, _, _, k, kern, a in MODEL_LAYOUTS])
def test_packed_documents_train_as_separate_rows(sizes, preset, impl, schedule, kind, kernel, attention, restart):
  from meshmoe.config import MeshConfig, ParallelConfig

  config = _model_config(attention, restart)
  config.mesh = MeshConfig(**dict(zip(MESH_FIELDS, sizes)), preset=preset)
  config.parallel = ParallelConfig(impl=impl, layer_schedule=schedule, attention=kind, attention_kernel=kernel)
  inputs, targets, lengths = _packed_batch(config.train.global_batch_size)
  batch = {"inputs": inputs, "targets": targets, "mask": np.ones(inputs.shape, np.float32),
           "document_starts": document_starts(lengths)}
  terms = _model_terms(config, jax.devices()[:int(np.prod(sizes))], batch)
  reference = _separate_documents(restart, attention)
  assert terms["tokens"] == reference["tokens"] == inputs.size
  np.testing.assert_array_equal(terms["expert_load"], reference["expert_load"])  # counts: exact
  for name in ("ce_sum", "aux_loss", "z_loss"):
    assert_close(terms[name], reference[name], FP32_MODEL_RTOL, name)


@pytest.mark.parametrize("restart", [True, False])
def test_documents_follow_the_sequence_order(restart):
  """The starts are permuted like the tokens (zigzag: the sequence split over 8 devices) and the rotary positions count
  from each document's start, or are the places in the row. (Attention cannot tell the two apart:
  rotary embeddings depend only on position differences, so the test above passes either way.)"""
  from meshmoe.config import MeshConfig
  from meshmoe.training.model_state import documents_in_sequence_order, in_sequence_order
  from tests.model_steps import plan_for

  config = _model_config("gqa", restart)
  config.mesh = MeshConfig(expert=2, sequence=4, preset="megascale")
  plan = plan_for(config.validate(8), jax.devices())
  lengths = [[3, 1, 1, 11], [MODEL_LEN]]
  starts = document_starts(lengths)
  documents = documents_in_sequence_order(plan, jnp.asarray(starts), restart)
  _, _, _, positions = in_sequence_order(plan, *[jnp.asarray(starts)] * 3)  # the tokens' order: their places
  order = np.asarray(positions)[0]
  assert not np.array_equal(order, np.arange(MODEL_LEN))
  np.testing.assert_array_equal(documents.starts_BS, starts[:, order])
  within = np.concatenate([np.arange(n) for n in lengths[0]])
  expected = np.stack([within, np.arange(MODEL_LEN)]) if restart else np.stack([np.arange(MODEL_LEN)] * 2)
  np.testing.assert_array_equal(documents.rope_positions_BS, expected[:, order])


# The data pipeline.


def test_document_starts_follow_the_end_of_document_tokens():
  from meshmoe.data.pipeline import document_starts as pipeline_starts

  eos = 0
  inputs = np.array([[5, 6, 0, 7, 0, 0, 8, 9],  # a row that begins inside a document; an empty document
                     [1, 2, 3, 4, 5, 6, 7, 0]])  # one document, its end the last input
  np.testing.assert_array_equal(pipeline_starts(inputs, eos), [[0, 0, 0, 3, 3, 5, 6, 6], [0] * 8])


def test_packed_batches_carry_document_starts(tmp_path):
  from meshmoe.config import Config
  from meshmoe.data import pipeline

  docs = ["abcdefghij", "klmnopq", "rstuvwxyz01234"]  # with EOS (0): 11 + 8 + 15 = 34 tokens, 4 rows of 8 + 1
  paths = []
  for i, text in enumerate(docs):
    (tmp_path / f"{i}.txt").write_text(text)
    paths.append(str(tmp_path / f"{i}.txt"))
  (tmp_path / "eval.txt").write_text("held out")
  config = Config()
  config.train.seq_len, config.train.global_batch_size, config.train.eval_batches = 8, 4, 1
  config.data.source, config.data.paths, config.data.eval_paths = "text", ",".join(paths), str(tmp_path / "eval.txt")
  config.data.document_mask = True
  built = pipeline.build_data(config, log=lambda _: None)
  stream = np.array([t for d in docs for t in [*d.encode(), 0]])
  begins = np.concatenate([[0], np.flatnonzero(stream == 0) + 1])  # where documents begin in the stream
  batch = next(built.train)  # the whole epoch: the 4 rows, shuffled
  assert batch["document_starts"].dtype == np.int32
  for inputs, starts in zip(batch["inputs"], batch["document_starts"]):
    first = 8 * next(r for r in range(4) if np.array_equal(stream[8 * r:8 * r + 8], inputs))
    expected = [max(begins[begins <= first + i].max() - first, 0) for i in range(8)]
    np.testing.assert_array_equal(starts, expected)
  np.testing.assert_array_equal(built.eval_batches["text"][0]["document_starts"], 0)  # "held out": one document


def test_a_tokenizer_without_an_end_of_document_token_is_refused():
  from types import SimpleNamespace

  from meshmoe.config import Config, ConfigError
  from meshmoe.data import pipeline

  config = Config()
  config.data.document_mask = True
  with pytest.raises(ConfigError, match="data.document_mask.*no end-of-document token"):
    pipeline._document_end(config, SimpleNamespace(eos_id=None))
  config.data.document_mask = False
  assert pipeline._document_end(config, SimpleNamespace(eos_id=None)) is None
