"""Raw documents: where their text comes from, cut into units of work for tokenizing.

Sources: this interpreter's standard-library source files (`stdlib`, text every machine has), or files of
text (each file a document), JSONL (a `text` field per line), Parquet (a `text` column) or ArrayRecord
(UTF-8 text records). A *unit* is a piece of one or more files of about `unit_bytes` of input: a group of
small files, a line-aligned byte range of a JSONL file, a range of Parquet row groups or ArrayRecord records.
Units are what the tokenizer's worker processes take one at a time, and each becomes one shard: a corpus of
one huge file still tokenizes on every core, and an interrupted run resumes at the first unfinished unit.

Which documents are held out for evaluation: all of `eval_paths` when given; else each document whose text
hashes (CRC-32) below `eval_fraction`. The hash of the text, not of its position, so the split does not
depend on how the corpus is cut into files or units, and identical documents never straddle it. A corpus
too small for any document to hash below the fraction holds out its last documents (tokenizing.py).
"""

import dataclasses
import glob
import json
import os
import pathlib
import sysconfig
import zlib

from meshmoe.data.token_store import DataError

__all__ = ["DataError", "Unit", "stdlib_files", "expand", "units", "read_unit", "is_eval"]

SOURCES = ("stdlib", "text", "jsonl", "parquet", "arrayrecord")


@dataclasses.dataclass(frozen=True)
class Unit:
  source: str  # "text" for stdlib too
  files: tuple[str, ...]
  start: int = 0  # jsonl: byte range; parquet: row-group range; arrayrecord: record range
  stop: int = 0
  split: str = "hash"  # "hash": split by eval_fraction; "eval": every document is held out


def stdlib_files() -> list[pathlib.Path]:
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  return sorted(p for p in root.rglob("*.py") if not {"site-packages", "__pycache__"} & set(p.parts))


def expand(patterns: str, field: str) -> list[pathlib.Path]:
  """The files a comma-separated list of files or glob patterns names, in order, without duplicates."""
  files: dict[str, pathlib.Path] = {}
  for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
    matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
    if not matches:
      raise DataError(f"{field}: {pattern!r} matches no file")
    for match in matches:
      if os.path.isfile(match):
        files.setdefault(os.path.abspath(match), pathlib.Path(match).absolute())
  if not files:
    raise DataError(f"{field}: {patterns!r} names directories only; give files or glob patterns")
  return list(files.values())


def units(source: str, files: list[pathlib.Path], split: str, unit_bytes: int) -> list[Unit]:
  """The units of work that together read every document of `files` once, in order."""
  if source in ("stdlib", "text"):
    out, group, size = [], [], 0
    for path in files:
      group.append(str(path))
      size += _size(path)
      if size >= unit_bytes:
        out.append(Unit("text", tuple(group), split=split))
        group, size = [], 0
    return out + ([Unit("text", tuple(group), split=split)] if group else [])
  out = []
  for path in files:
    if source == "jsonl":
      bounds = _line_bounds(path, unit_bytes)
      out += [Unit(source, (str(path),), a, b, split) for a, b in zip(bounds, bounds[1:])]
    elif source == "parquet":
      sizes = _parquet_row_group_bytes(path)
      out += [Unit(source, (str(path),), a, b, split) for a, b in _ranges(sizes, unit_bytes)]
    else:
      count = _array_record_count(path)
      per_record = _size(path) / max(count, 1)
      out += [Unit(source, (str(path),), a, b, split) for a, b in _ranges([per_record] * count, unit_bytes)]
  return out


def read_unit(unit: Unit) -> list[str]:
  """The documents of one unit, in order."""
  if unit.source == "text":
    return [_read_bytes(pathlib.Path(p)).decode("utf-8", errors="replace") for p in unit.files]
  path = pathlib.Path(unit.files[0])
  if unit.source == "jsonl":
    return _jsonl_documents(path, unit.start, unit.stop)
  if unit.source == "parquet":
    return _parquet_documents(path, unit.start, unit.stop)
  return _array_record_documents(path, unit.start, unit.stop)


def is_eval(text: str, eval_fraction: float) -> bool:
  return zlib.crc32(text.encode("utf-8", errors="replace")) % 100_000 < eval_fraction * 100_000


def _size(path: pathlib.Path) -> int:
  try:
    return path.stat().st_size
  except OSError as e:
    raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _read_bytes(path: pathlib.Path) -> bytes:
  try:
    return path.read_bytes()
  except OSError as e:
    raise DataError(f"cannot read {path}: {e.strerror or e}") from None


def _ranges(sizes: list[float], unit_bytes: int) -> list[tuple[int, int]]:
  """Consecutive index ranges whose sizes add up to about unit_bytes each."""
  out, start, size = [], 0, 0.0
  for i, s in enumerate(sizes):
    size += s
    if size >= unit_bytes:
      out.append((start, i + 1))
      start, size = i + 1, 0.0
  return out + ([(start, len(sizes))] if start < len(sizes) else [])


def _line_bounds(path: pathlib.Path, unit_bytes: int) -> list[int]:
  """Byte offsets that cut a JSONL file into ranges of whole lines of about unit_bytes each."""
  size, bounds = _size(path), [0]
  with open(path, "rb") as f:
    while bounds[-1] + unit_bytes < size:
      f.seek(bounds[-1] + unit_bytes)
      f.readline()  # to the end of the line the cut falls in
      if f.tell() >= size:
        break
      bounds.append(f.tell())
  return bounds + [size]


def _jsonl_documents(path: pathlib.Path, start: int, stop: int) -> list[str]:
  docs = []
  with open(path, "rb") as f:
    f.seek(start)
    # Lines end at "\n" only: a bare "\r" is whitespace inside JSON (splitlines would cut there too).
    for number, line in enumerate(f.read(stop - start).split(b"\n")):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
        problem = None if isinstance(record, dict) and isinstance(record.get("text"), str) else (
            "needs a string field 'text'")
      except json.JSONDecodeError as e:
        problem = f"not valid JSON ({e.msg})"
      if problem:
        raise DataError(f"{path} line {_line_number(path, start) + number}: {problem}")
      docs.append(record["text"])
  return docs


def _line_number(path: pathlib.Path, offset: int) -> int:
  """The number of the line that starts at byte `offset`, for error messages (only they pay the scan)."""
  count, done = 1, 0
  with open(path, "rb") as f:
    while done < offset:
      block = f.read(min(1 << 24, offset - done))
      count, done = count + block.count(b"\n"), done + len(block)
  return count


def _parquet_row_group_bytes(path: pathlib.Path) -> list[int]:
  meta = _parquet_file(path).metadata
  return [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]


def _parquet_file(path: pathlib.Path):
  import pyarrow.parquet as pq  # only Parquet sources need it

  try:
    return pq.ParquetFile(path)
  except Exception as e:  # pyarrow raises ArrowInvalid / OSError for files that are not Parquet
    raise DataError(f"cannot read {path} as Parquet: {e}") from None


def _parquet_documents(path: pathlib.Path, start: int, stop: int) -> list[str]:
  parquet = _parquet_file(path)
  if "text" not in parquet.schema_arrow.names:
    raise DataError(f"{path}: Parquet sources need a string column 'text'; it has {parquet.schema_arrow.names}")
  column = parquet.read_row_groups(list(range(start, stop)), columns=["text"]).column("text")
  docs = column.to_pylist()
  if any(not isinstance(d, str) for d in docs):
    bad = next(i for i, d in enumerate(docs) if not isinstance(d, str))
    raise DataError(f"{path}: row {bad} of row groups {start}-{stop - 1} has no string in column 'text'")
  return docs


def _array_record_reader(path: pathlib.Path):
  import grain  # only ArrayRecord sources need it (and it is slow to import in tokenizer workers)

  try:
    return grain.sources.ArrayRecordDataSource([str(path)])
  except Exception as e:  # array_record raises its own errors for files that are not ArrayRecord
    raise DataError(f"cannot read {path} as ArrayRecord: {e}") from None


def _array_record_count(path: pathlib.Path) -> int:
  return len(_array_record_reader(path))


def _array_record_documents(path: pathlib.Path, start: int, stop: int) -> list[str]:
  reader = _array_record_reader(path)
  try:
    return [bytes(reader[i]).decode("utf-8", errors="replace") for i in range(start, stop)]
  except Exception as e:
    raise DataError(f"{path}: cannot read records {start}-{stop - 1} ({e})") from None
