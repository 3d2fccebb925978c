"""Training and eval data: tokenized datasets -> mixed, shuffled, per-process batches through grain.

Every source ends up in token_store.py's on-disk format: "tokenized" names dataset folders written by
`python -m experiments.tokenize`, a raw source is tokenized into a cache on first use (tokenizing.py). Then:
- Rows (rows.py) are read by random access: packed windows or padded documents, each epoch of each dataset
  in its own shuffled order.
- Several datasets mix by weight (mixture.py): global row g of the run comes from a dataset and an index
  computed from g alone.
- Element b of the grain MapDataset is global batch b: rows b * global_batch_size + (0..B-1); this process
  reads only its rows of it (`rows`, from the batch sharding; the whole batch when the batch is not split
  across processes), so any number of processes together load exactly the batches one process would, and
  grain's prefetching threads (data.loader_threads) assemble the next batches while a step runs.
- The iterator's state (checkpointed with every step) is the number of global batches read plus the
  tokens each dataset has contributed: a checkpoint resumes under any process count.
- Eval: each dataset's own eval split, read in order, `train.eval_batches` batches per dataset.
- Documents (data.document_mask): each batch also holds "document_starts", each input token's place in its
  row of its document's first token: 0, or the place after the row's last end-of-document token before it
  (`document_starts`). Found from the tokens, so nothing is held per document.
Memory: a packed run holds nothing per row or per document, so its resident memory does not grow with the
corpus (experiments/benchmarks/data_loader.py measures it); unpacked rows cost 16 bytes each.
"""

import dataclasses
import sys
import zlib

import grain
import numpy as np

from meshmoe.config import Config, ConfigError, mixture_entries
from meshmoe.data import rows as rows_lib
from meshmoe.data import token_store, tokenizers, tokenizing
from meshmoe.data.mixture import Mixture
from meshmoe.data.token_store import DataError


@dataclasses.dataclass
class Data:
  tokenizer: tokenizers.ByteTokenizer | tokenizers.HuggingFaceTokenizer
  train: "TrainIterator"
  eval_batches: dict[str, list[dict[str, np.ndarray]]]  # per dataset
  sources: list[str]  # dataset names, in mixture order
  weights: list[float]
  unigram_entropy_nats: float  # of the mixture's train tokens: the loss of a model that ignores context
  train_tokens: int
  eval_tokens: int


def build_data(config: Config, rows: range | None = None, log=print) -> Data:
  """The data of `config`; `rows` are the rows of each global batch this process loads (default: all)."""
  cfg, train = config.data, config.train
  batch_size = train.global_batch_size
  rows = range(batch_size) if rows is None else rows
  if rows.step != 1 or not 0 <= rows.start < rows.stop <= batch_size:
    raise ValueError(f"rows must be a contiguous block of the {batch_size} rows of a batch, got {rows}")
  if cfg.source == "tokenized":
    entries = mixture_entries(cfg.paths)
  else:
    entries = [(cfg.source, str(tokenizing.cached_dataset(cfg, log)), 1.0)]
  manifests = [token_store.read_manifest(folder) for _, folder, _ in entries]
  tokenizer = _tokenizer(config, entries, manifests)
  names, weights = [e[0] for e in entries], [e[2] for e in entries]

  train_rows, eval_rows = [], {}
  for (name, _, _), manifest in zip(entries, manifests):
    readers = {split: token_store.SplitReader(manifest, split) for split in token_store.SPLITS}
    train_rows.append(rows_lib.make_rows(readers["train"], train.seq_len, cfg.packing,
                                         f"the train split of dataset {name!r} ({manifest.folder})"))
    eval_rows[name] = rows_lib.make_rows(readers["eval"], train.seq_len, cfg.packing,
                                         f"the eval split of dataset {name!r} ({manifest.folder})")
  mixture = Mixture(weights)
  seeds = [zlib.crc32(f"{train.seed}/{name}".encode()) for name in names]
  eos = _document_end(config, tokenizer)
  batches = _Batches(train_rows, mixture, seeds, batch_size, rows, train.seq_len, names, eos)
  # Always explicit: grain's default (read_options=None) is 16 threads and 500 batches ahead.
  options = grain.ReadOptions(num_threads=cfg.loader_threads, prefetch_buffer_size=2 * cfg.loader_threads)
  dataset = grain.MapDataset.source(batches).to_iter_dataset(options)
  evals = {}
  for name in names:
    source = _Batches([eval_rows[name]], Mixture([1.0]), None, batch_size, rows, train.seq_len, [name], eos)
    evals[name] = [_without_counts(source[b]) for b in range(train.eval_batches)]
  return Data(tokenizer, TrainIterator(iter(dataset), batches), evals, names, mixture.weights,
              _unigram_entropy(train_rows, mixture.weights, tokenizer.vocab_size),
              sum(r.reader.num_tokens for r in train_rows), sum(r.reader.num_tokens for r in eval_rows.values()))


class TrainIterator:
  """The train batches, with the tokens each dataset has contributed so far (a checkpointable position)."""

  def __init__(self, iterator, batches: "_Batches"):
    self._iterator, self._batches = iterator, batches
    self.source_tokens = np.zeros(len(batches.names), np.int64)  # over all processes' rows, from step 0

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = dict(next(self._iterator))
    self.source_tokens += batch.pop("source_tokens")
    return batch

  def source_token_counts(self) -> dict[str, int]:
    return {name: int(n) for name, n in zip(self._batches.names, self.source_tokens)}

  def get_state(self) -> dict:
    return dict(self._iterator.get_state(), source_tokens=self.source_token_counts())

  def set_state(self, state: dict) -> None:
    state = dict(state)
    counts = state.pop("source_tokens", None)
    self._iterator.set_state(state)
    done = int(state.get("next_index", 0))
    if counts is None or sorted(counts) != sorted(self._batches.names):  # a checkpoint of another mixture
      self.source_tokens = sum((self._batches.source_tokens(b) for b in range(done)),
                               np.zeros(len(self._batches.names), np.int64))
    else:
      self.source_tokens = np.asarray([counts[name] for name in self._batches.names], np.int64)


class _Batches:
  """grain random-access source: element b = this process's rows of global batch b (an endless stream)."""

  def __init__(self, sources, mixture: Mixture, seeds: list[int] | None, batch_size: int, rows: range,
               seq_len: int, names: list[str], document_end: int | None = None):
    self.sources, self.mixture, self.seeds = sources, mixture, seeds
    self.batch_size, self.rows, self.seq_len, self.names = batch_size, rows, seq_len, names
    self.document_end = document_end  # the end-of-document token, when batches carry document starts

  def __len__(self) -> int:
    return sys.maxsize

  def _locate(self, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset, row within it) of each row of global batch `batch`."""
    dataset, index = self.mixture.select(batch * self.batch_size + np.arange(self.batch_size))
    row = np.empty_like(index)
    for k, source in enumerate(self.sources):
      mine = dataset == k
      if self.seeds is None:  # eval: in order, wrapping around
        row[mine] = index[mine] % source.num_rows
      else:
        row[mine] = rows_lib.epoch_order(index[mine], source.num_rows, self.seeds[k])
    return dataset, row

  def source_tokens(self, batch: int) -> np.ndarray:
    return self._counts(*self._locate(batch))

  def _counts(self, dataset: np.ndarray, row: np.ndarray) -> np.ndarray:
    """The loss tokens each dataset contributes to a global batch (all of its rows, every process's)."""
    return np.asarray([source.target_tokens(row[dataset == k]).sum() for k, source in enumerate(self.sources)],
                      np.int64)

  def __getitem__(self, batch: int) -> dict[str, np.ndarray]:
    dataset, row = self._locate(batch)
    tokens = np.empty((len(self.rows), self.seq_len + 1), np.int32)
    lengths = np.empty(len(self.rows), np.int64)
    for i, r in enumerate(self.rows):
      lengths[i] = self.sources[dataset[r]].read(int(row[r]), tokens[i])
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
             "mask": (np.arange(self.seq_len) < lengths[:, None] - 1).astype(np.float32),
             "source_tokens": self._counts(dataset, row)}
    if self.document_end is not None:
      batch["document_starts"] = document_starts(batch["inputs"], self.document_end)
    return batch


def document_starts(inputs: np.ndarray, document_end: int) -> np.ndarray:
  """[rows, S] int32: each token's place of its document's first token in its row: the place after the last
  `document_end` token before it, or 0 (a row may begin inside a document)."""
  places = np.arange(inputs.shape[1])
  after_end = np.zeros(inputs.shape, bool)
  after_end[:, 1:] = inputs[:, :-1] == document_end
  return np.maximum.accumulate(np.where(after_end, places, 0), axis=1).astype(np.int32)


def _document_end(config: Config, tokenizer) -> int | None:
  """The token that ends documents, when batches carry document starts (data.document_mask)."""
  if not config.data.document_mask:
    return None
  if tokenizer.eos_id is None:
    raise ConfigError("data.document_mask", True,
                      "False with this tokenizer: it has no end-of-document token, so packed rows do not mark "
                      "where documents begin")
  return int(tokenizer.eos_id)


def _without_counts(batch: dict) -> dict:
  return {k: v for k, v in batch.items() if k != "source_tokens"}


def _tokenizer(config: Config, entries, manifests):
  """The tokenizer all datasets share, checked against the model's vocabulary."""
  identities = {_tokenizer_key(m.raw["tokenizer"]) for m in manifests}
  if len(identities) > 1:
    listing = "; ".join(f"{name}: {m.raw['tokenizer'].get('path', 'byte')}" for (name, _, _), m in
                        zip(entries, manifests))
    raise DataError(f"the datasets of data.paths were tokenized with different tokenizers ({listing}); a "
                    "mixture needs one")
  manifest = manifests[0]
  if config.data.source == "tokenized" and config.data.tokenizer != "byte":
    if tokenizers.identity(config.data.tokenizer).get("sha256") != manifest.raw["tokenizer"].get("sha256"):
      raise ConfigError("data.tokenizer", config.data.tokenizer,
                        f"'byte' (the default: the datasets' own) or the tokenizer they were made with, "
                        f"{manifest.raw['tokenizer'].get('path', 'byte')}")
  kind = manifest.raw["tokenizer"]["kind"]
  tokenizer = tokenizers.ByteTokenizer() if kind == "byte" else tokenizers.HuggingFaceTokenizer(
      str(manifest.folder / "tokenizer.json"))
  what = f"the tokenizer of {manifest.folder}" if config.data.source == "tokenized" else (
      f"tokenizer {config.data.tokenizer!r}")
  tokenizers.check_vocabulary(manifest.vocab_size, config.model.vocab_size, what)
  return tokenizer


def _tokenizer_key(value: dict) -> str:
  return repr(sorted((k, v) for k, v in value.items() if k != "path"))


def _unigram_entropy(train_rows, weights: list[float], vocab_size: int) -> float:
  p = np.zeros(vocab_size)
  for rows, weight in zip(train_rows, weights):
    counts = rows.reader.unigram_counts()[:vocab_size]
    p[:len(counts)] += weight * counts / max(counts.sum(), 1)
  p = p[p > 0]
  return float(-np.sum(p * np.log(p)))
