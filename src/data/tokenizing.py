"""Raw documents -> a tokenized dataset folder (token_store.py's format), in parallel and resumable.

`tokenize_corpus` is what `python -m experiments.tokenize` runs, and what a run with a raw source
(`data.source` stdlib/text/jsonl/parquet/arrayrecord) runs once on first use into a cache folder
(`cached_dataset`), so every run reads the same on-disk format.

How: the inputs are cut into units (documents.py); worker processes take them one at a time and each unit
becomes one train and one eval shard, named by the unit's number, so the dataset is the same for any number
of workers. A unit is done when its record in `progress/` exists (written after its shards); a second run
with the same inputs and settings skips the done units, so an interrupted tokenization resumes where it
stopped. The manifest is written last. Processes that fill the same folder at once (the processes of a
multi-process run meeting an empty cache) write identical files under their own temporary names, so either
finishing first is fine.
"""

import concurrent.futures
import dataclasses
import hashlib
import json
import multiprocessing
import os
import pathlib
import tempfile
import time

import numpy as np

from meshmoe.config import DataConfig
from meshmoe.data import documents, token_store, tokenizers
from meshmoe.data.token_store import DataError

UNIT_BYTES = 64 << 20  # input bytes per unit (and so per shard): a few seconds of work for one core
_SERIAL_BELOW_BYTES = 256 << 20  # with workers=0 (automatic), smaller inputs are tokenized in this process
_ENCODE_BYTES = 4 << 20  # text encoded at once within a unit


def tokenize_corpus(out: str | pathlib.Path, *, source: str, paths: str = "", eval_paths: str = "",
                    eval_fraction: float = 0.005, tokenizer: str = "byte", workers: int = 0,
                    unit_bytes: int = UNIT_BYTES, log=print) -> token_store.Manifest:
  """Tokenizes the documents of `source` into the dataset folder `out` (resuming an interrupted run)."""
  out = pathlib.Path(out).expanduser()
  inputs = describe_inputs(source, paths, eval_paths, eval_fraction, tokenizer)
  if (out / "manifest.json").is_file():
    manifest = token_store.read_manifest(out)
    if manifest.raw.get("inputs") != inputs:
      raise DataError(f"{out} already holds a dataset tokenized from other inputs or settings; "
                      "choose another output folder or remove it")
    log(f"{out}: already tokenized")
    return manifest
  progress = out / "progress"
  progress.mkdir(parents=True, exist_ok=True)
  plan_path = progress / "inputs.json"
  if plan_path.is_file() and json.loads(plan_path.read_text()) != inputs:
    raise DataError(f"{out} holds an unfinished tokenization of other inputs or settings; "
                    "choose another output folder or remove it")
  token_store.write_json(plan_path, inputs)

  tok = tokenizers.from_name(tokenizer)
  dtype = token_store.token_dtype(tok.vocab_size)
  work = _units(source, paths, eval_paths, unit_bytes)
  todo = [i for i in range(len(work)) if not (progress / f"unit-{i:06d}.json").is_file()]
  if len(todo) < len(work):
    log(f"{out}: resuming, {len(work) - len(todo)} of {len(work)} units already done")
  total_bytes = sum(f[1] for f in inputs["files"] + inputs["eval_files"])
  if not workers:  # starting worker processes costs more than small inputs take
    workers = 1 if total_bytes < _SERIAL_BELOW_BYTES else min(os.cpu_count() or 1, len(todo))
  start, done_bytes = time.perf_counter(), 0
  args = [(i, work[i], tokenizer, eval_fraction, str(out), dtype.str) for i in todo]
  if workers <= 1 or len(todo) <= 1:
    results = map(_tokenize_unit, args)
  else:
    # One thread per worker inside the Hugging Face tokenizer: the workers already fill the cores.
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                                  initializer=_one_tokenizer_thread)
    results = pool.map(_tokenize_unit, args)
  try:
    for count, record in enumerate(results, start=1):
      done_bytes += record["input_bytes"]
      if count % max(1, len(todo) // 20) == 0 or count == len(todo):
        rate = done_bytes / max(time.perf_counter() - start, 1e-9) / 1e6
        log(f"{out}: {count}/{len(todo)} units, {done_bytes / 1e6:,.1f} MB of input at {rate:,.1f} MB/s")
  finally:
    if not isinstance(results, map):
      pool.shutdown(cancel_futures=True)
  _hold_out_the_tail_if_needed(out, work, inputs, tokenizer, dtype)
  return _finish(out, inputs, len(work), tok, dtype)


def describe_inputs(source: str, paths: str, eval_paths: str, eval_fraction: float, tokenizer: str) -> dict:
  """What a tokenization depends on: every input file (path, size, modification time), the split and the
  tokenizer (its file's SHA-256). Equal descriptions give equal datasets."""
  if source not in documents.SOURCES:
    raise DataError(f"source {source!r} is not one of {', '.join(documents.SOURCES)}")
  files = documents.stdlib_files() if source == "stdlib" else documents.expand(paths, "paths")
  eval_files = documents.expand(eval_paths, "eval_paths") if eval_paths.strip() else []
  stat = lambda p: [str(p), p.stat().st_size, p.stat().st_mtime_ns]
  return {"format": token_store.FORMAT, "source": source, "files": [stat(p) for p in files],
          "eval_files": [stat(p) for p in eval_files], "eval_fraction": None if eval_files else eval_fraction,
          "tokenizer": tokenizers.identity(tokenizer)}


def cached_dataset(cfg: DataConfig, log=print) -> pathlib.Path:
  """The dataset folder of a raw source, tokenized into the cache on first use.

  The cache lives in $MESHMOE_CACHE (default ~/.cache/meshmoe)/tokenized/, one folder per description of
  the inputs (describe_inputs): changing a file, the split or the tokenizer makes a new one."""
  inputs = describe_inputs(cfg.source, cfg.paths, cfg.eval_paths, cfg.eval_fraction, cfg.tokenizer)
  key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]
  folder = _cache_root(log) / "tokenized" / f"{cfg.source}-{key}"
  if not (folder / "manifest.json").is_file():
    size = sum(f[1] for f in inputs["files"] + inputs["eval_files"])
    log(f"tokenizing {len(inputs['files']) + len(inputs['eval_files']):,} files ({size / 1e6:,.1f} MB) of "
        f"data.source={cfg.source!r} into the cache {folder} (once)")
    tokenize_corpus(folder, source=cfg.source, paths=cfg.paths, eval_paths=cfg.eval_paths,
                    eval_fraction=cfg.eval_fraction, tokenizer=cfg.tokenizer, log=lambda _: None)
  return folder


def _cache_root(log) -> pathlib.Path:
  root = pathlib.Path(os.environ.get("MESHMOE_CACHE", "~/.cache/meshmoe")).expanduser()
  try:
    (root / "tokenized").mkdir(parents=True, exist_ok=True)
    return root
  except OSError as e:  # a read-only home (a sandbox, a container): the machine's temporary folder
    fallback = pathlib.Path(tempfile.gettempdir()) / "meshmoe-cache"
    log(f"the data cache {root} cannot be written ({e.strerror or e}); using {fallback} (set MESHMOE_CACHE)")
    return fallback


def _units(source: str, paths: str, eval_paths: str, unit_bytes: int) -> list[documents.Unit]:
  files = documents.stdlib_files() if source == "stdlib" else documents.expand(paths, "paths")
  if not eval_paths.strip():
    return documents.units(source, files, "hash", unit_bytes)
  return (documents.units(source, files, "train", unit_bytes) +
          documents.units(source, documents.expand(eval_paths, "eval_paths"), "eval", unit_bytes))


def _hold_out_the_tail_if_needed(out: pathlib.Path, work: list, inputs: dict, tokenizer: str, dtype) -> None:
  """A corpus too small for the hash to hold out any document (a few documents in a notebook) holds out
  its last documents instead: eval_fraction of them, at least one, at most all but one."""
  records = [json.loads((out / "progress" / f"unit-{i:06d}.json").read_text()) for i in range(len(work))]
  documents_in = lambda r, split: r.get(split, {}).get("num_documents", 0)
  total = sum(documents_in(r, "train") for r in records)
  if inputs["eval_fraction"] is None or any(documents_in(r, "eval") for r in records) or total < 2:
    return
  last = max(i for i, r in enumerate(records) if documents_in(r, "train"))  # the last unit with documents
  held = min(max(1, int(total * inputs["eval_fraction"])), documents_in(records[last], "train"), total - 1)
  for split in token_store.SPLITS:  # the last unit's shards are written again
    for path in out.glob(f"{split}-{last:06d}.*"):
      path.unlink()
  tail = dataclasses.replace(work[last], split=f"tail:{held}")
  _tokenize_unit((last, tail, tokenizer, inputs["eval_fraction"], str(out), dtype.str))


def _one_tokenizer_thread() -> None:
  os.environ["RAYON_NUM_THREADS"] = "1"  # read when the Hugging Face tokenizer first encodes


def _tokenize_unit(args) -> dict:
  """Worker: one unit -> its train and eval shards and its record in progress/."""
  index, unit, tokenizer, eval_fraction, out, dtype = args
  out, dtype = pathlib.Path(out), np.dtype(dtype)
  tok = tokenizers.from_name(tokenizer)
  docs = [d for d in documents.read_unit(unit) if d]
  if unit.split.startswith("tail:"):  # the last documents (_hold_out_the_tail_if_needed)
    held_out = [i >= len(docs) - int(unit.split[5:]) for i in range(len(docs))]
  else:
    held_out = [unit.split == "eval" or (unit.split == "hash" and documents.is_eval(d, eval_fraction)) for d in docs]
  record = {"input_bytes": sum(len(d.encode("utf-8", errors="replace")) for d in docs)}
  for split in token_store.SPLITS:
    texts = [d for d, e in zip(docs, held_out) if e == (split == "eval")]
    ids, counts = _encode(tok, texts, dtype)
    if ids:
      record[split] = token_store.write_shard(out, f"{split}-{index:06d}", ids, dtype)
      used = np.flatnonzero(counts)
      np.savez(out / "progress" / f"unit-{index:06d}.{split}.npz", ids=used, counts=counts[used])
  token_store.write_json(out / "progress" / f"unit-{index:06d}.json", record)
  return record


def _encode(tok, texts: list[str], dtype: np.dtype) -> tuple[list[np.ndarray], np.ndarray]:
  """Each text's ids in the shard's dtype, followed by EOS, and the unit's token counts. Encodes a few MB of
  text at a time: a whole unit's Hugging Face encodings (strings, offsets, masks) would take GBs."""
  ids, counts, start = [], np.zeros(tok.vocab_size, np.int64), 0
  while start < len(texts):
    stop, size = start, 0
    while stop < len(texts) and size < _ENCODE_BYTES:
      size, stop = size + len(texts[stop]), stop + 1
    for doc in tokenizers.encode_documents(tok, texts[start:stop]):
      doc = np.append(doc, tok.eos_id).astype(dtype) if tok.eos_id is not None else doc.astype(dtype)
      if len(doc):
        counts += np.bincount(doc, minlength=tok.vocab_size)[:tok.vocab_size]
        ids.append(doc)
    start = stop
  return ids, counts


def _finish(out: pathlib.Path, inputs: dict, num_units: int, tok, dtype: np.dtype) -> token_store.Manifest:
  """Checks the units add up to a usable dataset, then writes the unigram counts and the manifest."""
  records = [json.loads((out / "progress" / f"unit-{i:06d}.json").read_text()) for i in range(num_units)]
  splits = {}
  for split in token_store.SPLITS:
    shards = [r[split] for r in records if split in r]
    counts = np.zeros(tok.vocab_size, np.int64)
    for i, r in enumerate(records):
      if split in r:
        with np.load(out / "progress" / f"unit-{i:06d}.{split}.npz") as unit_counts:
          np.add.at(counts, unit_counts["ids"], unit_counts["counts"])
    np.save(out / f"{split}.unigram.npy", counts)
    splits[split] = {"num_tokens": sum(s["num_tokens"] for s in shards),
                     "num_documents": sum(s["num_documents"] for s in shards), "shards": shards}
  files = len(inputs["files"])
  if splits["train"]["num_documents"] == 0:
    raise DataError(f"the source holds no training text ({files} file(s), all empty or held out for eval)")
  if splits["eval"]["num_documents"] == 0:
    fraction = inputs["eval_fraction"]
    raise DataError(f"no document was held out for eval: eval_fraction {fraction} of "
                    f"{splits['train']['num_documents']} document(s) rounds to none, or the eval files are "
                    "empty; name eval files (eval_paths) or raise the fraction")
  manifest = {"format": token_store.FORMAT, "inputs": inputs, "dtype": dtype.name,
              "tokenizer": inputs["tokenizer"] | {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
              "splits": splits}
  if inputs["tokenizer"]["kind"] == "tokenizer.json":  # the dataset names its own tokenizer
    (out / "tokenizer.json").write_bytes(pathlib.Path(inputs["tokenizer"]["path"]).read_bytes())
  token_store.write_json(out / "manifest.json", manifest)
  return token_store.read_manifest(out)
