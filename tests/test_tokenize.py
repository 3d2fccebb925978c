"""Tokenizing a corpus into a dataset folder: workers, resumption, changed inputs, the experiments.tokenize CLI."""

import concurrent.futures
import json
import os
import pathlib
import subprocess
import sys
import zlib

import numpy as np
import pytest

from meshmoe.data import token_store, tokenizing
from meshmoe.data.token_store import DataError

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _quiet(_):
  pass


def _corpus(tmp_path, count: int = 60) -> str:
  """A JSONL file of `count` documents; some hash into the eval split at eval_fraction 0.2."""
  rng = np.random.default_rng(0)
  texts = [" ".join(f"word{i}" for i in rng.integers(0, 50, int(rng.integers(2, 12)))) for _ in range(count)]
  assert any(zlib.crc32(t.encode()) % 100_000 < 20_000 for t in texts)
  path = tmp_path / "corpus.jsonl"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  return str(path)


def _shards(folder) -> dict:
  """Per split: each shard's file names, counts and SHA-256s, read from the manifest."""
  manifest = json.loads((pathlib.Path(folder) / "manifest.json").read_text())
  return {split: manifest["splits"][split] for split in ("train", "eval")}


def _file_digests(folder) -> dict[str, str]:
  """The SHA-256 of every shard and unigram file in the folder, recomputed."""
  return {p.name: token_store.sha256_file(p) for p in sorted(pathlib.Path(folder).iterdir())
          if p.suffix in (".tokens", ".npy")}


def test_the_number_of_workers_does_not_change_the_dataset(tmp_path, monkeypatch):
  paths = _corpus(tmp_path)
  pools, pool_class = [], concurrent.futures.ProcessPoolExecutor

  def recorded_pool(workers, **kwargs):
    pools.append(pool_class(workers, **kwargs))
    pools[-1].submit(os.getpid).result()  # a worker process started
    return pools[-1]

  monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", recorded_pool)
  one = tokenizing.tokenize_corpus(tmp_path / "one", source="jsonl", paths=paths, eval_fraction=0.2,
                                   workers=1, unit_bytes=200, log=_quiet)
  two = tokenizing.tokenize_corpus(tmp_path / "two", source="jsonl", paths=paths, eval_fraction=0.2,
                                   workers=2, unit_bytes=200, log=_quiet)
  assert len(pools) == 1 and pools[0]._max_workers == 2  # only the run with workers=2 used processes
  assert len(one.split("train")["shards"]) > 4
  assert _shards(tmp_path / "one") == _shards(tmp_path / "two")
  assert _file_digests(tmp_path / "one") == _file_digests(tmp_path / "two")
  assert one.raw == two.raw
  lines = [json.loads(line)["text"] for line in pathlib.Path(paths).read_text().splitlines()]
  total = sum(len(t.encode()) + 1 for t in lines)  # bytes + EOS per document
  assert one.split("train")["num_tokens"] + one.split("eval")["num_tokens"] == total
  assert one.split("train")["num_documents"] + one.split("eval")["num_documents"] == len(lines)
  for split in ("train", "eval"):  # the unigram counts are those of the shards
    tokens = np.concatenate([np.fromfile(tmp_path / "two" / s["tokens"], np.uint8)
                             for s in two.split(split)["shards"]])
    np.testing.assert_array_equal(np.load(tmp_path / "two" / f"{split}.unigram.npy"),
                                  np.bincount(tokens, minlength=256))


def test_an_interrupted_tokenization_resumes(tmp_path):
  paths = _corpus(tmp_path)
  out = tmp_path / "out"
  tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.2, unit_bytes=150, log=_quiet)
  shards, digests = _shards(out), _file_digests(out)
  records = sorted((out / "progress").glob("unit-*.json"))
  assert len(records) > 4
  (out / "manifest.json").unlink()  # as if it stopped before its last two units
  for record in records[-2:]:
    unit = record.stem.split("-")[1]
    record.unlink()
    for split in ("train", "eval"):
      for path in out.glob(f"{split}-{unit}.*"):
        path.unlink()
  with pytest.raises(DataError, match="did not finish"):
    token_store.read_manifest(out)
  logs = []
  manifest = tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.2, unit_bytes=150,
                                        log=logs.append)
  assert f"{out}: resuming, {len(records) - 2} of {len(records)} units already done" in logs
  assert _shards(out) == shards and _file_digests(out) == digests
  assert token_store.verify(out).raw == manifest.raw

  logs.clear()  # a finished folder: nothing to do
  tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.2, unit_bytes=150, log=logs.append)
  assert logs == [f"{out}: already tokenized"]


def test_other_inputs_into_the_same_folder(tmp_path):
  paths = _corpus(tmp_path)
  out = tmp_path / "out"
  tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.2, unit_bytes=150, log=_quiet)
  with pytest.raises(DataError, match=rf"{out} already holds a dataset tokenized from other inputs or settings"):
    tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.3, log=_quiet)
  tokenizer = tmp_path / "words.json"
  _word_tokenizer(tokenizer)
  with pytest.raises(DataError, match="other inputs"):
    tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.2, tokenizer=str(tokenizer),
                               log=_quiet)
  (out / "manifest.json").unlink()  # unfinished: the plan in progress/ is checked too
  with pytest.raises(DataError, match=rf"{out} holds an unfinished tokenization of other inputs or settings"):
    tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.3, log=_quiet)
  with pytest.raises(DataError, match="other inputs"):
    tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.2, tokenizer=str(tokenizer),
                               log=_quiet)
  pathlib.Path(paths).write_text(pathlib.Path(paths).read_text() + json.dumps({"text": "one more"}) + "\n")
  with pytest.raises(DataError, match="other inputs"):  # a changed input file
    tokenizing.tokenize_corpus(out, source="jsonl", paths=paths, eval_fraction=0.2, log=_quiet)


def _word_tokenizer(path: pathlib.Path) -> None:
  from tokenizers import Tokenizer, models, pre_tokenizers

  tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1} | {f"word{i}": i + 2 for i in range(50)},
                                         unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  tokenizer.save(str(path))


def _cli(*flags: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "experiments.tokenize", *flags], cwd=_ROOT, capture_output=True,
                        text=True, timeout=120)


def test_tokenize_cli(tmp_path):
  paths = _corpus(tmp_path)
  out = tmp_path / "out"
  done = _cli("--source=jsonl", f"--paths={paths}", f"--out={out}", "--eval_fraction=0.2", "--workers=1")
  assert done.returncode == 0, done.stderr
  manifest = json.loads((out / "manifest.json").read_text())
  train, evaluation = manifest["splits"]["train"], manifest["splits"]["eval"]
  summary = (f"train {train['num_tokens']:,} tokens in {train['num_documents']:,} documents, eval "
             f"{evaluation['num_tokens']:,} in {evaluation['num_documents']:,}; vocabulary 256, uint8 tokens")
  assert f"wrote {out} ({summary})" in done.stdout
  expected = tokenizing.tokenize_corpus(tmp_path / "direct", source="jsonl", paths=paths, eval_fraction=0.2,
                                        log=_quiet)
  assert _shards(out) == _shards(tmp_path / "direct") and manifest["inputs"] == expected.raw["inputs"]

  verified = _cli(f"--verify={out}")
  assert verified.returncode == 0, verified.stderr
  assert verified.stdout.startswith(f"{out}: every checksum matches ({summary}; ")
  shard = out / train["shards"][0]["tokens"]
  data = shard.read_bytes()
  shard.write_bytes(bytes([data[0] ^ 1]) + data[1:])
  corrupt = _cli(f"--verify={out}")
  assert corrupt.returncode == 1 and "Traceback" not in corrupt.stderr
  assert corrupt.stderr.strip() == f"error: {shard}: its SHA-256 differs from the manifest's; the file is corrupt"


def test_tokenize_cli_errors(tmp_path):
  missing_out = _cli("--source=text", f"--paths={tmp_path}/*.txt")
  assert missing_out.returncode != 0 and "Traceback" not in missing_out.stderr
  assert missing_out.returncode == 1 and missing_out.stderr.strip() == (
      "error: --out is required (or --verify=FOLDER); --helpfull lists the flags")
  bad_flag = _cli("--source=text", f"--paths={tmp_path}/a.txt", f"--out={tmp_path}/out", "--workers=-1")
  assert bad_flag.returncode != 0 and "Traceback" not in bad_flag.stderr
  assert "flag --workers=-1: -1 is not a non-negative integer" in bad_flag.stderr.splitlines()[0]
  stdlib_with_paths = _cli("--source=stdlib", f"--paths={tmp_path}/a.txt", f"--out={tmp_path}/out")
  assert stdlib_with_paths.returncode == 1 and stdlib_with_paths.stderr.strip() == (
      "error: --source=stdlib reads this interpreter's standard library and takes no --paths")
  no_files = _cli("--source=text", f"--paths={tmp_path}/nothing*.txt", f"--out={tmp_path}/out")
  assert no_files.returncode == 1 and no_files.stdout == ""
  assert no_files.stderr.strip() == f"error: paths: '{tmp_path}/nothing*.txt' matches no file"
  assert not (tmp_path / "out").exists()


def test_uint32_ids_beyond_int32_are_reported_as_corrupt(tmp_path):
  # A 128K vocabulary stores uint32 ids; one of 2**32 - 16 reads back negative as int32 and must not pass.
  entry = token_store.write_shard(tmp_path, "train-000000", [np.asarray([5, 6, 2**32 - 16, 7, 1], np.uint32)],
                                  np.dtype(np.uint32))
  raw = {"tokenizer": {"vocab_size": 128_256, "eos_id": 1}, "dtype": "uint32", "splits": {"train": {"shards": [entry]}}}
  reader = token_store.SplitReader(token_store.Manifest(tmp_path, raw), "train")
  np.testing.assert_array_equal(reader.read(0, 2), [5, 6])
  with pytest.raises(token_store.DataError, match=r"corrupt record in .*train-000000.tokens at token 2: token id "
                                                  r"4294967280 is outside the manifest's vocabulary of 128256"):
    reader.read(0, 5)


def test_a_carriage_return_inside_a_json_line_is_whitespace(tmp_path):
  path = tmp_path / "docs.jsonl"
  path.write_bytes(b'{"text": "one"}\n{"text": "two",\r "id": 2}\n{"text": "three"}\n')
  manifest = tokenizing.tokenize_corpus(tmp_path / "out", source="jsonl", paths=str(path), eval_paths=str(path),
                                        log=lambda _: None)
  assert manifest.split("train")["num_documents"] == 3


def test_a_tiny_corpus_ending_in_an_empty_file_still_holds_out_a_document(tmp_path):
  for name, text in (("a.txt", "hello there"), ("b.txt", "general kenobi"), ("c.txt", "")):
    (tmp_path / name).write_text(text)
  manifest = tokenizing.tokenize_corpus(tmp_path / "out", source="text", paths=str(tmp_path / "*.txt"),
                                        eval_fraction=0.1, unit_bytes=1, log=lambda _: None)
  assert (manifest.split("train")["num_documents"], manifest.split("eval")["num_documents"]) == (1, 1)
  assert manifest.split("eval")["num_tokens"] == len("general kenobi") + 1  # the last document, with its EOS
