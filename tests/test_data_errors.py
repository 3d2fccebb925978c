"""Bad datasets: one clear error each, before training where possible, and mid-run with the shard and offset.

A vocabulary larger than the model's, datasets of different tokenizers, a manifest that does not match its
shards, truncated or missing shards, a folder without a manifest, a corrupt token or a truncation met while
a run reads. Helpers (small datasets, expected windows) are tests/test_data.py's."""

import json
import pathlib

import numpy as np
import pytest

from meshmoe.config import Config, ConfigError
from meshmoe.data import pipeline, token_store
from meshmoe.data.token_store import DataError
from tests.test_data import (_config, _jsonl_dataset, _letters, _next_or_error, _rows_of, _stream, _windows,
                             _word_tokenizer, _words)


def _byte_dataset(tmp_path, name: str = "bytes") -> pathlib.Path:
  return pathlib.Path(_jsonl_dataset(tmp_path, name, _letters(5, "abcdefgh", 20)))


def test_vocabulary_larger_than_the_models(tmp_path):
  folder = _jsonl_dataset(tmp_path, "words", _words(1, 20), tokenizer=_word_tokenizer(tmp_path))
  config = _config(source="tokenized", paths=folder)
  with pytest.raises(ConfigError) as err:
    pipeline.build_data(config)
  assert err.value.field == "model.vocab_size" and err.value.value == 256
  assert f"at least 300, the vocabulary of the tokenizer of {folder}" in str(err.value)
  config.model.vocab_size = 300
  assert pipeline.build_data(config).tokenizer.vocab_size == 300
  config.data.tokenizer = str(tmp_path / "other.json")
  (tmp_path / "other.json").write_text("{}")
  with pytest.raises(ConfigError) as err:
    pipeline.build_data(config)
  assert err.value.field == "data.tokenizer"


def test_a_mixture_of_different_tokenizers(tmp_path):
  words = _jsonl_dataset(tmp_path, "words", _words(2, 20), tokenizer=_word_tokenizer(tmp_path))
  config = _config(source="tokenized", paths=f"bytes={_byte_dataset(tmp_path)}:0.5,words={words}:0.5")
  config.model.vocab_size = 512
  with pytest.raises(DataError, match=r"tokenized with different tokenizers \(bytes: byte; words: .*words.json\)"):
    pipeline.build_data(config)


def test_manifest_that_does_not_match_its_shards(tmp_path):
  folder = _byte_dataset(tmp_path)
  config = _config(source="tokenized", paths=str(folder))
  manifest = json.loads((folder / "manifest.json").read_text())
  shard = manifest["splits"]["train"]["shards"][0]
  size = (folder / shard["tokens"]).stat().st_size
  assert size == shard["num_tokens"] > 0
  shard["num_tokens"] += 3
  (folder / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(DataError) as err:
    pipeline.build_data(config)
  assert str(err.value) == (f"{folder / shard['tokens']} holds {size:,} bytes; the manifest says {size + 3:,} uint8 "
                            f"tokens ({size + 3:,} bytes): the shard is truncated or does not belong here")
  shard["num_tokens"] -= 3
  (folder / "manifest.json").write_text(json.dumps(manifest))
  assert pipeline.build_data(config).train_tokens == manifest["splits"]["train"]["num_tokens"]
  (folder / "manifest.json").write_text("{not json")
  with pytest.raises(DataError, match="manifest.json is not a valid manifest"):
    pipeline.build_data(config)


def test_truncated_and_missing_shards(tmp_path):
  folder = _byte_dataset(tmp_path)
  config = _config(source="tokenized", paths=str(folder))
  tokens = folder / "train-000000.tokens"
  data = tokens.read_bytes()
  tokens.write_bytes(data[:-5])
  with pytest.raises(DataError, match=rf"{tokens} holds {len(data) - 5:,} bytes; .* the shard is truncated"):
    pipeline.build_data(config)
  with pytest.raises(DataError, match="truncated"):
    token_store.verify(folder)
  tokens.unlink()
  with pytest.raises(DataError, match=rf"{folder}/manifest.json names train-000000.tokens, which is missing"):
    pipeline.build_data(config)
  tokens.write_bytes(data[:-1] + b"z")  # the right size, other bytes: only verify's checksums see it
  assert pipeline.build_data(config).train_tokens == len(data)
  with pytest.raises(DataError, match=rf"{tokens}: its SHA-256 differs from the manifest's; the file is corrupt"):
    token_store.verify(folder)
  index = folder / "train-000000.index.npy"
  np.save(index, np.load(index)[:-1])
  with pytest.raises(DataError, match=rf"{index} does not match the manifest"):
    pipeline.build_data(config)


def test_folder_without_a_manifest(tmp_path):
  folder = _byte_dataset(tmp_path)
  (folder / "manifest.json").unlink()
  config = _config(source="tokenized", paths=str(folder))
  with pytest.raises(DataError) as err:
    pipeline.build_data(config)
  assert str(err.value) == (f"{folder} is not a tokenized dataset: it has no manifest.json (its tokenization did "
                            "not finish: run experiments.tokenize again to complete it)")
  (tmp_path / "plain").mkdir()
  with pytest.raises(DataError) as err:
    pipeline.build_data(_config(source="tokenized", paths=str(tmp_path / "plain")))
  assert str(err.value) == f"{tmp_path / 'plain'} is not a tokenized dataset: it has no manifest.json"


def _first_row_index(config: Config, windows: list[tuple]) -> int:
  """The row the first batch of an undamaged run reads first (the first of its rows)."""
  first = _rows_of([next(pipeline.build_data(config).train)])[0]
  assert windows.count(first) == 1
  return windows.index(first)


def test_a_corrupt_token_met_mid_run(tmp_path):
  texts = _words(3, 40)
  folder = pathlib.Path(_jsonl_dataset(tmp_path, "words", texts, tokenizer=_word_tokenizer(tmp_path)))
  config = _config(source="tokenized", paths=str(folder), batch_size=4, loader_threads=2)
  config.model.vocab_size = 512
  assert len(json.loads((folder / "manifest.json").read_text())["splits"]["train"]["shards"]) == 1
  windows = _windows(_stream(folder, "train"), 8)
  row = _first_row_index(config, windows)
  built = pipeline.build_data(config)
  position = row * 8 + 3  # inside that row only
  with open(folder / "train-000000.tokens", "r+b") as f:
    f.seek(2 * position)
    f.write(np.asarray([65535], "<u2").tobytes())
  batch, error = _next_or_error(built.train)
  assert batch is None and isinstance(error, DataError), error
  assert str(error) == (f"corrupt record in {folder / 'train-000000.tokens'} at token {position:,}: token id 65535 "
                        "is outside the manifest's vocabulary of 300")


def test_a_shard_truncated_mid_run(tmp_path):
  folder = _byte_dataset(tmp_path)
  config = _config(source="tokenized", paths=str(folder), batch_size=4, loader_threads=2)
  windows = _windows(_stream(folder, "train"), 8)
  row = _first_row_index(config, windows)
  built = pipeline.build_data(config)
  tokens = folder / "train-000000.tokens"
  size = row * 8 + 2
  with open(tokens, "r+b") as f:
    f.truncate(size)
  batch, error = _next_or_error(built.train)
  assert batch is None and isinstance(error, DataError), error
  assert str(error) == (f"{tokens}: reading 9 tokens at token {row * 8:,} returned 2; the shard was truncated after "
                        "the run started")
