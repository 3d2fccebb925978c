"""Fault injection for the device timelines (device_timeline.py): one chosen device made slow on purpose.

`resilience.debug_slow_device` (a device id; -1, the default: none) sleeps `debug_slow_device_s` seconds
inside every train step, in a host callback that runs on that device alone (inside shard_map, so each
device runs its own copy and only the chosen one sleeps) before the forward pass uses the batch. Its compute
segment lengthens and every other device waits for it at the step's first collective, as for a throttled
GPU. Never set in a real run: it exists for the tests and to watch the attribution at work.

The wrapped step is a new jitted function named `train_step` around the trainer's own, so the device
timelines find it under the same module name, and the trainer's step is left exactly as it is compiled
without the injection.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from meshmoe.config import ConfigError
from meshmoe.sharding.plan import ParallelPlan


def slowed(step_fn, plan: ParallelPlan, device_id: int, seconds: float, state_shardings):
  """`step_fn(state, batch)` with device `device_id` sleeping `seconds` in every step (module docstring)."""
  mesh = plan.mesh
  order = [d.id for d in mesh.devices.flat]
  if device_id not in order:
    raise ConfigError("resilience.debug_slow_device", device_id, f"-1 or the id of a device of the mesh: {order}")
  position = order.index(device_id)  # the device's linear index over the mesh axes, in order
  axes = tuple(mesh.axis_names)

  def sleep_if_chosen(index):
    if int(index) == position:
      time.sleep(seconds)
    return np.zeros((), np.int32)

  def delay(inputs):
    zero = jax.pure_callback(sleep_if_chosen, jax.ShapeDtypeStruct((), jnp.int32), jax.lax.axis_index(axes))
    return inputs + zero

  batch_spec = plan.batch_sharding().spec
  spread = jax.shard_map(delay, mesh=mesh, in_specs=PartitionSpec(*batch_spec), out_specs=PartitionSpec(*batch_spec),
                         check_vma=False)

  def train_step(state, batch):
    return step_fn(state, {**batch, "inputs": spread(batch["inputs"])})

  return jax.jit(train_step, in_shardings=(state_shardings, None), out_shardings=(state_shardings,
                                                                                 plan.replicated()),
                 donate_argnums=0)
