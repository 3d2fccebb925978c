"""The allocator's share of GPU memory (`train.gpu_memory_fraction`, runtime/gpu_memory.py): set from the config
before the backend starts, a different value from the environment replaced with a note, nothing said on CPU."""

import os

import pytest

from meshmoe.runtime import gpu_memory


def test_the_config_sets_the_share_and_says_when_it_replaces_the_environment(monkeypatch):
  monkeypatch.delenv(gpu_memory.FRACTION_VARIABLE, raising=False)
  assert gpu_memory.set_fraction(0.9) is None
  assert os.environ[gpu_memory.FRACTION_VARIABLE] == "0.9"
  assert gpu_memory.set_fraction(0.9) is None  # the same value: nothing to say
  note = gpu_memory.set_fraction(0.85)
  assert note == ("note: train.gpu_memory_fraction=0.85 replaces XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 from the "
                  "environment")


def test_usable_memory_is_the_share_of_the_device():
  assert gpu_memory.usable_bytes(80e9, 0.9) == pytest.approx(72e9, rel=1e-15)


def test_nothing_is_said_on_cpu():
  assert gpu_memory.describe(0.9) is None
