"""Tokenizers: bytes (vocabulary 256, byte 0 separates documents) or a Hugging Face `tokenizer.json`."""

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


def load_tokenizer(cfg: DataConfig, vocab_size: int):
  tokenizer = ByteTokenizer() if cfg.tokenizer == "byte" else HuggingFaceTokenizer(cfg.tokenizer)
  if tokenizer.vocab_size > vocab_size:
    raise ConfigError("model.vocab_size", vocab_size,
                      f"at least {tokenizer.vocab_size}, the vocabulary of tokenizer {cfg.tokenizer!r}")
  return tokenizer


def encode_documents(tokenizer, docs: list[str]) -> list[np.ndarray]:
  """Each document's token ids (the Hugging Face tokenizer encodes them as one batch, in parallel)."""
  if isinstance(tokenizer, HuggingFaceTokenizer):
    return tokenizer.encode_many(docs)
  return [tokenizer.encode(doc) for doc in docs]
