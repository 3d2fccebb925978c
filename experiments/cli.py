"""What the entry points share: the --config flag (an experiment file plus --config.a.b=v overrides),
with one clear line for a missing file or an unknown field instead of a loader traceback; and output
paths checked before the work that fills them (a compile can take minutes)."""

import pathlib
import re
import sys
import tempfile

from ml_collections import config_flags

DEFAULT_CONFIG = pathlib.Path(__file__).parent / "configs" / "tiny_moe.py"


def define_config_flag(argv: list[str]) -> None:
  """Defines --config (default tiny_moe); defining it loads the file and applies the overrides in argv."""
  _check_config_path(argv)
  try:
    config_flags.DEFINE_config_file(
        "config", str(DEFAULT_CONFIG), "experiment config file (a .py with get_config()); override fields "
        "with --config.<section>.<field>=<value>", lock_config=False)
  except KeyError as e:  # ml_collections reports an unknown --config.a.b field as a bare KeyError
    match = re.search(r"Field (\w+) not found on dataclass <class '[\w.]+\.(\w+)'>", str(e))
    what = f"field {match.group(1)!r} does not exist in {match.group(2)}" if match else str(e)
    moved = _MOVED_FIELDS.get((match.group(2), match.group(1))) if match else None
    if moved:
      sys.exit(f"error: unknown config override: {what}; it moved to --config.{moved}")
    sys.exit(f"error: unknown config override: {what}; see src/config.py for the fields")


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
