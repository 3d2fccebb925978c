"""Tokenizers: bytes (vocabulary 256, byte 0 separates documents) or a Hugging Face `tokenizer.json`."""

import hashlib
import pathlib
from collections.abc import Sequence

import numpy as np

from meshmoe.config import ConfigError, DataConfig


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


def from_name(name: str):
  """The tokenizer `name` names: "byte" or the path of a tokenizer.json."""
  return ByteTokenizer() if name == "byte" else HuggingFaceTokenizer(name)


def identity(name: str) -> dict:
  """What identifies a tokenizer in a dataset's manifest: its kind, and for a file its path and SHA-256."""
  if name == "byte":
    return {"kind": "byte"}
  path = pathlib.Path(name).expanduser().absolute()
  try:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
  except OSError as e:
    raise ConfigError("data.tokenizer", name, f"a readable tokenizer.json file ({e.strerror or e})") from None
  return {"kind": "tokenizer.json", "path": str(path), "sha256": digest}


def load_tokenizer(cfg: DataConfig, vocab_size: int):
  tokenizer = from_name(cfg.tokenizer)
  check_vocabulary(tokenizer.vocab_size, vocab_size, f"tokenizer {cfg.tokenizer!r}")
  return tokenizer


def check_vocabulary(data_vocab_size: int, model_vocab_size: int, what: str) -> None:
  if data_vocab_size > model_vocab_size:
    raise ConfigError("model.vocab_size", model_vocab_size,
                      f"at least {data_vocab_size}, the vocabulary of {what}")


def encode_documents(tokenizer, docs: list[str]) -> list[np.ndarray]:
  """Each document's token ids (the Hugging Face tokenizer encodes them as one batch, in parallel)."""
  if isinstance(tokenizer, HuggingFaceTokenizer):
    return tokenizer.encode_many(docs)
  return [tokenizer.encode(doc) for doc in docs]
