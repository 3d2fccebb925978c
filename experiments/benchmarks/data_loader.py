"""The tokenized data pipeline: tokenizing speed, loader throughput, reader memory, exact resumption.

  .venv/bin/python -m experiments.benchmarks.data_loader [--part=all|tokenize|loader|rss|resume]
      [--workdir=/tmp/data_loader_bench] [--out=FILE.json] [--tokenize_mb=256] [--rss_sizes=1,4,16]

Parts (each writes its numbers under its own key of the JSON written to --out, and prints a summary):
- tokenize: writes a synthetic English-like JSONL corpus (synthetic_corpus.py) of --tokenize_mb MiB (made-up
  words drawn from a Zipf law over a fixed vocabulary, documents of log-normal lengths; deterministic), then times
  `python -m experiments.tokenize --source=jsonl --workers=2` on it in a subprocess (wall clock) with the
  byte tokenizer and with a byte-level BPE tokenizer.json (vocabulary up to 32768) trained with the
  `tokenizers` library on a sample of the corpus (its training is not timed). Measured: MB/s of input text,
  tokens written.
- loader: tokens/s that `build_data(...).train` delivers to one process holding every row, at moe_1b's
  shape (seq_len 2048, 64 sequences per batch, packed rows) from the BPE-tokenized corpus (uint16 tokens),
  for data.loader_threads 0, 2 and 4, and for a mixture of two datasets (0.7 / 0.3). The shards are in the
  page cache (just written): this is the loader's cost, not the disk's. Against it, modelled: the tokens/s
  one H100 consumes training moe_1b at 50% MFU (989 dense bf16 TFLOP/s; FLOPs per token from
  analysis/cost_model.py); the issue asks for more than 100x that.
- rss: peak resident memory of a reading process (seq_len 2048, 64 rows per batch, 4 loader threads, 2000
  batches of rows drawn from the whole corpus) for byte-level datasets of 1x, 4x and 16x --rss_base_tokens
  tokens (16 x 256M >= 4e9 tokens); it must not grow with the corpus. The datasets are made by the real path
  (--rss_method=tokenize, the default: synthetic JSONL text tokenized by experiments.tokenize, byte
  tokenizer, 2 workers) or written directly in the on-disk format (--rss_method=direct:
  token_store.write_shard + a manifest as tokenizing._finish writes it), and deleted afterwards (--keep
  keeps them).
- resume: kill -9 in the middle of an epoch, resume from the last saved iterator state, and the batches
  from that state on are bitwise those of an uninterrupted run: with 1 process, 2 processes, 2 -> 1 and
  1 -> 2 (a small 2-dataset mixture, seq_len 128, 8 rows per batch; 60 batches span several epochs).
  Each process is a subprocess of this file (--part=_worker) that logs a SHA-256 per batch of its rows and
  saves its iterator state every 5 batches.
"""

import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

from experiments.benchmarks.synthetic_corpus import make_vocabulary, train_bpe, write_corpus

PARTS = ("tokenize", "loader", "rss", "resume")
H100_BF16_FLOPS = 989e12  # dense bf16 peak of an H100 SXM

_PART = flags.DEFINE_enum("part", "all", ["all", *PARTS, "_worker", "_rss_reader"],
                          "which part to run (_worker and _rss_reader: internal subprocesses)")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/data_loader_bench", "scratch folder (corpora, datasets, logs)")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here (default: WORKDIR/results.json)")
_TOKENIZE_MB = flags.DEFINE_integer("tokenize_mb", 256, "MiB of JSONL text for the tokenize part", lower_bound=1)
_LOADER_SECONDS = flags.DEFINE_float("loader_seconds", 20.0, "timed seconds per loader setting (after warm-up)")
_LOADER_MIN_BATCHES = flags.DEFINE_integer("loader_min_batches", 200, "and at least this many timed batches")
_RSS_SIZES = flags.DEFINE_list("rss_sizes", ["1", "4", "16"], "corpus sizes, in multiples of --rss_base_tokens")
_RSS_BASE_TOKENS = flags.DEFINE_integer("rss_base_tokens", 256_000_000, "tokens of the 1x dataset")
_RSS_BATCHES = flags.DEFINE_integer("rss_batches", 2000, "batches the reading process reads")
_RSS_METHOD = flags.DEFINE_enum("rss_method", "tokenize", ["direct", "tokenize"],
                                "write the datasets' shards directly, or generate text and tokenize it")
_KEEP = flags.DEFINE_bool("keep", False, "keep the rss part's big datasets")
_RESUME_BATCHES = flags.DEFINE_integer("resume_batches", 60, "batches of every resume scenario")
_SPEC = flags.DEFINE_string("spec", "{}", "internal: the subprocess's settings as JSON")


# --------------------------------------------------------------------------------------------- tokenize


def run_tokenize(paths: str, out: pathlib.Path, tokenizer: str, workers: int = 2) -> dict:
  """`python -m experiments.tokenize` in a subprocess (from scratch); wall clock and what it wrote."""
  shutil.rmtree(out, ignore_errors=True)
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-c", _PEAK_RSS_OF_COMMAND, sys.executable, "-m", "experiments.tokenize",
                         "--source=jsonl", f"--paths={paths}", f"--tokenizer={tokenizer}", f"--out={out}",
                         f"--workers={workers}"], check=True, stdout=subprocess.PIPE, text=True)
  seconds = time.perf_counter() - start
  peak_mib = int(done.stdout.strip().splitlines()[-1]) / 1024
  manifest = json.loads((out / "manifest.json").read_text())
  input_bytes = sum(f[1] for f in manifest["inputs"]["files"])
  tokens = sum(manifest["splits"][s]["num_tokens"] for s in ("train", "eval"))
  return {"measured_wall_seconds": seconds, "input_bytes": input_bytes,
          "measured_input_MB_per_s": input_bytes / 1e6 / seconds, "tokens_written": tokens,
          "train_tokens": manifest["splits"]["train"]["num_tokens"], "dtype": manifest["dtype"],
          "bytes_per_token": input_bytes / tokens, "vocab_size": manifest["tokenizer"]["vocab_size"],
          "shards": len(manifest["splits"]["train"]["shards"]),
          "measured_peak_rss_MiB_largest_process": peak_mib}


# Runs the command in argv[1:] and prints the peak RSS (KiB) of the largest process of its tree (the tokenizer
# and its workers: getrusage of the children counts every descendant that has been waited for).
_PEAK_RSS_OF_COMMAND = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, "
                        "stdout=subprocess.DEVNULL); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def part_tokenize(work: pathlib.Path) -> dict:
  corpus = work / "corpus" / "web.jsonl"
  corpus.parent.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  info = write_corpus(corpus, _TOKENIZE_MB.value << 20)
  info["generate_seconds"] = time.perf_counter() - start
  print(f"corpus: {info['bytes'] / 1e6:,.1f} MB, {info['documents']:,} documents ({info['generate_seconds']:.1f}s)",
        flush=True)
  bpe = work / "corpus" / "bpe32k.json"
  bpe_info = train_bpe(corpus, bpe)
  print(f"BPE tokenizer: vocabulary {bpe_info['vocab_size']:,}", flush=True)
  results = {"corpus": info, "bpe_tokenizer": bpe_info | {"path": str(bpe)}, "workers": 2}
  for name, tokenizer in (("byte", "byte"), ("bpe", str(bpe))):
    r = run_tokenize(str(corpus), work / "datasets" / f"web_{name}", tokenizer)
    results[name] = r
    print(f"tokenize {name}: {r['measured_input_MB_per_s']:.1f} MB/s of text ({r['measured_wall_seconds']:.1f}s), "
          f"{r['tokens_written']:,} {r['dtype']} tokens, "
          f"peak RSS {r['measured_peak_rss_MiB_largest_process']:,.0f} MiB", flush=True)
  return results


# --------------------------------------------------------------------------------------------- loader


def load_moe_1b():
  spec = importlib.util.spec_from_file_location("moe_1b", pathlib.Path(__file__).parents[1] / "configs/moe_1b.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def with_data(config, **data):
  """`config` with data fields replaced (the other sections shared)."""
  train = {k: data.pop(k) for k in ("seq_len", "global_batch_size", "seed", "eval_batches") if k in data}
  return dataclasses.replace(config, data=dataclasses.replace(config.data, **data),
                             train=dataclasses.replace(config.train, **train))


def time_loader(config, seconds: float, min_batches: int, warmup: int = 10) -> dict:
  from meshmoe.data.pipeline import build_data

  start = time.perf_counter()
  data = build_data(config, log=lambda _: None)
  build_s = time.perf_counter() - start
  it = data.train
  for _ in range(warmup):
    next(it)
  tokens = batches = 0
  start = time.perf_counter()
  while True:
    batch = next(it)
    tokens += batch["inputs"].size
    batches += 1
    elapsed = time.perf_counter() - start
    if elapsed >= seconds and batches >= min_batches:
      break
  return {"measured_tokens_per_s": tokens / elapsed, "measured_batches_per_s": batches / elapsed,
          "batches": batches, "seconds": elapsed, "build_data_seconds": build_s}


def part_loader(work: pathlib.Path) -> dict:
  from meshmoe.analysis import cost_model

  config = load_moe_1b()
  b, s = config.train.global_batch_size, config.train.seq_len
  flops_per_token = cost_model.train_step_flops(config.model, b, s) / (b * s)
  target = 0.5 * H100_BF16_FLOPS / flops_per_token
  web = work / "datasets" / "web_bpe"
  bpe = work / "corpus" / "bpe32k.json"
  if not (web / "manifest.json").is_file():
    raise app.UsageError(f"{web} is missing: run --part=tokenize first (same --workdir)")
  # The mixture's second dataset: another corpus (other seed), tokenized by the same tokenizer in-process.
  books = work / "datasets" / "books_bpe"
  if not (books / "manifest.json").is_file():
    from meshmoe.data import tokenizing
    corpus = work / "corpus" / "books.jsonl"
    write_corpus(corpus, 48 << 20, seed=7)
    tokenizing.tokenize_corpus(books, source="jsonl", paths=str(corpus), tokenizer=str(bpe), log=lambda _: None)
  results = {"shape": {"seq_len": s, "global_batch_size": b, "packing": True, "processes": 1},
             "modelled_train_flops_per_token": flops_per_token,
             "modelled_h100_tokens_per_s_at_50pct_mfu": target, "modelled_peak_flops": H100_BF16_FLOPS,
             "required_ratio": 100.0, "settings": {}}
  settings = [(f"web_threads{n}", f"web={web}", n) for n in (0, 2, 4)]
  settings += [(f"mixture_0.7_0.3_threads{n}", f"web={web}:0.7,books={books}:0.3", n) for n in (0, 4)]
  for name, paths, threads in settings:
    cfg = with_data(config, source="tokenized", paths=str(paths), loader_threads=threads, packing=True)
    cfg.validate()
    r = time_loader(cfg, _LOADER_SECONDS.value, _LOADER_MIN_BATCHES.value)
    r["measured_over_modelled_target"] = r["measured_tokens_per_s"] / target
    r["passes_100x"] = r["measured_over_modelled_target"] > 100
    results["settings"][name] = r
    print(f"loader {name}: {r['measured_tokens_per_s'] / 1e6:,.1f} M tokens/s measured "
          f"({r['measured_batches_per_s']:.1f} batches/s over {r['batches']} batches), "
          f"{r['measured_over_modelled_target']:.0f}x the modelled H100 consumption", flush=True)
  return results


# --------------------------------------------------------------------------------------------- rss


def write_direct_dataset(folder: pathlib.Path, num_tokens: int, seed: int, shard_tokens: int = 256_000_000) -> None:
  """A byte-level dataset of `num_tokens` train tokens written straight into the on-disk format (random
  bytes 1..255 in documents of log-normal length, each ended by EOS 0), its manifest as tokenizing._finish
  writes it."""
  from meshmoe.data import token_store, tokenizers

  if (folder / "manifest.json").is_file():
    return
  shutil.rmtree(folder, ignore_errors=True)
  folder.mkdir(parents=True)
  rng = np.random.default_rng(seed)
  dtype = np.dtype(np.uint8)
  splits = {}
  for split, total in (("train", num_tokens), ("eval", max(1_000_000, num_tokens // 1000))):
    shards, counts, done = [], np.zeros(256, np.int64), 0
    while done < total:
      size = min(shard_tokens, total - done)
      tokens = rng.integers(1, 256, size, dtype=np.uint8)
      lengths = np.clip(rng.lognormal(8.0, 1.0, size // 1000 + 16).astype(np.int64), 16, None)
      ends = np.cumsum(lengths)
      ends = np.append(ends[ends < size], size)
      tokens[ends - 1] = 0  # EOS
      docs = np.split(tokens, ends[:-1])
      shards.append(token_store.write_shard(folder, f"{split}-{len(shards):06d}", docs, dtype))
      counts += np.bincount(tokens, minlength=256)
      done += size
      del tokens, docs
    np.save(folder / f"{split}.unigram.npy", counts)
    splits[split] = {"num_tokens": sum(s["num_tokens"] for s in shards),
                     "num_documents": sum(s["num_documents"] for s in shards), "shards": shards}
  identity = tokenizers.identity("byte")
  inputs = {"format": token_store.FORMAT, "source": "synthetic (written directly)", "files": [],
            "eval_files": [], "eval_fraction": None, "tokenizer": identity}
  tok = tokenizers.ByteTokenizer()
  token_store.write_json(folder / "manifest.json", {
      "format": token_store.FORMAT, "inputs": inputs, "dtype": dtype.name,
      "tokenizer": identity | {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id}, "splits": splits})
  token_store.read_manifest(folder)


def write_tokenized_dataset(folder: pathlib.Path, num_tokens: int, seed: int, text: pathlib.Path) -> None:
  """The same by the real path: a JSONL corpus of `num_tokens` bytes (ASCII: one byte per token) tokenized
  by `python -m experiments.tokenize --tokenizer=byte`."""
  if (folder / "manifest.json").is_file():
    return
  write_corpus(text, int(num_tokens * 1.02), seed=seed)  # the JSONL wrapping and the eval split take ~1.2%
  run_tokenize(str(text), folder, "byte")
  text.unlink()
  text.with_suffix(".done").unlink()


def rss_reader(spec: dict) -> None:
  """Subprocess: read `batches` batches of the dataset, print peak and final RSS as one JSON line."""
  import psutil
  from meshmoe.data.pipeline import build_data

  rss_start = psutil.Process().memory_info().rss
  config = with_data(load_moe_1b(), source="tokenized", paths=spec["dataset"], loader_threads=4, packing=True,
                     seq_len=2048, global_batch_size=64, seed=spec["seed"])
  config.validate()
  start = time.perf_counter()
  data = build_data(config, log=lambda _: None)
  rss_built = psutil.Process().memory_info().rss
  build_s = time.perf_counter() - start
  checksum = 0
  start = time.perf_counter()
  for _ in range(spec["batches"]):
    checksum += int(next(data.train)["inputs"][:, 0].sum())
  read_s = time.perf_counter() - start
  # VmHWM: this process's own peak. getrusage's ru_maxrss would also count the parent's pages at the fork
  # that started this process (Linux keeps the larger of the two across exec).
  peak_kib = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
  print(json.dumps({"measured_peak_rss_bytes": peak_kib * 1024,
                    "measured_final_rss_bytes": psutil.Process().memory_info().rss,
                    "rss_after_imports_bytes": rss_start, "rss_after_build_data_bytes": rss_built,
                    "train_tokens": data.train_tokens, "build_data_seconds": build_s, "read_seconds": read_s,
                    "checksum": checksum}))


def part_rss(work: pathlib.Path) -> dict:
  results = {"method": _RSS_METHOD.value, "method_note": (
      "shards written directly with token_store.write_shard + a manifest like tokenizing._finish's "
      "(random bytes 1..255, log-normal documents, EOS 0)" if _RSS_METHOD.value == "direct" else
      "synthetic JSONL text tokenized by python -m experiments.tokenize --tokenizer=byte --workers=2"),
      "reader": {"seq_len": 2048, "global_batch_size": 64, "loader_threads": 4, "batches": _RSS_BATCHES.value},
      "sizes": {}}
  folders = []
  for size in (int(x) for x in _RSS_SIZES.value):
    folder = work / "datasets" / f"rss_{size}x"
    folders.append(folder)
    start = time.perf_counter()
    if _RSS_METHOD.value == "direct":
      write_direct_dataset(folder, size * _RSS_BASE_TOKENS.value, seed=size)
    else:
      write_tokenized_dataset(folder, size * _RSS_BASE_TOKENS.value, size, work / "corpus" / f"rss_{size}x.jsonl")
    make_s = time.perf_counter() - start
    spec = {"dataset": str(folder), "batches": _RSS_BATCHES.value, "seed": 0}
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "experiments.benchmarks.data_loader", "--part=_rss_reader",
                          f"--spec={json.dumps(spec)}"], check=True, stdout=subprocess.PIPE, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    r |= {"dataset_seconds": make_s, "reader_wall_seconds": time.perf_counter() - start,
          "disk_bytes": sum(p.stat().st_size for p in folder.iterdir())}
    results["sizes"][f"{size}x"] = r
    print(f"rss {size}x: {r['train_tokens'] / 1e9:.2f}B tokens, peak RSS {r['measured_peak_rss_bytes'] / 2**20:,.0f} "
          f"MiB (final {r['measured_final_rss_bytes'] / 2**20:,.0f} MiB); dataset {make_s:.0f}s, reader "
          f"{r['reader_wall_seconds']:.0f}s", flush=True)
  peaks = [r["measured_peak_rss_bytes"] for r in results["sizes"].values()]
  results["peak_rss_growth_bytes_largest_minus_smallest"] = peaks[-1] - peaks[0]
  results["peak_rss_ratio_largest_over_smallest"] = peaks[-1] / peaks[0]
  if not _KEEP.value:
    for folder in folders:
      shutil.rmtree(folder, ignore_errors=True)
  return results


# --------------------------------------------------------------------------------------------- resume


def block_hash(batch: dict, rows: slice = slice(None)) -> str:
  digest = hashlib.sha256()
  for key in ("inputs", "targets", "mask"):
    digest.update(np.ascontiguousarray(batch[key][rows]).tobytes())
  return digest.hexdigest()


def resume_config(spec: dict):
  from meshmoe.config import Config

  config = with_data(Config(), source="tokenized", paths=spec["paths"], loader_threads=spec["threads"],
                     packing=True, seq_len=spec["seq_len"], global_batch_size=spec["batch"], seed=3, eval_batches=1)
  return config.validate()


def worker(spec: dict) -> None:
  """Subprocess: process p of P loads its rows, resuming from `state` if present; per batch it appends
  "index sha256" to `log`, and every 5 batches saves its iterator state (atomically) to `state`."""
  from meshmoe.data.pipeline import build_data

  config = resume_config(spec)
  p, count, batch = spec["process"], spec["processes"], spec["batch"]
  data = build_data(config, rows=range(p * batch // count, (p + 1) * batch // count), log=lambda _: None)
  state_path, log_path = pathlib.Path(spec["state"]), pathlib.Path(spec["log"])
  index = 0
  if state_path.is_file():
    saved = json.loads(state_path.read_text())
    data.train.set_state(saved["state"])
    index = saved["next_batch"]
  with open(log_path, "a") as log:
    while index < spec["batches"]:
      log.write(f"{index} {block_hash(next(data.train))}\n")
      log.flush()
      index += 1
      if index % 5 == 0:
        tmp = state_path.with_name(state_path.name + ".tmp")
        tmp.write_text(json.dumps({"next_batch": index, "state": data.train.get_state()}))
        os.replace(tmp, state_path)
      time.sleep(spec["sleep"])
  pathlib.Path(spec["log"] + ".counts").write_text(json.dumps(data.train.source_token_counts()))


def _start_worker(spec: dict) -> subprocess.Popen:
  with open(spec["log"] + ".stderr", "ab") as err:  # a file, not a pipe: nobody reads it while the worker runs
    return subprocess.Popen([sys.executable, "-m", "experiments.benchmarks.data_loader", "--part=_worker",
                             f"--spec={json.dumps(spec)}"], stdout=subprocess.DEVNULL, stderr=err)


def _log_lines(path: str) -> int:
  return len(pathlib.Path(path).read_text().splitlines()) if os.path.exists(path) else 0


def run_processes(base: dict, folder: pathlib.Path, count: int, kill_after: int | None,
                  state_from: dict[int, int] | None = None) -> None:
  """Runs `count` workers; with `kill_after`, SIGKILLs all of them once each has logged that many batches.
  `state_from`: worker p starts from the state file of worker state_from[p] (copied to its own)."""
  specs = []
  for p in range(count):
    spec = base | {"process": p, "processes": count, "state": str(folder / f"state{p}.json"),
                   "log": str(folder / f"log{p}.txt")}
    if state_from is not None and state_from[p] != p:
      shutil.copyfile(folder / f"state{state_from[p]}.json", spec["state"])
    specs.append(spec)
  procs = [_start_worker(s) for s in specs]
  deadline = time.monotonic() + 300
  if kill_after is not None:
    while time.monotonic() < deadline and any(_log_lines(s["log"]) < kill_after for s in specs):
      if any(p.poll() is not None for p in procs):
        break
      time.sleep(0.01)
    for proc in procs:
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
  for proc, spec in zip(procs, specs):
    proc.wait(timeout=max(1, deadline - time.monotonic()))
    if proc.returncode not in (0, -signal.SIGKILL):
      err = pathlib.Path(spec["log"] + ".stderr").read_text()[-3000:]
      raise RuntimeError(f"worker {spec['process']} of {count} failed ({proc.returncode}): {err}")


def _log_entries(path: pathlib.Path) -> list[tuple[int, str]]:
  """(batch index, hash) of every line of a worker's log, in order (a replayed index appears again)."""
  return [(int(i), h) for i, h in (line.split() for line in path.read_text().splitlines())]


def part_resume(work: pathlib.Path) -> dict:
  from meshmoe.data import tokenizing
  from meshmoe.data.pipeline import build_data

  root = work / "resume"
  shutil.rmtree(root, ignore_errors=True)
  root.mkdir(parents=True)
  # Two small byte-level datasets: ~25K and ~12K train tokens, so 60 batches of 8 x 128 tokens (61K tokens)
  # cross epochs of both (0.7 of the rows from the first, 0.3 from the second).
  folders = []
  for name, size, seed in (("a", 25_000, 11), ("b", 12_000, 12)):
    corpus = root / f"{name}.jsonl"
    rng = np.random.default_rng(seed)
    vocab = make_vocabulary(600, seed)
    with open(corpus, "w") as f:
      while f.tell() < size:
        f.write(json.dumps({"text": " ".join(rng.choice(vocab, int(rng.integers(5, 120))))}) + "\n")
    tokenizing.tokenize_corpus(root / name, source="jsonl", paths=str(corpus), eval_fraction=0.1, log=lambda _: None)
    folders.append(root / name)
  batches, batch, seq_len = _RESUME_BATCHES.value, 8, 128
  base = {"paths": f"a={folders[0]}:0.7,b={folders[1]}:0.3", "threads": 2, "seq_len": seq_len, "batch": batch,
          "batches": batches, "sleep": 0.03}
  # The reference: one process, no loader threads (the workers use 2: the batches must not depend on it).
  data = build_data(resume_config(base | {"threads": 0}), log=lambda _: None)
  results = {"dataset": {"rows": {}, "batches": batches, "global_batch_size": batch, "seq_len": seq_len,
                         "weights": [0.7, 0.3],
                         "loader_threads": {"workers": base["threads"], "reference": 0}}, "scenarios": {}}
  for name, folder in zip("ab", folders):
    rows = (json.loads((folder / "manifest.json").read_text())["splits"]["train"]["num_tokens"] - 1) // seq_len
    results["dataset"]["rows"][name] = rows
  results["dataset"]["epochs_spanned"] = {
      "a": batches * batch * 0.7 / results["dataset"]["rows"]["a"],
      "b": batches * batch * 0.3 / results["dataset"]["rows"]["b"]}
  reference = {1: [[] for _ in range(1)], 2: [[] for _ in range(2)]}
  for _ in range(batches):
    full = next(data.train)
    for count in (1, 2):
      for p in range(count):
        reference[count][p].append(block_hash(full, slice(p * batch // count, (p + 1) * batch // count)))
  reference_counts = data.train.source_token_counts()
  scenarios = {  # name: [(processes, kill after this many logged batches or None, state_from)]
      "1_process": [(1, 27, None), (1, None, {0: 0})],
      "2_processes": [(2, 23, None), (2, None, {0: 0, 1: 1})],
      "2_to_1_processes": [(2, 27, None), (1, None, {0: 0})],
      "1_to_2_processes": [(1, 33, None), (2, None, {0: 0, 1: 0})],
      "1_process_killed_twice": [(1, 12, None), (1, 41, {0: 0}), (1, None, {0: 0})],
      # The check itself: a resume from a state one batch ahead of where the log says it is must fail.
      "negative_control_state_off_by_one": [(1, 27, None), (1, None, {0: 0})],
  }
  for name, steps in scenarios.items():
    folder = root / name
    folder.mkdir()
    logs = []  # (processes, process, log) of every stage
    for stage, (count, kill_after, state_from) in enumerate(steps):
      if name.startswith("negative_control") and stage > 0:
        saved = json.loads((folder / "state0.json").read_text())
        saved["state"]["next_index"] += 1
        (folder / "state0.json").write_text(json.dumps(saved))
      run_processes(base, folder, count, kill_after, state_from)
      for p in range(count):  # the next stage writes fresh logs
        logs.append((count, p, (folder / f"log{p}.txt").rename(folder / f"log{p}.stage{stage}.txt")))
    final_count = steps[-1][0]
    r = {"stages": [{"processes": c, "killed_after_logged_batches": k} for c, k, _ in steps], "processes": {}}
    # Every batch any stage logged (those before the kill, the replayed ones after the last saved state, and
    # those after the resume) must equal the reference's rows of that process.
    mismatches = [(p, c, i) for c, p, path in logs for i, h in _log_entries(path) if h != reference[c][p][i]]
    ok = not mismatches
    for count, p, path in logs[-final_count:]:
      entries = _log_entries(path)
      counts = json.loads(pathlib.Path(str(folder / f"log{p}.txt") + ".counts").read_text())
      complete = sorted({i for i, _ in entries}) == list(range(entries[0][0], batches))
      passed = complete and counts == reference_counts and not [m for m in mismatches if m[:2] == (p, count)]
      ok &= passed
      r["processes"][p] = {"resumed_at_batch": entries[0][0], "batches_after_resume": len(entries),
                           "complete_to_the_end": complete, "source_token_counts": counts,
                           "source_token_counts_match_reference": counts == reference_counts, "pass": passed}
    r["logged_batches_checked"] = sum(len(_log_entries(path)) for _, _, path in logs)
    r["mismatched_logged_batches"] = [{"processes": c, "process": p, "batch": i} for p, c, i in mismatches]
    r["pass"] = ok
    results["scenarios"][name] = r
    print(f"resume {name}: {'PASS' if ok else 'FAIL'} (" + ", ".join(
        f"p{p} resumed at batch {v['resumed_at_batch']}" for p, v in r["processes"].items()) +
        f"; {r['logged_batches_checked']} logged batches checked, {len(mismatches)} differ)", flush=True)
  results["reference_source_token_counts"] = reference_counts
  negative = {k: v for k, v in results["scenarios"].items() if k.startswith("negative_control")}
  results["negative_control_detected"] = all(not v["pass"] for v in negative.values())
  results["pass"] = results["negative_control_detected"] and all(
      v["pass"] for k, v in results["scenarios"].items() if k not in negative)
  return results


# --------------------------------------------------------------------------------------------- main


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  if _PART.value == "_worker":
    return worker(json.loads(_SPEC.value))
  if _PART.value == "_rss_reader":
    return rss_reader(json.loads(_SPEC.value))
  work = pathlib.Path(_WORKDIR.value)
  work.mkdir(parents=True, exist_ok=True)
  out = pathlib.Path(_OUT.value or work / "results.json")
  results = json.loads(out.read_text()) if out.is_file() else {}  # parts run separately accumulate
  functions = {"tokenize": part_tokenize, "loader": part_loader, "rss": part_rss, "resume": part_resume}
  for part in PARTS if _PART.value == "all" else [_PART.value]:
    start = time.perf_counter()
    results[part] = functions[part](work) | {"part_seconds": time.perf_counter() - start}
    out.write_text(json.dumps(results, indent=1) + "\n")
  print("\nsummary:")
  print(summary(results))
  print(f"results written to {out}")


def summary(results: dict) -> str:
  lines = []
  if "tokenize" in results:
    t = results["tokenize"]
    lines.append(f"tokenize ({t['corpus']['bytes'] / 1e6:,.0f} MB of JSONL, 2 workers; measured):")
    for name in ("byte", "bpe"):
      r = t[name]
      lines.append(f"  {name:5s} {r['measured_input_MB_per_s']:7.1f} MB/s  {r['tokens_written']:>13,} {r['dtype']} "
                   f"tokens ({r['bytes_per_token']:.2f} bytes/token, vocabulary {r['vocab_size']:,}), peak RSS "
                   f"{r['measured_peak_rss_MiB_largest_process']:,.0f} MiB")
  if "loader" in results:
    l = results["loader"]
    target = l["modelled_h100_tokens_per_s_at_50pct_mfu"]
    lines.append(f"loader (seq_len 2048 x 64, one process; target: {target / 1e3:,.0f}K tokens/s modelled for one "
                 "H100 at 50% MFU):")
    for name, r in l["settings"].items():
      lines.append(f"  {name:28s} {r['measured_tokens_per_s'] / 1e6:8.1f} M tokens/s measured "
                   f"{r['measured_over_modelled_target']:7.0f}x target  {'ok' if r['passes_100x'] else 'BELOW 100x'}")
  if "rss" in results:
    rs = results["rss"]
    lines.append(f"rss (method {rs['method']}; {rs['reader']['batches']} batches of 64 x 2048, 4 threads):")
    for name, r in rs["sizes"].items():
      peak, final = r["measured_peak_rss_bytes"] / 2**20, r["measured_final_rss_bytes"] / 2**20
      lines.append(f"  {name:4s} {r['train_tokens'] / 1e9:6.2f}B tokens  peak RSS {peak:7.0f} MiB  final {final:7.0f} "
                   "MiB (measured)")
  if "resume" in results:
    lines.append("resume (kill -9, resume, bitwise equal batches from the saved state on):")
    for name, r in results["resume"]["scenarios"].items():
      verdict = "PASS" if r["pass"] else "FAIL"
      if name.startswith("negative_control"):
        verdict += " (expected FAIL: the check detects a wrong state)"
      lines.append(f"  {name:34s} {verdict}")
    lines.append(f"  all: {'PASS' if results['resume']['pass'] else 'FAIL'}")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
