"""Data pipeline: tokenizers, sources, the token store, packing, the default corpus, loader threads (epochs,
resumption and mixtures: test_data_mixtures.py; bad data: test_data_errors.py).

Every expectation is computed here from the documents themselves (bytes + EOS, numpy windows, CRC-32 split),
or read from the shards with numpy, not through the pipeline's own readers."""

import json
import pathlib
import threading
import zlib

import numpy as np
import pytest

from meshmoe.config import Config, ConfigError, DataConfig
from meshmoe.data import pipeline, tokenizers, tokenizing
from meshmoe.data import rows as rows_lib
from meshmoe.data.token_store import DataError


def _quiet(_):
  pass


def _config(seq_len: int = 8, batch_size: int = 2, **data_fields) -> Config:
  config = Config()
  config.train.seq_len, config.train.global_batch_size, config.train.eval_batches = seq_len, batch_size, 1
  for name, value in data_fields.items():
    setattr(config.data, name, value)
  return config


def _write(tmp_path, name: str, text: str) -> str:
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def _byte_doc(text: str) -> list[int]:
  """A document as the byte tokenizer stores it: its UTF-8 bytes, then EOS (0)."""
  return [*text.encode(), 0]


def _windows(stream, seq_len: int) -> list[tuple]:
  """The packed rows of a token stream: windows of seq_len + 1 tokens at stride seq_len."""
  return [tuple(int(t) for t in stream[i * seq_len:i * seq_len + seq_len + 1])
          for i in range((len(stream) - 1) // seq_len)]


def _rows_of(batches) -> list[tuple]:
  """Each row of packed batches as its seq_len + 1 tokens (the inputs and the last target)."""
  return [tuple(row.tolist()) for batch in batches
          for row in np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)]


def _split_texts(texts: list[str], eval_fraction: float) -> tuple[list[str], list[str]]:
  """(train, eval) documents of one unit of text: held out by CRC-32 of the text, or, when none hashes
  below the fraction, its last documents."""
  texts = [t for t in texts if t]
  held = [zlib.crc32(t.encode()) % 100_000 < eval_fraction * 100_000 for t in texts]
  if not any(held):
    count = min(max(1, int(len(texts) * eval_fraction)), len(texts) - 1)
    held = [i >= len(texts) - count for i in range(len(texts))]
  return [t for t, h in zip(texts, held) if not h], [t for t, h in zip(texts, held) if h]


def _stored_documents(folder, split: str) -> list[list[int]]:
  """The documents of a split of a dataset folder, read with numpy from its manifest and shards."""
  folder = pathlib.Path(folder)
  manifest = json.loads((folder / "manifest.json").read_text())
  docs = []
  for shard in manifest["splits"][split]["shards"]:
    tokens = np.fromfile(folder / shard["tokens"], np.dtype(manifest["dtype"]).newbyteorder("<"))
    offsets = np.load(folder / shard["index"])
    docs += [tokens[a:b].astype(np.int64).tolist() for a, b in zip(offsets[:-1], offsets[1:])]
  return docs


def _stream(folder, split: str) -> np.ndarray:
  return np.asarray([t for doc in _stored_documents(folder, split) for t in doc], np.int64)


def _jsonl_dataset(tmp_path, name: str, texts: list[str], **kwargs) -> str:
  """`texts` tokenized (as one JSONL file) into the dataset folder tmp_path/name."""
  source = tmp_path / f"{name}.jsonl"
  source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  kwargs = {"eval_fraction": 0.2, "log": _quiet} | kwargs
  tokenizing.tokenize_corpus(tmp_path / name, source="jsonl", paths=str(source), **kwargs)
  return str(tmp_path / name)


def _letters(seed: int, letters: str, count: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return ["".join(rng.choice(list(letters), int(rng.integers(4, 30)))) for _ in range(count)]


def _word_tokenizer(tmp_path, size: int = 300) -> str:
  """A Hugging Face word-level tokenizer of `size` tokens: <unk> 0, </s> 1, "w0" 2, "w1" 3, ..."""
  from tokenizers import Tokenizer, models, pre_tokenizers

  vocab = {"<unk>": 0, "</s>": 1} | {f"w{i}": i + 2 for i in range(size - 2)}
  tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  path = tmp_path / "words.json"
  tokenizer.save(str(path))
  return str(path)


def _words(seed: int, count: int, size: int = 300) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(f"w{i}" for i in rng.integers(0, size - 2, int(rng.integers(3, 20)))) for _ in range(count)]


def _word_ids(text: str) -> list[int]:
  """A document as _word_tokenizer stores it: "wN" is N + 2, then </s> (1)."""
  return [int(w[1:]) + 2 for w in text.split()] + [1]


def _next_or_error(iterator, seconds: float = 60):
  """next(iterator) in a thread: its batch, or the exception it raised; fails if it hangs."""
  result = {}

  def run():
    try:
      result["batch"] = next(iterator)
    except Exception as e:  # handed to the test
      result["error"] = e

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(seconds)
  assert not thread.is_alive(), f"next() did not return within {seconds}s"
  return result.get("batch"), result.get("error")


# Tokenizers.


def test_byte_tokenizer_round_trip():
  tokenizer = tokenizers.ByteTokenizer()
  text = "def f(x):\n  return 'naïve — ok'\n"
  ids = tokenizer.encode(text)
  assert ids.dtype == np.int32 and ids.tolist() == list(text.encode()) and 0 not in ids
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode([0, *ids, 0]) == text  # the end-of-document token is dropped
  assert (tokenizer.vocab_size, tokenizer.eos_id) == (256, 0)


def test_hugging_face_tokenizer(tmp_path):
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"])
  tokenizer.train_from_iterator(["the cat sat on the mat"] * 50 + ["a dog ran to the cat"] * 50, trainer)
  path = str(tmp_path / "tokenizer.json")
  tokenizer.save(path)

  loaded = tokenizers.load_tokenizer(DataConfig(tokenizer=path), vocab_size=256)
  assert loaded.eos_id == tokenizer.token_to_id("</s>")
  ids = loaded.encode("the cat sat")
  assert ids.tolist() == tokenizer.encode("the cat sat").ids
  assert loaded.decode(ids) == "the cat sat"
  with pytest.raises(ConfigError) as err:
    tokenizers.load_tokenizer(DataConfig(tokenizer=path), vocab_size=8)
  assert err.value.field == "model.vocab_size" and f"at least {loaded.vocab_size}" in str(err.value)
  with pytest.raises(ConfigError) as err:
    tokenizers.load_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing.json")), vocab_size=256)
  assert err.value.field == "data.tokenizer"


def test_hugging_face_dataset_is_uint16_with_eos(tmp_path):
  texts = _words(0, 30)
  folder = _jsonl_dataset(tmp_path, "words", texts, tokenizer=_word_tokenizer(tmp_path))
  manifest = json.loads((pathlib.Path(folder) / "manifest.json").read_text())
  assert manifest["dtype"] == "uint16"
  assert (manifest["tokenizer"]["vocab_size"], manifest["tokenizer"]["eos_id"]) == (300, 1)
  train, evaluation = _split_texts(texts, 0.2)
  assert _stored_documents(folder, "train") == [_word_ids(t) for t in train]
  assert _stored_documents(folder, "eval") == [_word_ids(t) for t in evaluation]
  assert (pathlib.Path(folder) / "tokenizer.json").read_bytes() == (tmp_path / "words.json").read_bytes()


# Rows.


def test_packed_rows_are_consecutive_windows(tmp_path):
  docs = ["abcdefghij", "klmnopq", "rstuvwxyz01234"]  # 34 tokens with their EOS: 4 rows of 8 + 1
  paths = ",".join(_write(tmp_path, f"{i}.txt", d) for i, d in enumerate(docs))
  config = _config(source="text", paths=paths, eval_paths=_write(tmp_path, "eval.txt", "held out text"),
                   batch_size=4)
  built = pipeline.build_data(config)
  stream = [t for d in docs for t in _byte_doc(d)]
  windows = _windows(stream, config.train.seq_len)
  assert len(windows) == 4 and windows[-1][-1] == ord("4")
  assert built.train_tokens == len(stream) and built.eval_tokens == len(_byte_doc("held out text"))
  batch = next(built.train)
  assert sorted(_rows_of([batch])) == windows  # one batch is the whole epoch
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
  assert batch["mask"].dtype == np.float32 and batch["mask"].min() == 1.0
  assert set(batch) == {"inputs", "targets", "mask"}
  assert built.train.source_token_counts() == {"text": 4 * 8}
  assert _rows_of(built.eval_batches["text"]) == _windows(_byte_doc("held out text"), 8) * 4  # wraps around


def test_packed_rows_cross_shards(tmp_path):
  texts = _letters(1, "abcdefghijklm", 30)
  folder = _jsonl_dataset(tmp_path, "a", texts, unit_bytes=40)  # shards of a few documents
  assert len(json.loads((pathlib.Path(folder) / "manifest.json").read_text())["splits"]["train"]["shards"]) > 5
  train, _ = _split_texts(texts, 0.2)
  stream = [t for text in train for t in _byte_doc(text)]
  np.testing.assert_array_equal(_stream(folder, "train"), stream)
  windows = _windows(stream, 8)
  config = _config(source="tokenized", paths=folder, batch_size=len(windows))
  assert sorted(_rows_of([next(pipeline.build_data(config).train)])) == sorted(windows)


def test_unpacked_rows_pad_and_mask(tmp_path):
  texts = ["abcdefghijkl", "xyz", "a" * 16, "q", "0123456789abcdefghijklmnop"]
  config = _config(source="text", paths=",".join(_write(tmp_path, f"{i}.txt", t) for i, t in enumerate(texts)),
                   eval_paths=_write(tmp_path, "e.txt", "eval"), packing=False)
  s = config.train.seq_len
  expected = []  # each document + EOS cut into windows of at most s + 1 tokens, overlapping by one
  for text in texts:
    doc = _byte_doc(text)
    for start in range(0, len(doc) - 1, s):
      window = doc[start:start + s + 1]
      pad = [0] * (s + 1 - len(window))
      expected.append((tuple(window[:-1] + pad), tuple(window[1:] + pad), tuple([1.0] * (len(window) - 1) +
                                                                                 [0.0] * len(pad))))
  assert len(expected) == 2 + 1 + 2 + 1 + 4
  config.train.global_batch_size = len(expected)
  built = pipeline.build_data(config)
  batch = next(built.train)
  rows = [(tuple(i.tolist()), tuple(t.tolist()), tuple(m.tolist()))
          for i, t, m in zip(batch["inputs"], batch["targets"], batch["mask"], strict=True)]
  assert sorted(rows) == sorted(expected)
  assert built.train.source_token_counts() == {"text": int(batch["mask"].sum())} == {"text": sum(
      len(t) for t in texts)}  # every token of a document is a target once: its successor, or the EOS
  eval_rows = [tuple(r.tolist()) for r in built.eval_batches["text"][0]["inputs"]]
  assert eval_rows == [tuple(b"eval") + (0,) * 4] * len(expected)


# Sources.


def test_jsonl_and_arrayrecord_sources(tmp_path):
  from array_record.python import array_record_module

  texts = [f"document number {i} " * 3 for i in range(6)]
  jsonl = _write(tmp_path, "docs.jsonl", "\n".join(json.dumps({"text": t}) for t in texts) + "\n\n")
  config = _config(source="jsonl", paths=jsonl, eval_fraction=0.3)
  built = pipeline.build_data(config)
  folder = tokenizing.cached_dataset(config.data, _quiet)
  train, evaluation = _split_texts(texts, 0.3)
  assert len(train) >= 1 and len(evaluation) >= 1
  assert _stored_documents(folder, "train") == [_byte_doc(t) for t in train]
  assert _stored_documents(folder, "eval") == [_byte_doc(t) for t in evaluation]
  assert (built.train_tokens, built.eval_tokens) == (sum(len(_byte_doc(t)) for t in train),
                                                     sum(len(_byte_doc(t)) for t in evaluation))

  records = [f"record {i} with some text in it" for i in range(12)]
  record_path = str(tmp_path / "docs.array_record")
  writer = array_record_module.ArrayRecordWriter(record_path, "group_size:1")
  for record in records:
    writer.write(record.encode())
  writer.close()
  config = _config(source="arrayrecord", paths=record_path, eval_fraction=0.2)
  built = pipeline.build_data(config)
  folder = tokenizing.cached_dataset(config.data, _quiet)
  train, evaluation = _split_texts(records, 0.2)
  assert _stored_documents(folder, "train") == [_byte_doc(t) for t in train]
  assert _stored_documents(folder, "eval") == [_byte_doc(t) for t in evaluation]
  stream = [t for text in train for t in _byte_doc(text)]
  assert set(_rows_of([next(built.train)])) <= set(_windows(stream, 8))

  out = tmp_path / "ar-units"  # several units of records: the same documents
  tokenizing.tokenize_corpus(out, source="arrayrecord", paths=record_path, eval_fraction=0.2, unit_bytes=20,
                             log=_quiet)
  assert len(json.loads((out / "manifest.json").read_text())["splits"]["train"]["shards"]) > 2
  assert sorted(_stored_documents(out, "train") + _stored_documents(out, "eval")) == sorted(
      _byte_doc(r) for r in records)


def test_parquet_source(tmp_path):
  import pyarrow as pa
  import pyarrow.parquet as pq

  texts = [f"parquet row {i}: " + "xyz" * (i % 5) for i in range(40)]
  texts[7] = ""  # empty documents are skipped
  path = tmp_path / "docs.parquet"
  pq.write_table(pa.table({"text": texts, "other": list(range(40))}), path, row_group_size=4)
  out = tmp_path / "parquet"
  tokenizing.tokenize_corpus(out, source="parquet", paths=str(path), eval_fraction=0.3, unit_bytes=1,
                             log=_quiet)
  manifest = json.loads((out / "manifest.json").read_text())
  assert len(manifest["splits"]["train"]["shards"]) == 10  # one unit (and shard) per row group
  train, evaluation = _split_texts(texts, 0.3)
  assert len(evaluation) >= 1  # held out by hash, so any cut into units gives the same split
  assert _stored_documents(out, "train") == [_byte_doc(t) for t in train]
  assert _stored_documents(out, "eval") == [_byte_doc(t) for t in evaluation]

  config = _config(source="parquet", paths=str(path), eval_fraction=0.3)  # the cache: one unit, same split
  pipeline.build_data(config)
  cached = tokenizing.cached_dataset(config.data, _quiet)
  assert _stored_documents(cached, "train") == _stored_documents(out, "train")

  pq.write_table(pa.table({"body": ["no text column"]}), tmp_path / "bad.parquet")
  with pytest.raises(DataError, match=r"bad.parquet: Parquet sources need a string column 'text'"):
    pipeline.build_data(_config(source="parquet", paths=str(tmp_path / "bad.parquet")))


def test_the_split_is_by_document_text_not_by_file(tmp_path):
  texts = [f"document {i}" for i in range(40)]
  train, evaluation = _split_texts(texts, 0.3)
  assert 5 < len(evaluation) < 20
  layouts = {"one": [texts], "two": [texts[:15], texts[15:]], "renamed": [texts]}
  for name, files in layouts.items():
    folder = tmp_path / name
    folder.mkdir()
    paths = [_write(folder, f"{name}{i}.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in part))
             for i, part in enumerate(files)]
    tokenizing.tokenize_corpus(folder / "out", source="jsonl", paths=",".join(paths), eval_fraction=0.3,
                               log=_quiet)
    assert _stored_documents(folder / "out", "train") == [_byte_doc(t) for t in train], name
    assert _stored_documents(folder / "out", "eval") == [_byte_doc(t) for t in evaluation], name


def test_a_tiny_corpus_holds_out_its_last_documents(tmp_path):
  texts = [t for t in (f"tail document {i}" for i in range(40)) if zlib.crc32(t.encode()) % 100_000 >= 30_000][:10]
  assert len(texts) == 10  # none hashes below the fraction
  paths = _write(tmp_path, "tiny.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts))
  config = _config(source="jsonl", paths=paths, eval_fraction=0.3)
  built = pipeline.build_data(config)
  folder = tokenizing.cached_dataset(config.data, _quiet)
  assert _stored_documents(folder, "train") == [_byte_doc(t) for t in texts[:7]]
  assert _stored_documents(folder, "eval") == [_byte_doc(t) for t in texts[7:]]
  assert built.eval_tokens == sum(len(_byte_doc(t)) for t in texts[7:])
  config.data.eval_fraction = 0.6  # another split of the same file: another cache folder
  pipeline.build_data(config)
  other = tokenizing.cached_dataset(config.data, _quiet)
  train, evaluation = _split_texts(texts, 0.6)
  assert other != folder and len(evaluation) >= 1
  assert _stored_documents(other, "train") == [_byte_doc(t) for t in train]
  assert _stored_documents(other, "eval") == [_byte_doc(t) for t in evaluation]


@pytest.mark.parametrize("contents, message", [
    ('{"text": "ok"}\nnot json\n', "line 2: not valid JSON"),
    ('{"text": "ok"}\n{"body": "no text"}\n', "line 2: needs a string field 'text'"),
    ('{"text": "ok"}\n\n["text"]\n', "line 3: needs a string field 'text'"),
])
def test_malformed_jsonl(tmp_path, contents, message):
  with pytest.raises(DataError, match=f"bad.jsonl {message}"):
    pipeline.build_data(_config(source="jsonl", paths=_write(tmp_path, "bad.jsonl", contents)))


def test_malformed_jsonl_in_a_later_unit_names_the_files_line(tmp_path):
  lines = [json.dumps({"text": f"good line {i}"}) for i in range(30)] + [""] + ['{"text": broken}']
  lines += [json.dumps({"text": "after"})]
  path = _write(tmp_path, "bad.jsonl", "\n".join(lines) + "\n")
  with pytest.raises(DataError) as err:
    tokenizing.tokenize_corpus(tmp_path / "out", source="jsonl", paths=path, unit_bytes=50, log=_quiet)
  assert str(err.value).startswith(f"{path} line 32: not valid JSON")
  assert len(list((tmp_path / "out" / "progress").glob("unit-*.json"))) > 3  # units before it finished


def test_missing_empty_and_too_small_data(tmp_path):
  with pytest.raises(DataError, match=r"paths: '.*nothing\*.txt' matches no file"):
    pipeline.build_data(_config(source="text", paths=str(tmp_path / "nothing*.txt")))
  (tmp_path / "sub").mkdir()
  with pytest.raises(DataError, match="names directories only"):
    pipeline.build_data(_config(source="text", paths=str(tmp_path / "sub")))
  empty = _write(tmp_path, "empty.txt", "")
  with pytest.raises(DataError, match=r"the source holds no training text \(1 file\(s\), all empty"):
    pipeline.build_data(_config(source="text", paths=empty))
  with pytest.raises(DataError, match="the source holds no training text"):
    pipeline.build_data(_config(source="text", paths=empty, eval_paths=_write(tmp_path, "e.txt", "some eval text")))
  empty_jsonl = _write(tmp_path, "empty.jsonl", json.dumps({"text": ""}) + "\n" + json.dumps({"text": ""}) + "\n")
  with pytest.raises(DataError, match=r"the source holds no training text \(1 file\(s\)"):
    pipeline.build_data(_config(source="jsonl", paths=empty_jsonl))
  with pytest.raises(DataError, match="no document was held out for eval"):
    pipeline.build_data(_config(source="text", paths=_write(tmp_path, "one.txt", "a single document")))
  small = _write(tmp_path, "small.txt", "tiny")
  with pytest.raises(DataError, match=r"the train split of dataset 'text' \(.*\) holds 5 tokens in 1 document\(s\): "
                     r"not one row of seq_len \+ 1 = 9 tokens"):
    pipeline.build_data(_config(source="text", paths=small, eval_paths=_write(tmp_path, "e2.txt", "eval")))
  with pytest.raises(DataError, match=r"the eval split of dataset 'text' \(.*\) holds 2 tokens"):
    pipeline.build_data(_config(source="text", paths=_write(tmp_path, "big.txt", "long enough text"),
                                eval_paths=_write(tmp_path, "e3.txt", "e")))
  with pytest.raises(DataError, match="cannot read .*x.array_record as ArrayRecord"):
    pipeline.build_data(_config(source="arrayrecord", paths=_write(tmp_path, "x.array_record", "not a record")))


# The default: the standard library, through the cache.


def test_stdlib_default_through_the_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("MESHMOE_CACHE", str(tmp_path))
  config = Config()
  config.train.seq_len, config.train.global_batch_size, config.train.eval_batches = 32, 4, 1
  logs = []
  built = pipeline.build_data(config, log=logs.append)
  assert any("into the cache" in line for line in logs)
  (folder,) = (tmp_path / "tokenized").iterdir()
  manifest = json.loads((folder / "manifest.json").read_text())
  batch = next(built.train)
  assert batch["inputs"].shape == (4, 32) and batch["mask"].min() == 1.0
  assert built.sources == ["stdlib"] and len(built.eval_batches["stdlib"]) == 1

  texts = [p.read_bytes().decode("utf-8", errors="replace") for p in tokenizing.documents.stdlib_files()]
  texts = [t for t in texts if t]
  held = sum(zlib.crc32(t.encode("utf-8", errors="replace")) % 100_000 < 5_000 for t in texts)
  assert (manifest["splits"]["eval"]["num_documents"], manifest["splits"]["train"]["num_documents"]) == (
      held, len(texts) - held)
  assert 0.02 < held / len(texts) < 0.1
  tokens = np.concatenate([np.fromfile(folder / s["tokens"], np.uint8)
                           for s in manifest["splits"]["train"]["shards"]])
  p = np.bincount(tokens, minlength=256) / len(tokens)
  p = p[p > 0]
  np.testing.assert_allclose(built.unigram_entropy_nats, -np.sum(p * np.log(p)), rtol=1e-12)
  assert built.train_tokens == len(tokens)

  mtime = (folder / "manifest.json").stat().st_mtime_ns

  def no_tokenizing(*args, **kwargs):
    raise AssertionError("the second build tokenized again")

  monkeypatch.setattr(tokenizing, "tokenize_corpus", no_tokenizing)
  logs.clear()
  again = pipeline.build_data(config, log=logs.append)
  assert logs == [] and list((tmp_path / "tokenized").iterdir()) == [folder]
  assert (folder / "manifest.json").stat().st_mtime_ns == mtime
  assert _rows_of([next(again.train)]) == _rows_of([batch])


@pytest.mark.parametrize("threads", [0, 2])
def test_loader_threads_zero_reads_in_the_train_loop(monkeypatch, threads):
  # grain's default read options (16 threads, 500 batches ahead) must never stand in for 0.
  readers, read = set(), rows_lib.PackedRows.read

  def recording_read(self, row, out):
    readers.add(threading.current_thread().name)
    return read(self, row, out)

  monkeypatch.setattr(rows_lib.PackedRows, "read", recording_read)
  built = pipeline.build_data(_config(seq_len=32, batch_size=4, loader_threads=threads), log=_quiet)
  readers.clear()  # the eval batches are read in this thread while building
  for _ in range(3):
    next(built.train)
  if threads:
    assert readers and threading.current_thread().name not in readers
  else:
    assert readers == {threading.current_thread().name}
