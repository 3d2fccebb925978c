"""Tokenize a corpus once into an indexed on-disk dataset that training reads by random access.

  python -m experiments.tokenize --source=jsonl --paths='/data/web/*.jsonl' --tokenizer=tokenizer.json \
      --out=/data/tok/web
  python -m experiments.tokenize --source=parquet --paths='/data/code/*.parquet' --out=/data/tok/code
  python -m experiments.train --config.data.source=tokenized \
      --config.data.paths=web=/data/tok/web:0.7,code=/data/tok/code:0.3 --workdir=runs/mix
  python -m experiments.tokenize --verify=/data/tok/web      # recompute every checksum of a dataset

Sources: text files (each a document), JSONL (a `text` field per line), Parquet (a `text` column),
ArrayRecord (UTF-8 records), or `stdlib`. Tokenizer: `byte` or a Hugging Face tokenizer.json (copied into
the dataset). Documents whose text hashes below --eval_fraction form the eval split (or all of
--eval_paths). Runs on every core (--workers); run the same command again after an interruption and it
continues with the unfinished units. The format and its manifest: src/data/token_store.py.
"""

import sys
import time

from absl import app, flags

_SOURCE = flags.DEFINE_enum("source", None, ["text", "jsonl", "parquet", "arrayrecord", "stdlib"],
                            "what the input files hold")
_PATHS = flags.DEFINE_string("paths", "", "comma-separated input files or glob patterns (not for stdlib)")
_EVAL_PATHS = flags.DEFINE_string("eval_paths", "", "files whose documents all form the eval split")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.005, "fraction of documents held out for eval (by hash)")
_TOKENIZER = flags.DEFINE_string("tokenizer", "byte", "'byte' or the path of a tokenizer.json")
_OUT = flags.DEFINE_string("out", None, "the dataset folder to write (or complete)")
_WORKERS = flags.DEFINE_integer("workers", 0, "worker processes (0: one per core)", lower_bound=0)
_UNIT_MB = flags.DEFINE_integer("unit_mb", 64, "MB of input per unit of work and shard", lower_bound=1)
_VERIFY = flags.DEFINE_string("verify", None, "check an existing dataset folder's files against its manifest")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  from meshmoe.config import ConfigError
  from meshmoe.data import token_store, tokenizing

  try:
    if _VERIFY.value:
      start = time.perf_counter()
      manifest = token_store.verify(_VERIFY.value)
      print(f"{manifest.folder}: every checksum matches ({_summary(manifest)}; "
            f"{time.perf_counter() - start:.1f}s)")
      return
    missing = [f"--{flag.name}" for flag in (_SOURCE, _OUT) if not flag.value]
    if missing:
      sys.exit(f"error: {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required "
               "(or --verify=FOLDER); --helpfull lists the flags")
    if (_SOURCE.value == "stdlib") == bool(_PATHS.value.strip()):
      sys.exit(f"error: --paths is required for --source={_SOURCE.value}" if _SOURCE.value != "stdlib" else
               "error: --source=stdlib reads this interpreter's standard library and takes no --paths")
    if not 0 < _EVAL_FRACTION.value < 1:
      sys.exit(f"error: --eval_fraction={_EVAL_FRACTION.value} must be strictly between 0 and 1")
    start = time.perf_counter()
    manifest = tokenizing.tokenize_corpus(
        _OUT.value, source=_SOURCE.value, paths=_PATHS.value, eval_paths=_EVAL_PATHS.value,
        eval_fraction=_EVAL_FRACTION.value, tokenizer=_TOKENIZER.value, workers=_WORKERS.value,
        unit_bytes=_UNIT_MB.value << 20)
    print(f"wrote {manifest.folder} ({_summary(manifest)}) in {time.perf_counter() - start:.1f}s")
  except (ConfigError, token_store.DataError) as e:
    sys.exit(f"error: {e}")


def _summary(manifest) -> str:
  split = lambda name: manifest.split(name)
  return (f"train {split('train')['num_tokens']:,} tokens in {split('train')['num_documents']:,} documents, "
          f"eval {split('eval')['num_tokens']:,} in {split('eval')['num_documents']:,}; vocabulary "
          f"{manifest.vocab_size:,}, {manifest.dtype.name} tokens")


if __name__ == "__main__":
  app.run(main)
