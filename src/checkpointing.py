"""Checkpoints with orbax: the TrainState plus the data-iterator position, saved asynchronously.

Layout: `<workdir>/checkpoints/<step>/{state,data}`. `state` is the TrainState pytree (restored straight
into the shardings of the current mesh, so a run can resume on a different layout); `data` is the JSON
state of the training data iterator, so a resumed run sees exactly the batches it would have seen.
The newest `checkpoint.keep` checkpoints are kept. A run started on a workdir that holds checkpoints
resumes from the newest one.
"""

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

from meshmoe.config import CheckpointConfig


class Checkpointer:

  def __init__(self, workdir: str | pathlib.Path, cfg: CheckpointConfig):
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                           create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict) -> None:
    """Starts saving (returns before the write finishes when async); `wait` blocks until it is on disk."""
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
    self._manager.save(step, args=args, force=True)

  def restore(self, step: int, target_state: Any) -> tuple[Any, dict]:
    """Restores checkpoint `step` into the shapes, dtypes and shardings of `target_state`."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target_state)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore())
    restored = self._manager.restore(step, args=args)
    return restored.state, restored.data

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()
