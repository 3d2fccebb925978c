"""What the entry points share: the --config flag (an experiment file plus --config.a.b=v overrides),
with one clear line for a missing file or an unknown field instead of a loader traceback."""

import pathlib
import re
import sys

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
    sys.exit(f"error: unknown config override: {what}; see src/config.py for the fields")


def _check_config_path(argv: list[str]) -> None:
  for arg in argv:
    if arg.startswith("--config="):
      path = pathlib.Path(arg.split("=", 1)[1].split(":")[0])
      if not path.is_file():
        available = ", ".join(str(p.relative_to(pathlib.Path.cwd())) if p.is_relative_to(pathlib.Path.cwd())
                              else str(p) for p in sorted(DEFAULT_CONFIG.parent.glob("[!_]*.py")))
        sys.exit(f"error: --config file {str(path)!r} does not exist; available: {available}")
