"""Training and eval data: documents -> tokens -> rows -> deterministic, resumable grain batches.

Documents and the train/eval split are documents.py's, tokens tokenizers.py's. Here:
- Rows are (start, length) windows into one int32 token stream. Packing: documents concatenated with the
  end-of-document token, windows of seq_len + 1 tokens at stride seq_len. Without packing: each document
  cut into windows of at most seq_len + 1 tokens, padded, with a loss mask.
- The train stream is grain's MapDataset: shuffled per epoch from `train.seed`, repeated forever, and cut
  into global batches of `train.global_batch_size` rows. A process reads only the rows of each global
  batch that its devices hold (`rows`, from the batch sharding: a contiguous block, the whole batch when the
  batch is not split across processes), so any number of processes together see exactly the batches one
  process would see, in the same order. The iterator state is a small JSON dict that checkpoints store;
  it counts global batches, so a checkpoint resumes under any process count.
All data lives in memory: meant for corpora of up to a few GB of tokens.
"""

import dataclasses
from collections.abc import Iterator

import grain
import numpy as np

from meshmoe.config import Config
from meshmoe.data import documents
from meshmoe.data.documents import DataError
from meshmoe.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer, encode_documents, load_tokenizer


@dataclasses.dataclass
class Data:
  tokenizer: ByteTokenizer | HuggingFaceTokenizer
  train: Iterator  # grain DatasetIterator of batch dicts; get_state()/set_state() for checkpoints
  eval_batches: list[dict[str, np.ndarray]]
  unigram_entropy_nats: float  # of the train tokens: the loss of a model that ignores context
  train_tokens: int
  eval_tokens: int


def build_data(config: Config, rows: range | None = None) -> Data:
  """The data of `config`; `rows` are the rows of each global batch this process loads (default: all)."""
  cfg, train = config.data, config.train
  rows = range(train.global_batch_size) if rows is None else rows
  if rows.step != 1 or not 0 <= rows.start < rows.stop <= train.global_batch_size:
    raise ValueError(f"rows must be a contiguous block of the {train.global_batch_size} rows of a batch, got {rows}")
  tokenizer = load_tokenizer(cfg, config.model.vocab_size)
  train_docs, eval_docs = documents.train_and_eval(cfg)
  splits = {}
  for name, docs in (("train", train_docs), ("eval", eval_docs)):
    stream, starts, lengths = _rows(encode_documents(tokenizer, docs), tokenizer.eos_id, train.seq_len, cfg.packing)
    needed = train.global_batch_size if name == "train" else 1  # eval batches wrap around
    if len(starts) < needed:
      raise DataError(f"the {name} data holds {len(stream)} tokens in {len(starts)} rows; it needs at least "
                      f"{needed} row(s) of seq_len + 1 = {train.seq_len + 1} tokens")
    splits[name] = _RowSource(stream, starts, lengths, train.seq_len)
  shuffled = grain.MapDataset.source(splits["train"]).shuffle(seed=train.seed).repeat()
  train_iter = _batches(shuffled, train.global_batch_size, rows).to_iter_dataset().__iter__()
  eval_rows = grain.MapDataset.source(splits["eval"]).repeat()
  eval_iter = _batches(eval_rows, train.global_batch_size, rows).to_iter_dataset().__iter__()
  eval_batches = [next(eval_iter) for _ in range(train.eval_batches)]
  counts = np.bincount(splits["train"].stream, minlength=tokenizer.vocab_size)
  p = counts[counts > 0] / counts.sum()
  return Data(tokenizer, train_iter, eval_batches, float(-np.sum(p * np.log(p))),
              len(splits["train"].stream), len(splits["eval"].stream))


def _batches(dataset: grain.MapDataset, batch_size: int, rows: range) -> grain.MapDataset:
  """Batch i holds rows `rows` of global batch i, i.e. elements i * batch_size + rows of `dataset`."""
  if len(rows) == batch_size:
    return dataset.batch(batch_size)
  block = len(rows)
  index = lambda i: (i // block) * batch_size + rows.start + i % block
  return grain.MapDataset.range(len(dataset) // batch_size * block).map(lambda i: dataset[index(i)]).batch(block)


@dataclasses.dataclass
class _RowSource:
  """Random access to rows: inputs/targets/mask built from a window of the token stream on demand."""

  stream: np.ndarray
  starts: np.ndarray
  lengths: np.ndarray
  seq_len: int

  def __len__(self) -> int:
    return len(self.starts)

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    start, length = int(self.starts[index]), int(self.lengths[index])
    row = np.zeros(self.seq_len + 1, np.int32)
    row[:length] = self.stream[start:start + length]
    mask = (np.arange(self.seq_len) < length - 1).astype(np.float32)
    return {"inputs": row[:-1], "targets": row[1:], "mask": mask}


def _rows(docs: list[np.ndarray], eos_id: int | None, seq_len: int, packing: bool):
  """(stream, row starts, row lengths) for packed or unpacked rows of seq_len + 1 tokens."""
  if packing:
    sep = [np.asarray([eos_id], np.int32)] if eos_id is not None else []
    pieces = [piece for doc in docs for piece in (*sep, doc)][len(sep):] if docs else []
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    num_rows = max(len(stream) - 1, 0) // seq_len
    return stream, np.arange(num_rows) * seq_len, np.full(num_rows, seq_len + 1)
  stream = np.concatenate(docs) if docs else np.zeros(0, np.int32)
  starts, lengths, offset = [], [], 0
  for doc in docs:
    for begin in range(0, max(len(doc) - 1, 0), seq_len):  # windows overlap by one token, like packing
      starts.append(offset + begin)
      lengths.append(min(seq_len + 1, len(doc) - begin))
    offset += len(doc)
  return stream, np.asarray(starts, np.int64), np.asarray(lengths, np.int64)
