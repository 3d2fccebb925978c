"""The tokenized on-disk format: flat token shards with a document index, and a manifest.

A dataset folder (written by `python -m experiments.tokenize`, or by the cache on first use of a raw source):

  manifest.json            what the folder holds; written last, so a folder without it is not a dataset
  train-000000.tokens      the tokens of some documents, back to back, each document followed by the
                           tokenizer's end-of-document token; little-endian uint8/uint16/uint32 (the
                           smallest that holds the vocabulary)
  train-000000.index.npy   int64 [documents + 1]: where each document starts in the shard, and its end
  train.unigram.npy        int64 [vocab]: how often each token occurs in the train split
  eval-000000.tokens ...   the held-out split, the same way
  progress/                each unit's record (what an interrupted tokenization skips when run again)

Why flat shards and not ArrayRecord: a packed row is a window of seq_len + 1 tokens at any offset of the
concatenated documents, so a reader wants byte-offset access to a token stream. A flat shard gives it in one
`pread` (two where a row crosses into the next shard); ArrayRecord stores records (documents) in compressed
chunks, so a window would decode whole chunks of neighbouring documents. Reads use `os.pread`, not `mmap`: the
page cache holds what was read, the training process does not, so its resident memory does not grow with the
corpus (mapped pages would count towards it as the run touches them).

The manifest names the tokenizer (kind, SHA-256 of its file, vocabulary, end-of-document id), the token
dtype, and per split its shards with token and document counts and the SHA-256 of every file. Opening a
dataset checks what is cheap (every file present, its size matching its token count, each index ending at
its shard's size); `verify` also recomputes the checksums.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import resource
import threading

import numpy as np

FORMAT = "meshmoe-tokens/1"
SPLITS = ("train", "eval")


class DataError(ValueError):
  """Missing, empty, unreadable or malformed data."""


def token_dtype(vocab_size: int) -> np.dtype:
  """The smallest unsigned dtype that holds every token id of a vocabulary."""
  for dtype in (np.uint8, np.uint16, np.uint32):
    if vocab_size <= np.iinfo(dtype).max + 1:
      return np.dtype(dtype)
  raise DataError(f"a vocabulary of {vocab_size:,} tokens does not fit 32-bit token ids")


def sha256_file(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      digest.update(block)
  return digest.hexdigest()


def write_shard(folder: pathlib.Path, name: str, docs: list[np.ndarray], dtype: np.dtype) -> dict:
  """Writes one shard (tokens + index) atomically; returns its manifest entry. `docs` end with their EOS."""
  lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens_path, index_path = folder / f"{name}.tokens", folder / f"{name}.index.npy"
  # Temporary names of this process's own: processes that fill one cache folder at once write the same
  # bytes, and each rename is atomic.
  tokens_tmp, index_tmp = (p.with_name(f"{p.name}.{os.getpid()}.tmp") for p in (tokens_path, index_path))
  with open(tokens_tmp, "wb") as f:
    for doc in docs:
      f.write(np.ascontiguousarray(doc, dtype=dtype.newbyteorder("<")).tobytes())
  with open(index_tmp, "wb") as f:
    np.save(f, offsets)
  os.replace(tokens_tmp, tokens_path)
  os.replace(index_tmp, index_path)
  return {"tokens": tokens_path.name, "index": index_path.name, "num_tokens": int(offsets[-1]),
          "num_documents": len(docs), "sha256_tokens": sha256_file(tokens_path),
          "sha256_index": sha256_file(index_path)}


def write_json(path: pathlib.Path, value) -> None:
  """Writes `value` as JSON atomically (a reader never sees half a file)."""
  tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
  tmp.write_text(json.dumps(value, indent=1) + "\n")
  os.replace(tmp, path)


@dataclasses.dataclass(frozen=True)
class Manifest:
  folder: pathlib.Path
  raw: dict

  @property
  def vocab_size(self) -> int:
    return self.raw["tokenizer"]["vocab_size"]

  @property
  def eos_id(self) -> int | None:
    return self.raw["tokenizer"]["eos_id"]

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(self.raw["dtype"])

  def split(self, name: str) -> dict:
    return self.raw["splits"][name]


def read_manifest(folder: str | pathlib.Path) -> Manifest:
  """The manifest of a dataset folder, checked against its shards (presence, sizes, index ends)."""
  folder = pathlib.Path(folder).expanduser()
  path = folder / "manifest.json"
  if not path.is_file():
    hint = " (its tokenization did not finish: run experiments.tokenize again to complete it)" if (
        folder / "progress").is_dir() else ""
    raise DataError(f"{folder} is not a tokenized dataset: it has no manifest.json{hint}")
  try:
    raw = json.loads(path.read_text())
    if raw.get("format") != FORMAT:
      raise DataError(f"{path}: format {raw.get('format')!r}, this meshmoe reads {FORMAT!r}")
    manifest = Manifest(folder, raw)
    dtype = manifest.dtype
    for split in SPLITS:
      for shard in manifest.split(split)["shards"]:
        _check_shard(folder, shard, dtype)
  except (KeyError, TypeError, json.JSONDecodeError) as e:
    raise DataError(f"{path} is not a valid manifest ({type(e).__name__}: {e})") from None
  return manifest


def _check_shard(folder: pathlib.Path, shard: dict, dtype: np.dtype) -> None:
  tokens, index = folder / shard["tokens"], folder / shard["index"]
  for path in (tokens, index):
    if not path.is_file():
      raise DataError(f"{folder}/manifest.json names {path.name}, which is missing")
  expected = shard["num_tokens"] * dtype.itemsize
  if tokens.stat().st_size != expected:
    raise DataError(f"{tokens} holds {tokens.stat().st_size:,} bytes; the manifest says {shard['num_tokens']:,} "
                    f"{dtype.name} tokens ({expected:,} bytes): the shard is truncated or does not belong here")
  offsets = np.load(index, mmap_mode="r")
  if len(offsets) != shard["num_documents"] + 1 or offsets[0] != 0 or offsets[-1] != shard["num_tokens"]:
    raise DataError(f"{index} does not match the manifest ({len(offsets) - 1:,} documents ending at token "
                    f"{int(offsets[-1]):,}; manifest: {shard['num_documents']:,} documents, "
                    f"{shard['num_tokens']:,} tokens)")


def verify(folder: str | pathlib.Path) -> Manifest:
  """`read_manifest` plus every file's SHA-256 against the manifest (reads the whole dataset)."""
  manifest = read_manifest(folder)
  for split in SPLITS:
    for shard in manifest.split(split)["shards"]:
      for key in ("tokens", "index"):
        path = manifest.folder / shard[key]
        if sha256_file(path) != shard[f"sha256_{key}"]:
          raise DataError(f"{path}: its SHA-256 differs from the manifest's; the file is corrupt")
  return manifest


class SplitReader:
  """Random access to one split's token stream (its shards concatenated in manifest order) by `pread`.

  Thread-safe: reads carry their offsets. File descriptors are opened on first use and kept (one per shard
  read; the soft open-file limit is raised to the hard one)."""

  def __init__(self, manifest: Manifest, split: str):
    self.manifest, self.split = manifest, split
    shards = manifest.split(split)["shards"]
    self.paths = [manifest.folder / s["tokens"] for s in shards]
    self.index_paths = [manifest.folder / s["index"] for s in shards]
    sizes = np.asarray([s["num_tokens"] for s in shards], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    self.num_tokens = int(self.starts[-1])
    self.num_documents = sum(s["num_documents"] for s in shards)
    self.dtype = manifest.dtype
    self._fds: dict[int, int] = {}
    self._lock = threading.Lock()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard and len(shards) > soft // 2:
      resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

  def read(self, start: int, length: int) -> np.ndarray:
    """Tokens [start, start + length) of the split as int32; a short read or an out-of-vocabulary id raises
    DataError naming the shard and offset."""
    out = np.empty(length, np.int32)
    done = 0
    shard = int(np.searchsorted(self.starts, start, side="right")) - 1
    while done < length:
      offset = start + done - int(self.starts[shard])
      count = min(length - done, int(self.starts[shard + 1]) - (start + done))
      nbytes = count * self.dtype.itemsize
      raw = os.pread(self._fd(shard), nbytes, offset * self.dtype.itemsize)
      if len(raw) != nbytes:
        raise DataError(f"{self.paths[shard]}: reading {count:,} tokens at token {offset:,} returned "
                        f"{len(raw) // self.dtype.itemsize:,}; the shard was truncated after the run started")
      out[done:done + count] = np.frombuffer(raw, self.dtype.newbyteorder("<"))
      done, shard = done + count, shard + 1
    # uint32 ids of 2**31 and more read back negative as int32: corrupt as well.
    if length and (int(out.max()) >= self.manifest.vocab_size or int(out.min()) < 0):
      bad = int(np.argmax((out >= self.manifest.vocab_size) | (out < 0)))
      raise DataError(f"corrupt record in {self._locate(start + bad)}: token id {int(out[bad]) % 2**32} is outside the "
                      f"manifest's vocabulary of {self.manifest.vocab_size}")
    return out

  def document_offsets(self) -> np.ndarray:
    """int64 [documents + 1]: where each document of the split starts in its stream (8 bytes per document)."""
    pieces = [np.load(path)[:-1] + start for path, start in zip(self.index_paths, self.starts)]
    return np.concatenate([*pieces, [self.num_tokens]]).astype(np.int64)

  def unigram_counts(self) -> np.ndarray:
    return np.load(self.manifest.folder / f"{self.split}.unigram.npy")

  def _locate(self, position: int) -> str:
    shard = int(np.searchsorted(self.starts, position, side="right")) - 1
    return f"{self.paths[shard]} at token {position - int(self.starts[shard]):,}"

  def _fd(self, shard: int) -> int:
    fd = self._fds.get(shard)
    if fd is None:
      with self._lock:  # the loader's threads: one descriptor per shard
        if shard not in self._fds:
          try:
            self._fds[shard] = os.open(self.paths[shard], os.O_RDONLY)
          except OSError as e:
            raise DataError(f"cannot read {self.paths[shard]}: {e.strerror or e}") from None
        fd = self._fds[shard]
    return fd

  def close(self) -> None:
    for fd in self._fds.values():
      os.close(fd)
    self._fds.clear()
