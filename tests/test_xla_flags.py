"""Every flag of every XLA flag preset is accepted by the installed jaxlib (an unknown flag aborts the
process), on CPU and in a deviceless H100 compile; the check fails for a flag jaxlib does not know."""

import os
import subprocess
import sys

import pytest

from meshmoe import config
from meshmoe.analysis import deviceless
from meshmoe.runtime import xla_flags

# A collective matmul in a loop, compiled for 8 H100s without a GPU: the GPU passes the flags steer
# (scheduling, pipelining, combining, windowed einsum) all run.
_PROGRAM = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.sharding import Mesh
from meshmoe.analysis import deviceless
mesh = Mesh(deviceless.gpu_devices(8), ("x",))
def step(w, x):
  def layer(x, w):
    return jnp.tanh(x @ w), None
  return jax.lax.scan(layer, x, w)[0]
w = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x")))
x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
jax.jit(step).lower(w, x).compile()
print(float(jnp.ones(3).sum()))
"""


def _run(flags: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-c", _PROGRAM], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("preset", sorted(xla_flags.PRESETS))
def test_every_flag_of_the_preset_is_accepted(preset):
  result = _run(" ".join(xla_flags.flags(preset)))
  assert result.returncode == 0 and result.stdout.strip().endswith("3.0"), result.stderr[-2000:]


def test_the_deviceless_compile_flags_are_accepted_and_set_for_the_tests():
  result = _run(" ".join(deviceless.COMPILE_FLAGS + xla_flags.flags("overlap")))
  assert result.returncode == 0 and result.stdout.strip().endswith("3.0"), result.stderr[-2000:]
  assert all(flag in os.environ["XLA_FLAGS"] for flag in deviceless.COMPILE_FLAGS)  # tests/conftest.py


def test_an_unknown_flag_fails_the_check():
  result = _run("--xla_gpu_enable_async_collectives=true")  # documented once, rejected by jaxlib 0.11+
  assert result.returncode != 0
  assert "Unknown flag" in result.stderr


def test_config_choices_are_the_presets():
  assert set(config.XLA_FLAG_PRESETS) == set(xla_flags.PRESETS)


def test_user_flags_win_over_the_preset():
  merged = xla_flags.merged("overlap", "--xla_gpu_pipeline_all_reduce=off --xla_dump_to=/tmp/d")
  assert "--xla_gpu_pipeline_all_reduce=off" in merged and "--xla_gpu_pipeline_all_reduce=on" not in merged
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in merged and "--xla_dump_to=/tmp/d" in merged
  assert xla_flags.merged("none", " --a=1 ") == "--a=1"
  with pytest.raises(config.ConfigError, match="parallel.xla_flags='fast' is invalid: one of 'none', 'overlap'"):
    xla_flags.flags("fast")
