"""The checks behind every config section's validation, and the one error they raise (meshmoe.config).

Each check raises `ConfigError` naming the field, the value and what is allowed. Plain data, like the rest
of meshmoe.config: it imports nothing of meshmoe.
"""

import math
from typing import Any


class ConfigError(ValueError):
  """An invalid configuration value: names the field, the value and what is allowed."""

  def __init__(self, field: str, value: Any, allowed: str):
    self.field, self.value, self.allowed = field, value, allowed
    super().__init__(f"config.{field}={value!r} is invalid: {allowed}")


def is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(field: str, value: Any, minimum: int, allowed: str) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ConfigError(field, value, allowed)


def check_bool(field: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise ConfigError(field, value, "True or False")


def check_non_negative(field: str, value: Any, allowed: str = "a finite number >= 0") -> None:
  if not is_number(value) or not 0 <= value < math.inf:
    raise ConfigError(field, value, allowed)


def check_fraction(field: str, value: Any, allowed: str) -> None:
  if not is_number(value) or not 0 <= value <= 1:
    raise ConfigError(field, value, allowed)


def check_positive_int(field: str, value: Any) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ConfigError(field, value, "a positive integer")


def check_positive_float(field: str, value: Any, allowed: str = "a finite number > 0") -> None:
  if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or math.isinf(value):
    raise ConfigError(field, value, allowed)


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ConfigError(field, value, "one of " + ", ".join(repr(c) for c in choices))
