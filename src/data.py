"""Training and eval data: documents -> tokens -> rows -> deterministic, resumable grain batches.

- Documents come from the Python standard library's source files (`data.source="stdlib"`, text every
  machine has) or from the user's files (text, JSONL with a `text` field, ArrayRecord of UTF-8 records).
  Train and eval are split by file (a hash of the file's name) unless `data.eval_paths` names eval files;
  a single file is split by its last documents.
- Tokens: bytes (vocabulary 256, byte 0 separates documents) or a Hugging Face `tokenizer.json`.
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
import glob
import json
import math
import os
import pathlib
import sysconfig
import zlib
from collections.abc import Iterator, Sequence

import grain
import numpy as np

from meshmoe.config import Config, ConfigError, DataConfig


class DataError(ValueError):
  """Missing, empty, unreadable or malformed data."""


class ByteTokenizer:
  vocab_size, eos_id = 256, 0

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")


class HuggingFaceTokenizer:
  _EOS_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")

  def __init__(self, path: str):
    from tokenizers import Tokenizer

    try:
      self._tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception subclasses for missing/bad files
      raise ConfigError("data.tokenizer", path, f"a readable tokenizer.json file ({e})") from None
    self.vocab_size = self._tokenizer.get_vocab_size()
    ids = [self._tokenizer.token_to_id(name) for name in self._EOS_NAMES]
    self.eos_id = next((i for i in ids if i is not None), None)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._tokenizer.encode(text).ids, np.int32)

  def encode_many(self, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(e.ids, np.int32) for e in self._tokenizer.encode_batch(texts)]

  def decode(self, ids: Sequence[int]) -> str:
    return self._tokenizer.decode([int(i) for i in ids])


def load_tokenizer(cfg: DataConfig, vocab_size: int):
  tokenizer = ByteTokenizer() if cfg.tokenizer == "byte" else HuggingFaceTokenizer(cfg.tokenizer)
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError("model.vocab_size", vocab_size,
                      f"at least {tokenizer.vocab_size}, the vocabulary of tokenizer {cfg.tokenizer!r}")
  return tokenizer


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
  train_docs, eval_docs = _documents(cfg)
  splits = {}
  for name, docs in (("train", train_docs), ("eval", eval_docs)):
    stream, starts, lengths = _rows(_encode(tokenizer, docs), tokenizer.eos_id, train.seq_len, cfg.packing)
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


def _encode(tokenizer, docs: list[str]) -> list[np.ndarray]:
  if isinstance(tokenizer, HuggingFaceTokenizer):
    return tokenizer.encode_many(docs)
  return [tokenizer.encode(doc) for doc in docs]


def _documents(cfg: DataConfig) -> tuple[list[str], list[str]]:
  """(train documents, eval documents) for the configured source."""
  if cfg.source == "stdlib":
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "__pycache__"} & set(p.parts))
    named = [(str(p.relative_to(root)), p) for p in files]
  else:
    files = _expand(cfg.paths, "data.paths")
    # Names relative to the files' common folder: the split does not depend on where the data lives.
    common = os.path.commonpath([str(p.absolute().parent) for p in files])
    named = [(os.path.relpath(p.absolute(), common), p) for p in files]
  if cfg.eval_paths.strip():
    eval_files = _expand(cfg.eval_paths, "data.eval_paths")
    train = [doc for _, path in named for doc in _read(path, cfg.source)]
    return _nonempty(train, "train"), _nonempty([d for p in eval_files for d in _read(p, cfg.source)], "eval")
  held_out = {name for name, _ in named if zlib.crc32(name.encode()) % 10_000 < cfg.eval_fraction * 10_000}
  if held_out and len(held_out) < len(named):
    train = [doc for name, path in named if name not in held_out for doc in _read(path, cfg.source)]
    evaluation = [doc for name, path in named if name in held_out for doc in _read(path, cfg.source)]
  else:  # too few files for the hash to split them: hold out the last documents instead
    train = [doc for _, path in named for doc in _read(path, cfg.source)]
    if len(train) < 2:
      raise DataError(f"cannot hold out eval data from {len(train)} document(s) in {len(named)} file(s); "
                      "add documents or name eval files in data.eval_paths")
    cut = len(train) - max(1, math.floor(len(train) * cfg.eval_fraction))
    train, evaluation = train[:cut], train[cut:]
  return _nonempty(train, "train"), _nonempty(evaluation, "eval")


def _nonempty(docs: list[str], name: str) -> list[str]:
  docs = [d for d in docs if d]
  if not docs:
    raise DataError(f"the {name} data holds no text")
  return docs


def _expand(patterns: str, field: str) -> list[pathlib.Path]:
  files: dict[str, pathlib.Path] = {}
  for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not matches:
      raise DataError(f"{field}: {pattern!r} matches no file")
    for match in matches:
      if os.path.isfile(match):
        files.setdefault(os.path.abspath(match), pathlib.Path(match))
  if not files:
    raise DataError(f"{field}: {patterns!r} names directories only; give files or glob patterns")
  return list(files.values())


def _read(path: pathlib.Path, source: str) -> list[str]:
  """The documents in one file."""
  try:
    if source == "arrayrecord":
      reader = grain.sources.ArrayRecordDataSource([str(path)])
      return [bytes(reader[i]).decode("utf-8", errors="replace") for i in range(len(reader))]
    raw = path.read_bytes()
  except OSError as e:
    raise DataError(f"cannot read {path}: {e.strerror or e}") from None
  except Exception as e:  # array_record raises its own errors for files that are not ArrayRecord
    raise DataError(f"cannot read {path} as ArrayRecord: {e}") from None
  text = raw.decode("utf-8", errors="replace")
  if source != "jsonl":
    return [text]
  docs = []
  for number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path} line {number}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
      raise DataError(f"{path} line {number}: needs a string field 'text'")
    docs.append(record["text"])
  return docs
