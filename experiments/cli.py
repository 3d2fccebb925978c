"""What the entry points share: the --config flag (an experiment file plus --config.a.b=v overrides),
with one clear line for a missing file or an unknown field instead of a loader traceback; and output
paths checked before the work that fills them (a compile can take minutes)."""

import dataclasses
import difflib
import pathlib
import sys
import tempfile

from ml_collections import config_flags

from meshmoe import config as meshmoe_config

DEFAULT_CONFIG = pathlib.Path(__file__).parent / "configs" / "tiny_moe.py"
# Where the config sections' fields are documented (meshmoe.config gathers them from these files).
_FIELDS_DOC = "src/config_model.py, src/config_parallel.py and src/config_run.py"


def define_config_flag(argv: list[str]) -> None:
  """Defines --config (default tiny_moe); defining it loads the file and applies the overrides in argv."""
  _check_config_path(argv)
  try:
    config_flags.DEFINE_config_file(
        "config", str(DEFAULT_CONFIG), "experiment config file (a .py with get_config()); override fields "
        "with --config.<section>.<field>=<value>", lock_config=False)
  except KeyError as e:  # ml_collections reports an unknown --config.a.b field as a bare KeyError
    sys.exit(f"error: unknown config override: {_unknown_override(argv, e)}")


def _unknown_override(argv: list[str], error: KeyError) -> str:
  """What is wrong with the first --config.<path> override that names no field of the config, the field
  most likely meant (the same name in another section, else the closest name in its section) and the
  section's fields."""
  root = meshmoe_config.Config()
  fields = list(_field_paths(root))
  for arg in argv:
    path = arg.removeprefix("--config.").split("=", 1)[0]
    if not arg.startswith("--config.") or path in fields or _section(root, path) is not None:
      continue  # not an override, or a field or section that exists
    parent, _, name = path.rpartition(".")
    section = _section(root, parent)
    if section is None:
      what, siblings = f"--config.{path} names no config field", []
    else:
      kind = type(section).__name__
      what, siblings = f"field {name!r} does not exist in {kind}", [f.name for f in dataclasses.fields(section)]
      if (kind, name) in _MOVED_FIELDS:
        return f"{what}; it moved to --config.{_MOVED_FIELDS[kind, name]}"
    same_name = [p for p in fields if p.rpartition(".")[2] == name]
    close = [f"{parent}.{n}" if parent else n for n in difflib.get_close_matches(name, siblings, n=1)]
    guess = (same_name or close)[:1]
    hint = f"did you mean --config.{guess[0]}? " if guess else ""
    listing = f"{kind}'s fields: {', '.join(siblings)}" if siblings else f"every field: {_FIELDS_DOC}"
    return f"{what}; {hint}{listing}"
  return f"{error}; see {_FIELDS_DOC} for the fields"


def _field_paths(section, prefix: str = ""):
  """The dotted path of every leaf field of a config dataclass instance."""
  for field in dataclasses.fields(section):
    value = getattr(section, field.name)
    if dataclasses.is_dataclass(value):
      yield from _field_paths(value, f"{prefix}{field.name}.")
    else:
      yield prefix + field.name


def _section(root, path: str):
  """The config dataclass at a dotted path of `root` ("" is the root), or None."""
  section = root
  for name in filter(None, path.split(".")):
    section = getattr(section, name, None)
  return section if dataclasses.is_dataclass(section) else None


# Fields that moved between config sections: (dataclass, old field) -> the new --config path.
_MOVED_FIELDS = {
    ("MoEConfig", "gemm_impl"): "parallel.grouped_gemm",  # an implementation choice, not model math
    ("MoEConfig", "gemm_block_rows"): "parallel.gemm_block_rows",
}


def experiment_configs() -> list[pathlib.Path]:
  """The experiment config files shipped in experiments/configs/, sorted."""
  return sorted(DEFAULT_CONFIG.parent.glob("[!_]*.py"))


def _check_config_path(argv: list[str]) -> None:
  for arg in argv:
    if arg.startswith("--config="):
      path = pathlib.Path(arg.split("=", 1)[1].split(":")[0])
      if not path.is_file():
        available = ", ".join(str(p.relative_to(pathlib.Path.cwd())) if p.is_relative_to(pathlib.Path.cwd())
                              else str(p) for p in experiment_configs())
        sys.exit(f"error: --config file {str(path)!r} does not exist; available: {available}")


def writable_output(path: str | None, flag: str) -> pathlib.Path | None:
  """The output file of `--flag`, its folder created; exits with one line if it cannot be written.

  Called before compiling, so that a mistyped path costs nothing instead of the compiled result."""
  if path is None:
    return None
  out = pathlib.Path(path)
  try:
    if out.is_dir():
      raise OSError(f"{out} is a folder")
    _make_folder(out.parent)
    # Open it the way it will be written (os.access says yes to root even where the kernel says no);
    # a file that did not exist is removed again, so a failed run leaves nothing behind.
    existed = out.exists()
    with open(out, "a"):
      pass
    if not existed:
      out.unlink()
  except OSError as e:
    sys.exit(f"error: --{flag}={path} cannot be written ({e.strerror or e}); give a file path in a writable folder")
  return out


def writable_folder(path: pathlib.Path, flag: str) -> None:
  """Creates the folder of `--flag` if needed; exits with one line if files cannot be written in it."""
  try:
    _make_folder(path)
    with tempfile.TemporaryFile(dir=path):  # a unique name: the processes of a job share the folder
      pass
  except OSError as e:
    sys.exit(f"error: --{flag}={path} cannot be written ({e.strerror or e}); give a writable folder")


def _make_folder(path: pathlib.Path) -> None:
  # mkdir alone would say "File exists" or "Not a directory" for a file in the way; name the file.
  blocking = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
  if blocking:
    raise OSError(f"{blocking} is a file, not a folder")
  path.mkdir(parents=True, exist_ok=True)
