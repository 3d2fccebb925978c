"""Data pipeline over tokenized datasets: epochs, determinism and resumption, each process's block of a
batch, mixtures of datasets and their unigram entropy.

As in test_data.py (whose helpers these tests share), every expectation is computed from the documents
themselves or read from the shards with numpy, not through the pipeline's own readers."""

import json

import numpy as np
import pytest

from meshmoe.config import ConfigError, mixture_entries
from meshmoe.data import pipeline
from meshmoe.data.mixture import Mixture
from tests.test_data import _byte_doc, _config, _jsonl_dataset, _letters, _rows_of, _split_texts, _windows, _write


# Order: epochs, determinism, resumption, processes.


@pytest.fixture(scope="module")
def letters(tmp_path_factory) -> dict[str, tuple[str, list[str], list[str]]]:
  """Two small multi-shard datasets told apart by their letters: name -> (folder, train texts, eval texts)."""
  root = tmp_path_factory.mktemp("letters")
  out = {}
  for name, seed, alphabet, count in (("a", 2, "abcdefghijklm", 24), ("b", 3, "nopqrstuvwxyz", 16)):
    texts = _letters(seed, alphabet, count)
    train, evaluation = _split_texts(texts, 0.2)
    assert evaluation and len(evaluation) < len(texts)
    out[name] = (_jsonl_dataset(root, name, texts, unit_bytes=100), train, evaluation)
  return out


def _train_windows(letters, name: str, seq_len: int = 8) -> list[tuple]:
  return _windows([t for text in letters[name][1] for t in _byte_doc(text)], seq_len)


def _eval_windows(letters, name: str, seq_len: int = 8) -> list[tuple]:
  return _windows([t for text in letters[name][2] for t in _byte_doc(text)], seq_len)


def test_epochs_reshuffle(letters):
  windows = _train_windows(letters, "a")
  n = len(windows)
  config = _config(source="tokenized", paths=letters["a"][0], batch_size=3)
  built = pipeline.build_data(config)
  assert n % 3 and built.train_tokens == sum(len(_byte_doc(t)) for t in letters["a"][1])
  rows = _rows_of([next(built.train) for _ in range(n + 1)])  # batches straddle the epochs
  epochs = [rows[e * n:(e + 1) * n] for e in range(3)]
  for epoch in epochs:
    assert sorted(epoch) == sorted(windows)  # every row once per epoch
  assert epochs[0] != epochs[1] and epochs[1] != epochs[2] and epochs[0] != epochs[2]
  assert epochs[0] != sorted(windows)


def test_iterator_determinism_and_resumption(letters):
  config = _config(source="tokenized", paths=letters["a"][0], batch_size=4)
  first, second = pipeline.build_data(config), pipeline.build_data(config)
  batches = [next(first.train) for _ in range(5)]
  assert _rows_of(batches) == _rows_of([next(second.train) for _ in range(5)])
  assert set(_rows_of(batches)) <= set(_train_windows(letters, "a"))

  state = json.loads(json.dumps(first.train.get_state()))  # as a checkpoint stores it
  assert state == {"next_index": 5, "source_tokens": {"a": 5 * 4 * 8}}
  expected = [next(first.train) for _ in range(12)]  # into the second epoch
  resumed = pipeline.build_data(config)
  resumed.train.set_state(state)
  assert resumed.train.source_token_counts() == {"a": 5 * 4 * 8}
  got = [next(resumed.train) for _ in range(12)]
  assert _rows_of(got) == _rows_of(expected)
  for a, b in zip(got, expected):
    for key in ("inputs", "targets", "mask"):
      np.testing.assert_array_equal(a[key], b[key])
  assert resumed.train.get_state() == first.train.get_state() == {"next_index": 17,
                                                                 "source_tokens": {"a": 17 * 4 * 8}}

  config.train.seed = 1
  other_seed = pipeline.build_data(config).train
  other = _rows_of([next(other_seed) for _ in range(10)])  # the first epoch of 40 rows
  assert len(other) == len(_train_windows(letters, "a"))
  assert other != _rows_of(batches + expected[:5]) and sorted(other) == sorted(_train_windows(letters, "a"))


def test_processes_load_their_block_of_each_batch(letters):
  config = _config(source="tokenized", paths=f"a={letters['a'][0]}:0.75,b={letters['b'][0]}:0.25", batch_size=4)
  config.train.eval_batches = 2
  whole = pipeline.build_data(config)
  blocks = [pipeline.build_data(config, rows) for rows in (range(0, 1), range(1, 3), range(3, 4))]
  for _ in range(6):  # every global batch, in order: the blocks put together are the one-process batch
    single = next(whole.train)
    parts = [next(block.train) for block in blocks]
    assert [p["inputs"].shape for p in parts] == [(1, 8), (2, 8), (1, 8)]
    for name in ("inputs", "targets", "mask"):
      np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), single[name])
  for name in ("a", "b"):
    assert [len(b.eval_batches[name]) for b in blocks] == [2, 2, 2]
    for i in range(2):
      for key in ("inputs", "targets", "mask"):
        np.testing.assert_array_equal(np.concatenate([b.eval_batches[name][i][key] for b in blocks]),
                                      whole.eval_batches[name][i][key])
  state = whole.train.get_state()
  assert state["next_index"] == 6 and sum(state["source_tokens"].values()) == 6 * 4 * 8
  assert all(block.train.get_state() == state for block in blocks)  # global counts: any process count
  with pytest.raises(ValueError, match="a contiguous block of the 4 rows"):
    pipeline.build_data(config, range(2, 6))


# Mixtures.


def test_mixture_rows_counts_and_state(letters):
  paths = f"a={letters['a'][0]}:0.75,b={letters['b'][0]}:0.25"
  batch_size, num_batches = 8, 12
  config = _config(source="tokenized", paths=paths, batch_size=batch_size)
  config.train.eval_batches = 3
  built = pipeline.build_data(config)
  assert built.sources == ["a", "b"] and built.weights == [0.75, 0.25]
  windows = {name: _train_windows(letters, name) for name in ("a", "b")}
  assert not set(windows["a"]) & set(windows["b"])
  mixture = Mixture([0.75, 0.25])
  batches, states = [], []
  for _ in range(num_batches):
    states.append(json.loads(json.dumps(built.train.get_state())))
    batches.append(next(built.train))
  rows = _rows_of(batches)
  dataset = [next(name for name in ("a", "b") if row in windows[name]) for row in rows]  # each is a window
  letters_of = {"a": set(b"abcdefghijklm\0"), "b": set(b"nopqrstuvwxyz\0")}
  assert all(set(row) <= letters_of[name] for row, name in zip(rows, dataset))
  for b in range(num_batches):  # per batch, as many rows of each dataset as the mixture's counts say
    expected = mixture.counts([(b + 1) * batch_size])[0] - mixture.counts([b * batch_size])[0]
    got = [dataset[b * batch_size:(b + 1) * batch_size].count(name) for name in ("a", "b")]
    assert got == expected.tolist()
  totals = [dataset.count("a"), dataset.count("b")]
  assert totals == mixture.counts([num_batches * batch_size])[0].tolist() == [72, 24]
  for name in ("a", "b"):  # each dataset's rows: whole shuffled epochs, one after another
    mine, n = [r for r, d in zip(rows, dataset) if d == name], len(windows[name])
    assert len(mine) > n
    assert sorted(mine[:n]) == sorted(windows[name]) and len(set(mine[n:2 * n])) == len(mine[n:2 * n])
  assert built.train.source_token_counts() == {"a": 72 * 8, "b": 24 * 8}

  resumed = pipeline.build_data(config)
  resumed.train.set_state(states[5])
  assert resumed.train.source_token_counts() == {"a": dataset[:40].count("a") * 8, "b": dataset[:40].count("b") * 8}
  assert _rows_of([next(resumed.train) for _ in range(num_batches - 5)]) == rows[5 * batch_size:]
  assert resumed.train.get_state() == built.train.get_state()
  recounted = pipeline.build_data(config)  # a state without the counts (another mixture's): recomputed
  recounted.train.set_state({"next_index": 5})
  assert recounted.train.source_token_counts() == {"a": dataset[:40].count("a") * 8,
                                                   "b": dataset[:40].count("b") * 8}

  assert sorted(built.eval_batches) == ["a", "b"]
  for name in ("a", "b"):  # each dataset's own eval split, in order, wrapping around
    expected = _eval_windows(letters, name)
    assert len(built.eval_batches[name]) == 3
    assert _rows_of(built.eval_batches[name]) == [expected[i % len(expected)] for i in range(3 * batch_size)]
  assert built.eval_tokens == sum(len(_byte_doc(t)) for name in ("a", "b") for t in letters[name][2])
  assert built.train_tokens == sum(len(_byte_doc(t)) for name in ("a", "b") for t in letters[name][1])


def _unigram(texts: list[str]) -> np.ndarray:
  counts = np.bincount(np.asarray([t for text in texts for t in _byte_doc(text)]), minlength=256)
  return counts / counts.sum()


def test_unigram_entropy_of_a_mixture_matches_numpy(letters):
  config = _config(source="tokenized", paths=f"a={letters['a'][0]}:0.75,b={letters['b'][0]}:0.25")
  p = 0.75 * _unigram(letters["a"][1]) + 0.25 * _unigram(letters["b"][1])
  p = p[p > 0]
  np.testing.assert_allclose(pipeline.build_data(config).unigram_entropy_nats, -np.sum(p * np.log(p)), rtol=1e-12)


def test_unigram_entropy_of_one_dataset_matches_numpy(tmp_path):
  config = _config(source="text", paths=_write(tmp_path, "t.txt", "aab" * 40),
                   eval_paths=_write(tmp_path, "e.txt", "some eval text"))
  p = np.array([80, 40, 1]) / 121  # a, b and the one EOS
  np.testing.assert_allclose(pipeline.build_data(config).unigram_entropy_nats, -np.sum(p * np.log(p)), rtol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_mixture_counts_and_select_against_brute_force(seed):
  rng = np.random.default_rng(seed)
  k = int(rng.integers(2, 7))
  weights = rng.dirichlet(np.full(k, 0.5 if seed % 2 else 2.0)).tolist()
  mixture = Mixture(weights)
  n = np.arange(3001)
  counts = mixture.counts(n)
  assert counts.shape == (len(n), k)
  np.testing.assert_array_equal(counts.sum(axis=1), n)
  np.testing.assert_array_equal(counts[0], 0)
  steps = np.diff(counts, axis=0)
  assert steps.min() >= 0 and (steps.sum(axis=1) == 1).all()  # one dataset takes each row
  assert np.abs(counts - n[:, None] * np.asarray(weights)).max() <= 1 + k
  taken, want_dataset, want_index = [0] * k, [], []  # the brute force: walk the rows in order
  for g in range(3000):
    d = int(np.flatnonzero(counts[g + 1] != counts[g])[0])
    want_dataset.append(d)
    want_index.append(taken[d])
    taken[d] += 1
  dataset, index = mixture.select(np.arange(3000))
  assert dataset.tolist() == want_dataset and index.tolist() == want_index
  order = rng.permutation(3000)  # random access: any order, one at a time
  dataset, index = mixture.select(order)
  assert dataset.tolist() == [want_dataset[g] for g in order] and index.tolist() == [want_index[g] for g in order]
  far = rng.integers(0, 2**40, 50)
  dataset, index = mixture.select(far)
  before, after = mixture.counts(far), mixture.counts(far + 1)
  np.testing.assert_array_equal((after - before)[np.arange(50), dataset], 1)
  np.testing.assert_array_equal(index, before[np.arange(50), dataset])


def test_mixture_entries_and_weight_errors():
  assert mixture_entries("a=/x:0.75, b=/y:0.25") == [("a", "/x", 0.75), ("b", "/y", 0.25)]
  assert mixture_entries("/data/tok/web/") == [("web", "/data/tok/web/", 1.0)]
  cases = {
      "a=/x:0.5,b=/y:0.4": "weights that sum to 1; these sum to 0.9",
      "a=/x:-0.25,b=/y:1.25": "positive finite weights; 'a=/x:-0.25' has -0.25",
      "a=/x:0,b=/y:1": "positive finite weights",
      "a=/x:0.75,b=/y": "a weight for every dataset of a mixture",
      "a=/x:0.5,a=/y:0.5": r"distinct dataset names \(name=folder:weight\); \['a', 'a'\] repeat one",
      "a=/x:half,b=/y:0.5": "weights as numbers; 'half' in 'a=/x:half' is not",
  }
  for paths, message in cases.items():
    config = _config(source="tokenized", paths=paths)
    with pytest.raises(ConfigError, match=message) as err:
      config.validate()
    assert err.value.field == "data.paths"
    with pytest.raises(ConfigError, match=message):
      mixture_entries(paths)
    with pytest.raises(ConfigError, match=message):
      pipeline.build_data(config)
  _config(source="tokenized", paths="a=/x:0.75,b=/y:0.25").validate()
