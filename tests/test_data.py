"""Data pipeline: tokenizers, sources, packing, determinism, resumption, process sharding, errors."""

import json
import pathlib

import numpy as np
import pytest

from meshmoe.config import Config, ConfigError, DataConfig
from meshmoe.data import documents, pipeline, tokenizers


def _config(**data_fields) -> Config:
  config = Config()
  config.train.seq_len, config.train.global_batch_size, config.train.eval_batches = 8, 2, 1
  for name, value in data_fields.items():
    setattr(config.data, name, value)
  return config


def _write(tmp_path, name: str, text: str) -> str:
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def _rows_of(batches) -> list[list[int]]:
  return [row.tolist() for batch in batches for row in batch["inputs"]]


def test_byte_tokenizer_round_trip():
  tokenizer = tokenizers.ByteTokenizer()
  text = "def f(x):\n  return 'naïve — ok'\n"
  ids = tokenizer.encode(text)
  assert ids.dtype == np.int32 and ids.max() < 256 and 0 not in ids
  assert tokenizer.decode(ids) == text
  assert tokenizer.decode([0, *ids, 0]) == text  # the document separator is dropped


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
  assert loaded.decode(ids) == "the cat sat"
  with pytest.raises(ConfigError) as err:
    tokenizers.load_tokenizer(DataConfig(tokenizer=path), vocab_size=8)
  assert err.value.field == "model.vocab_size" and f"at least {loaded.vocab_size}" in str(err.value)
  with pytest.raises(ConfigError) as err:
    tokenizers.load_tokenizer(DataConfig(tokenizer=str(tmp_path / "missing.json")), vocab_size=256)
  assert err.value.field == "data.tokenizer"


def test_packed_rows_are_consecutive_windows(tmp_path):
  docs = ["abcdefghij", "klmnopq", "rstuvwxyz01234"]  # 33 tokens with separators: 4 rows of 8 + 1
  paths = ",".join(_write(tmp_path, f"{i}.txt", d) for i, d in enumerate(docs))
  config = _config(source="text", paths=paths, eval_paths=_write(tmp_path, "eval.txt", "held out text"))
  built = pipeline.build_data(config)
  stream = np.frombuffer("\0".join(docs).encode(), np.uint8).astype(np.int32)
  s = config.train.seq_len
  windows = [stream[i * s:i * s + s + 1] for i in range((len(stream) - 1) // s)]
  assert len(windows) == 4
  epoch = _rows_of([next(built.train) for _ in range(len(windows) // 2)])
  assert sorted(epoch) == sorted(w[:-1].tolist() for w in windows)
  batch = next(pipeline.build_data(config).train)
  np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
  assert batch["mask"].min() == 1.0


def test_unpacked_rows_pad_and_mask(tmp_path):
  config = _config(source="text", paths=_write(tmp_path, "a.txt", "abcdefghijkl") + "," +
                   _write(tmp_path, "b.txt", "xyz"), eval_paths=_write(tmp_path, "e.txt", "eval"),
                   packing=False)
  built = pipeline.build_data(config)
  rows = {}
  for _ in range(2):  # 3 rows: "abcdefghi", "ijkl" (windows overlap by one token), "xyz"; 2 per batch
    batch = next(built.train)
    for inputs, targets, mask in zip(batch["inputs"], batch["targets"], batch["mask"], strict=True):
      rows[bytes(inputs[inputs > 0].astype(np.uint8)).decode()] = (targets.tolist(), mask.tolist())
  assert set(rows) == {"abcdefgh", "ijkl", "xyz"}  # inputs; the last input of a short row has no target
  assert rows["ijkl"][1] == [1, 1, 1] + [0] * 5
  targets, mask = rows["xyz"]
  assert mask == [1, 1] + [0] * 6
  assert targets[:2] == [ord("y"), ord("z")]


def test_jsonl_and_arrayrecord_sources(tmp_path):
  from array_record.python import array_record_module

  lines = [json.dumps({"text": f"document number {i} " * 3}) for i in range(6)]
  jsonl = _write(tmp_path, "docs.jsonl", "\n".join(lines) + "\n\n")
  built = pipeline.build_data(_config(source="jsonl", paths=jsonl, eval_fraction=0.3))
  assert built.train_tokens > 0 and built.eval_tokens > 0  # one file: its last documents are held out

  record_path = str(tmp_path / "docs.array_record")
  writer = array_record_module.ArrayRecordWriter(record_path, "group_size:1")
  for i in range(5):
    writer.write(f"record {i} with some text in it".encode())
  writer.close()
  built = pipeline.build_data(_config(source="arrayrecord", paths=record_path, eval_fraction=0.2))
  text = built.tokenizer.decode(next(built.train)["inputs"].reshape(-1))
  assert "record" in text


@pytest.mark.parametrize("contents, message", [
    ('{"text": "ok"}\nnot json\n', "line 2: not valid JSON"),
    ('{"text": "ok"}\n{"body": "no text"}\n', "line 2: needs a string field 'text'"),
])
def test_malformed_jsonl(tmp_path, contents, message):
  with pytest.raises(documents.DataError, match=message):
    pipeline.build_data(_config(source="jsonl", paths=_write(tmp_path, "bad.jsonl", contents)))


def test_missing_empty_and_too_small_data(tmp_path):
  with pytest.raises(documents.DataError, match=r"data.paths: '.*nothing\*.txt' matches no file"):
    pipeline.build_data(_config(source="text", paths=str(tmp_path / "nothing*.txt")))
  with pytest.raises(documents.DataError, match="names directories only"):
    pipeline.build_data(_config(source="text", paths=str(tmp_path)))
  empty = _write(tmp_path, "empty.txt", "")
  with pytest.raises(documents.DataError, match="cannot hold out eval data"):
    pipeline.build_data(_config(source="text", paths=empty))
  with pytest.raises(documents.DataError, match="the train data holds no text"):
    pipeline.build_data(_config(source="text", paths=empty, eval_paths=_write(tmp_path, "e.txt", "some eval text")))
  small = _write(tmp_path, "small.txt", "tiny")
  with pytest.raises(documents.DataError, match=r"it needs at least 2 row\(s\) of seq_len \+ 1 = 9 tokens"):
    pipeline.build_data(_config(source="text", paths=small, eval_paths=_write(tmp_path, "e2.txt", "eval")))
  with pytest.raises(documents.DataError, match="cannot read"):
    pipeline.build_data(_config(source="arrayrecord", paths=_write(tmp_path, "x.array_record", "not a record")))


@pytest.fixture(scope="module")
def stdlib_config() -> Config:
  config = Config()
  config.train.seq_len, config.train.global_batch_size = 32, 4
  return config


def test_stdlib_corpus_split_and_entropy(stdlib_config):
  train, evaluation = documents.train_and_eval(stdlib_config.data)
  assert len(train) > 100 and len(evaluation) > 5
  fraction = len(evaluation) / (len(train) + len(evaluation))
  assert 0.02 < fraction < 0.1, fraction  # eval_fraction 0.05 of the files, by name hash
  built = pipeline.build_data(stdlib_config)
  assert 2.5 < built.unigram_entropy_nats < 4.5


def test_iterator_determinism_and_resumption(stdlib_config):
  first = pipeline.build_data(stdlib_config)
  second = pipeline.build_data(stdlib_config)
  batches = [next(first.train) for _ in range(5)]
  assert _rows_of(batches) == _rows_of([next(second.train) for _ in range(5)])

  state = json.loads(json.dumps(first.train.get_state()))  # as a checkpoint stores it
  expected = [next(first.train) for _ in range(3)]
  resumed = pipeline.build_data(stdlib_config)
  resumed.train.set_state(state)
  assert _rows_of([next(resumed.train) for _ in range(3)]) == _rows_of(expected)

  other_seed = Config()
  other_seed.train.seq_len, other_seed.train.global_batch_size, other_seed.train.seed = 32, 4, 1
  assert _rows_of([next(pipeline.build_data(other_seed).train)]) != _rows_of(batches[:1])


def test_epochs_reshuffle(tmp_path):
  docs = ",".join(_write(tmp_path, f"{i}.txt", f"document {i} " * 4) for i in range(4))
  config = _config(source="text", paths=docs, eval_paths=_write(tmp_path, "e.txt", "eval text"))
  built = pipeline.build_data(config)
  rows_per_epoch = (built.train_tokens - 1) // config.train.seq_len
  assert rows_per_epoch == 22  # 4 x 44 bytes + 3 separators: an even number, so batches end with the epoch
  epochs = [_rows_of([next(built.train) for _ in range(rows_per_epoch // 2)]) for _ in range(2)]
  assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]


def test_processes_load_their_block_of_each_batch(stdlib_config):
  whole = pipeline.build_data(stdlib_config)
  blocks = [pipeline.build_data(stdlib_config, rows) for rows in (range(0, 1), range(1, 3), range(3, 4))]
  for _ in range(3):  # every global batch, in order: the blocks put together are the one-process batch
    single = next(whole.train)
    parts = [next(block.train) for block in blocks]
    assert [p["inputs"].shape for p in parts] == [(1, 32), (2, 32), (1, 32)]
    for name in ("inputs", "targets", "mask"):
      np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), single[name])
  np.testing.assert_array_equal(np.concatenate([b.eval_batches[0]["inputs"] for b in blocks]),
                                whole.eval_batches[0]["inputs"])
  assert blocks[1].train.get_state() == whole.train.get_state()  # counts global batches: any process count
  with pytest.raises(ValueError, match="a contiguous block of the 4 rows"):
    pipeline.build_data(stdlib_config, range(2, 6))


def test_eval_batches_are_fixed(stdlib_config):
  a, b = pipeline.build_data(stdlib_config), pipeline.build_data(stdlib_config)
  assert len(a.eval_batches) == stdlib_config.train.eval_batches
  assert _rows_of(a.eval_batches) == _rows_of(b.eval_batches)


def test_unigram_entropy_matches_numpy(tmp_path):
  text = "aab" * 40
  config = _config(source="text", paths=_write(tmp_path, "t.txt", text),
                   eval_paths=_write(tmp_path, "e.txt", "some eval text"))
  probabilities = np.array([2 / 3, 1 / 3])
  np.testing.assert_allclose(pipeline.build_data(config).unigram_entropy_nats,
                             -np.sum(probabilities * np.log(probabilities)), rtol=1e-12)


def test_a_single_file_is_split_by_documents_whatever_its_name(tmp_path):
  # With eval_fraction 0.3, about 3 in 10 names hash into the held-out set; a single file must still
  # leave documents on both sides, and the split must not depend on the folder the file is in.
  lines = "\n".join(json.dumps({"text": f"document {i}"}) for i in range(10))
  splits = set()
  for i in range(20):
    folder = tmp_path / f"copy{i}"
    folder.mkdir()
    path = _write(folder, f"corpus{i}.jsonl", lines)
    train, evaluation = documents.train_and_eval(DataConfig(source="jsonl", paths=path, eval_fraction=0.3))
    assert len(train) == 7 and len(evaluation) == 3
    splits.add((tuple(train), tuple(evaluation)))
  assert len(splits) == 1
  two = [_write(tmp_path, f"part{i}.jsonl", lines) for i in range(2)]
  for folder in ("a", "b"):  # the same two files in two places split the same way
    (tmp_path / folder).mkdir()
    moved = [_write(tmp_path / folder, pathlib.Path(p).name, lines) for p in two]
    assert documents.train_and_eval(DataConfig(source="jsonl", paths=",".join(moved), eval_fraction=0.3)) == \
        documents.train_and_eval(DataConfig(source="jsonl", paths=",".join(two), eval_fraction=0.3))
