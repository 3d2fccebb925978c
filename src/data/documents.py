"""Documents for training and evaluation: where their text comes from, and the train/eval split.

Documents come from the Python standard library's source files (`data.source="stdlib"`, text every machine
has) or from the user's files (text, JSONL with a `text` field, ArrayRecord of UTF-8 records). Train and
eval are split by file (a hash of the file's name) unless `data.eval_paths` names eval files; a single file
is split by its last documents.
"""

import glob
import json
import math
import os
import pathlib
import sysconfig
import zlib

import grain

from meshmoe.config import DataConfig


class DataError(ValueError):
  """Missing, empty, unreadable or malformed data."""


def train_and_eval(cfg: DataConfig) -> tuple[list[str], list[str]]:
  """(train documents, eval documents) for the configured source."""
  if cfg.source == "stdlib":
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not {"site-packages", "__pycache__"} & set(p.parts))
    named = [(str(p.relative_to(root)), p) for p in files]
  else:
    files = _expand(cfg.paths, "data.paths")
    # Names relative to the files' common folder: the split does not depend on where the data lives.
    common = os.path.commonpath([str(p.absolute().parent) for p in files])
    named = [(os.path.relpath(p.absolute(), common), p) for p in files]
  if cfg.eval_paths.strip():
    eval_files = _expand(cfg.eval_paths, "data.eval_paths")
    train = [doc for _, path in named for doc in _read(path, cfg.source)]
    return _nonempty(train, "train"), _nonempty([d for p in eval_files for d in _read(p, cfg.source)], "eval")
  held_out = {name for name, _ in named if zlib.crc32(name.encode()) % 10_000 < cfg.eval_fraction * 10_000}
  if held_out and len(held_out) < len(named):
    train = [doc for name, path in named if name not in held_out for doc in _read(path, cfg.source)]
    evaluation = [doc for name, path in named if name in held_out for doc in _read(path, cfg.source)]
  else:  # too few files for the hash to split them: hold out the last documents instead
    train = [doc for _, path in named for doc in _read(path, cfg.source)]
    if len(train) < 2:
      raise DataError(f"cannot hold out eval data from {len(train)} document(s) in {len(named)} file(s); "
                      "add documents or name eval files in data.eval_paths")
    cut = len(train) - max(1, math.floor(len(train) * cfg.eval_fraction))
    train, evaluation = train[:cut], train[cut:]
  return _nonempty(train, "train"), _nonempty(evaluation, "eval")


def _nonempty(docs: list[str], name: str) -> list[str]:
  docs = [d for d in docs if d]
  if not docs:
    raise DataError(f"the {name} data holds no text")
  return docs


def _expand(patterns: str, field: str) -> list[pathlib.Path]:
  files: dict[str, pathlib.Path] = {}
  for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not matches:
      raise DataError(f"{field}: {pattern!r} matches no file")
    for match in matches:
      if os.path.isfile(match):
        files.setdefault(os.path.abspath(match), pathlib.Path(match))
  if not files:
    raise DataError(f"{field}: {patterns!r} names directories only; give files or glob patterns")
  return list(files.values())


def _read(path: pathlib.Path, source: str) -> list[str]:
  """The documents in one file."""
  try:
    if source == "arrayrecord":
      reader = grain.sources.ArrayRecordDataSource([str(path)])
      return [bytes(reader[i]).decode("utf-8", errors="replace") for i in range(len(reader))]
    raw = path.read_bytes()
  except OSError as e:
    raise DataError(f"cannot read {path}: {e.strerror or e}") from None
  except Exception as e:  # array_record raises its own errors for files that are not ArrayRecord
    raise DataError(f"cannot read {path} as ArrayRecord: {e}") from None
  text = raw.decode("utf-8", errors="replace")
  if source != "jsonl":
    return [text]
  docs = []
  for number, line in enumerate(text.splitlines(), start=1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"{path} line {number}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
      raise DataError(f"{path} line {number}: needs a string field 'text'")
    docs.append(record["text"])
  return docs
