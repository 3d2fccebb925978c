"""Rows of one split of one dataset, by index, and the order a run reads them in.

Packed rows (data.packing): windows of seq_len + 1 tokens at stride seq_len over the split's token stream,
the documents back to back with their end-of-document tokens. Row i is tokens [i * seq_len, i * seq_len +
seq_len + 1): nothing is held per row, so memory does not grow with the corpus. Unpacked rows: each document
cut into windows of at most seq_len + 1 tokens (overlapping by one token, like packing), padded, with a
loss mask; their starts and lengths are held in memory (16 bytes per row) and built from the documents'
index (8 bytes per document while building).

Order: source row `j` of a run is row `shuffle(j mod n)` of epoch `j // n`, a permutation of the n rows
computed per index (grain's index_shuffle, a Feistel network: no permutation array), seeded per epoch, so
every epoch visits every row once in its own order.
"""

import numpy as np
from grain.experimental import index_shuffle

from meshmoe.data.token_store import DataError, SplitReader


class PackedRows:
  def __init__(self, reader: SplitReader, seq_len: int):
    self.reader, self.seq_len = reader, seq_len
    self.num_rows = max(reader.num_tokens - 1, 0) // seq_len

  def target_tokens(self, rows: np.ndarray) -> np.ndarray:
    """The number of loss tokens of each row."""
    return np.full(len(rows), self.seq_len, np.int64)

  def read(self, row: int, out: np.ndarray) -> int:
    """Writes row `row`'s seq_len + 1 tokens into `out`; returns how many are real (the rest is padding)."""
    out[:] = self.reader.read(row * self.seq_len, self.seq_len + 1)
    return self.seq_len + 1


class UnpackedRows:
  def __init__(self, reader: SplitReader, seq_len: int):
    self.reader, self.seq_len = reader, seq_len
    offsets = reader.document_offsets()
    lengths = np.diff(offsets)
    windows = np.where(lengths >= 2, (lengths - 2) // seq_len + 1, 0)  # ceil((length - 1) / seq_len)
    doc = np.repeat(np.arange(len(lengths)), windows)
    first_row = np.cumsum(windows) - windows
    self.starts = offsets[doc] + (np.arange(len(doc)) - first_row[doc]) * seq_len
    self.lengths = np.minimum(seq_len + 1, offsets[doc + 1] - self.starts)
    self.num_rows = len(self.starts)

  def target_tokens(self, rows: np.ndarray) -> np.ndarray:
    return self.lengths[rows] - 1

  def read(self, row: int, out: np.ndarray) -> int:
    length = int(self.lengths[row])
    out[:length] = self.reader.read(int(self.starts[row]), length)
    out[length:] = 0
    return length


def make_rows(reader: SplitReader, seq_len: int, packing: bool, what: str) -> PackedRows | UnpackedRows:
  rows = (PackedRows if packing else UnpackedRows)(reader, seq_len)
  if rows.num_rows == 0:
    raise DataError(f"{what} holds {reader.num_tokens:,} tokens in {reader.num_documents:,} document(s): not one "
                    f"row of seq_len + 1 = {seq_len + 1} tokens")
  if rows.num_rows > 2**32:
    raise DataError(f"{what} holds {rows.num_rows:,} rows; the shuffle takes at most 2**32 per dataset: split "
                    "it into several datasets of a mixture, or raise train.seq_len")
  return rows


def epoch_order(index: np.ndarray, num_rows: int, seed: int) -> np.ndarray:
  """The row each run index reads: a fresh permutation of all rows per epoch."""
  epoch, position = np.divmod(index, num_rows)
  return np.fromiter((index_shuffle(int(p), max_index=num_rows - 1, seed=int((seed + e) % 2**32), rounds=4)
                      for p, e in zip(position, epoch)), np.int64, len(index))
