"""Checkpoints with orbax: the TrainState, the data-iterator position and a fingerprint, saved asynchronously.

Layout: `<workdir>/checkpoints/<step>/{state,data,run_state[,grad_residual]}`. `state` is the TrainState
pytree (restored straight into the shardings of the current mesh, so a run can resume on a different
layout); `data` is the JSON state of the training data iterator, so a resumed run sees exactly the batches it
would have seen; `run_state` holds the count of skipped non-finite steps and a fingerprint of every array
of `state` and the name of the optimizer whose state it holds (`optimizer.name`; checkpoints without one were
written by AdamW, the only optimizer then) and the dtype of its statistics (`optimizer.moments_dtype`;
float32 where none is recorded): a run with another optimizer or dtype is refused with one ConfigError
before anything is read. The newest `checkpoint.keep` checkpoints are kept. Every process calls save and restore; orbax
coordinates them.

The error-feedback residual of a compressed gradient sum (TrainState.grad_residual) is its own item, so a
run can turn compression on or off when it resumes: a residual the checkpoint lacks starts from zero (said
in a message), one the run no longer keeps is left on disk.

Restoring never trusts the newest checkpoint blindly. `restore_latest` tries the checkpoints newest first:
one that cannot be read (a truncated or deleted file, garbled metadata) or whose arrays do not match their
fingerprint (a flipped bit that the file format accepts) is reported with the reason, and the next older
one is tried. Once one restores, the unusable newer ones are moved to `<workdir>/checkpoints_unusable/`
(never deleted: they are the user's data, and left in place they would collide with the steps the run is
about to save again). Leftovers of an interrupted save (orbax writes into a `*.orbax-checkpoint-tmp*`
folder and renames it when complete) are moved there too, with a message. When no checkpoint restores,
nothing is moved and the run stops with an error listing what failed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from meshmoe.config import CheckpointConfig, ConfigError
from meshmoe.runtime import distributed

_TMP_MARKER = ".orbax-checkpoint-tmp"
# TrainState's error-feedback field, the checkpoint item that holds it and the prefix of its arrays'
# fingerprints: all three are on disk, so the name stays what existing checkpoints use.
_GRAD_RESIDUAL = "grad_residual"


def _without_grad_residual(state: Any) -> tuple[Any, Any]:
  """(the state without its error-feedback residual, that residual or None)."""
  grad_residual = getattr(state, _GRAD_RESIDUAL, None)
  return (state if grad_residual is None else dataclasses.replace(state, grad_residual=None)), grad_residual


class CheckpointError(RuntimeError):
  """No checkpoint in the workdir could be restored."""


@dataclasses.dataclass
class Restored:
  step: int
  state: Any
  data_state: dict
  skipped_steps: int
  saved_fingerprints: dict | None  # None for checkpoints written before fingerprints existed


class Checkpointer:

  def __init__(self, workdir: str | pathlib.Path, cfg: CheckpointConfig, optimizer: str = "adamw",
               moments_dtype: str = "float32"):
    self.optimizer = optimizer  # the name of the optimizer whose state this run saves and restores
    self.moments_dtype = moments_dtype  # the dtype its statistics are kept in (optimizer.moments_dtype)
    self.directory = pathlib.Path(workdir).absolute() / "checkpoints"
    self.unusable_directory = self.directory.parent / "checkpoints_unusable"
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
                                           create=True)
    self._manager = _Manager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: Any, data_state: dict, skipped_steps: int = 0) -> None:
    """Starts saving (returns before the write finishes when async); `wait` blocks until it is on disk."""
    core, grad_residual = _without_grad_residual(state)
    run_state = {"skipped_steps": skipped_steps, "fingerprints": fingerprints(state), "optimizer": self.optimizer,
                 "moments_dtype": self.moments_dtype}
    items = dict(state=ocp.args.StandardSave(core), data=ocp.args.JsonSave(data_state),
                 run_state=ocp.args.JsonSave(run_state))
    if grad_residual is not None:
      items[_GRAD_RESIDUAL] = ocp.args.StandardSave(grad_residual)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)

  def restore(self, step: int, target_state: Any) -> Restored:
    """Restores checkpoint `step` into the shapes, dtypes and shardings of `target_state`, verified against
    its fingerprints; raises when it cannot be read or does not match them."""
    self._check_optimizer(step)
    restored, error = self._read(step, target_state)
    if error is None:
      error = self._verify(restored)
    if error is not None:
      raise CheckpointError(f"checkpoint {step} in {self.directory}: {error}")
    return restored

  def restore_latest(self, target_state: Any) -> Restored | None:
    """The newest checkpoint that restores and verifies, falling back to older ones (see module doc);
    None when there is no checkpoint at all."""
    self._set_aside_unfinished_saves()
    failed: list[tuple[int, str]] = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      self._check_optimizer(step)
      restored, error = self._read(step, target_state)
      error = _agree(error)
      if error is None:
        error = self._verify(restored)
      if error is None:
        for bad_step, _ in failed:
          self._set_aside(self.directory / str(bad_step), f"unusable checkpoint {bad_step}")
        return restored
      failed.append((step, error))
      print(f"warning: checkpoint {step} in {self.directory} cannot be used: {error}; trying the previous one",
            flush=True)
    if failed:
      tried = "; ".join(f"step {step}: {error}" for step, error in failed)
      raise CheckpointError(f"no checkpoint in {self.directory} can be restored ({tried}). Nothing was moved "
                            "or deleted; move the folder away to start from scratch")
    return None

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()

  def _check_optimizer(self, step: int) -> None:
    """Raises ConfigError when checkpoint `step` holds another optimizer's state (an unreadable record is
    left for `_read` to report)."""
    if not (self.directory / str(step) / "run_state").is_dir():
      return
    try:
      run_state = self._manager.restore(step, args=ocp.args.Composite(run_state=ocp.args.JsonRestore())).run_state
    except Exception:  # noqa: BLE001 - reported by _read with the rest of the checkpoint
      return
    if not isinstance(run_state, dict):
      return
    saved = run_state.get("optimizer", "adamw")
    if saved != self.optimizer:
      raise ConfigError("optimizer.name", self.optimizer,
                        f"{saved!r}, the optimizer whose state checkpoint {step} in {self.directory} holds (one "
                        "optimizer's state cannot become another's: resume with it, or start a new workdir)")
    saved = run_state.get("moments_dtype", "float32")
    if saved != self.moments_dtype:
      raise ConfigError("optimizer.moments_dtype", self.moments_dtype,
                        f"{saved!r}, the dtype checkpoint {step} in {self.directory} holds its optimizer statistics "
                        "in (resume with it, or start a new workdir)")

  def _read(self, step: int, target_state: Any) -> tuple[Restored | None, str | None]:
    abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
    core, grad_residual = _without_grad_residual(target_state)
    items = {"state": ocp.args.StandardRestore(abstract(core)), "data": ocp.args.JsonRestore()}
    has_run_state = (self.directory / str(step) / "run_state").is_dir()  # older checkpoints have none
    if has_run_state:
      items["run_state"] = ocp.args.JsonRestore()
    saved_grad_residual = grad_residual is not None and self._grad_residual_fits(step, grad_residual)
    if saved_grad_residual:
      items[_GRAD_RESIDUAL] = ocp.args.StandardRestore(abstract(grad_residual))
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax and tensorstore raise many types; each means "this one is unreadable"
      return None, _summary(e)
    run_state = out.run_state if has_run_state else {}
    saved = run_state.get("fingerprints")
    state = out.state
    if saved_grad_residual:
      state = dataclasses.replace(state, grad_residual=out[_GRAD_RESIDUAL])
    elif grad_residual is not None:
      state = dataclasses.replace(state, grad_residual=jax.tree.map(
          lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), grad_residual))
    if saved is not None and not saved_grad_residual:  # what is not restored is not checked
      saved = {name: value for name, value in saved.items() if not name.startswith(_GRAD_RESIDUAL)}
    return Restored(step, state, out.data, run_state.get("skipped_steps", 0), saved), None

  def _grad_residual_fits(self, step: int, grad_residual: Any) -> bool:
    """Whether checkpoint `step` holds an error-feedback residual of `grad_residual`'s shapes; says why not when
    it does not (saved without feedback, or for another number of data replicas): it then starts from zero."""
    path = self.directory / str(step) / _GRAD_RESIDUAL
    if not path.is_dir():
      reason = "none (saved without parallel.gradient_compression's error feedback)"
    else:
      with ocp.PyTreeCheckpointer() as checkpointer:
        tree = checkpointer.metadata(path).item_metadata.tree
      saved, wanted = _shapes_by_name(tree), _shapes_by_name(grad_residual)
      if saved == wanted:
        return True
      reason = f"one of shapes {saved}, not {wanted} (another mesh)"
    print(f"note: checkpoint {step} holds {reason} for the error-feedback residual of the experts' compressed "
          "gradient sum: it starts from zero", flush=True)
    return False

  def _verify(self, restored: Restored) -> str | None:
    saved = restored.saved_fingerprints
    if saved is None:
      return None
    actual = {name: value for name, value in fingerprints(restored.state).items()
              if name in saved or not name.startswith(_GRAD_RESIDUAL)}
    wrong = [name for name, value in actual.items() if saved.get(name) != value]
    if wrong or saved.keys() != actual.keys():
      listed = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
      return f"arrays that do not match their saved fingerprint: {listed or 'a different set of arrays'}"
    return None

  def _set_aside_unfinished_saves(self) -> None:
    unfinished = sorted(self.directory.glob(f"*{_TMP_MARKER}*"))
    # Every process lists them before process 0 moves any: a process listing later would find none, skip
    # the barriers of _set_aside, and leave the others waiting there: a resume after a kill mid-save would hang.
    distributed.barrier("meshmoe: listed unfinished saves")
    for path in unfinished:
      self._set_aside(path, f"the unfinished save {path.name} (the run stopped while writing it)")

  def _set_aside(self, path: pathlib.Path, what: str) -> None:
    target = self.unusable_directory / path.name
    if target.exists():
      target = target.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}")
    if jax.process_index() == 0:
      target.parent.mkdir(parents=True, exist_ok=True)
      shutil.move(path, target)
      print(f"moved {what} from {path.parent} to {target}", flush=True)
    distributed.barrier(f"meshmoe: set aside {path.name}")
    self._manager.reload()


class _Manager(ocp.CheckpointManager):
  """orbax's manager, minus its own look at JAX's preemption sync point.

  The training loop alone asks for the sync point (meshmoe.runtime.resilience.Preemption), once per step with the
  step number. orbax also asks, from its background thread when a save completes, with that save's older
  step; JAX keeps the latest number it was given, so such a call landing as a SIGTERM arrives could set
  the agreed stop step behind the loop, which would then never reach it."""

  def reached_preemption(self, step: int) -> bool:
    return False


def _shapes_by_name(tree: Any) -> dict[str, tuple[int, ...]]:
  """Each leaf's shape by its path's last key (a residual restored as a dict or as its dataclass alike)."""
  return {jax.tree_util.keystr(path[-1:], simple=True): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def fingerprints(state: Any) -> dict[str, int]:
  """Per array of `state`, the sum of its 32-bit words modulo 2**32: integer addition in any order gives
  the same value on any mesh, and any changed bit changes it."""
  paths_and_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  names = [jax.tree_util.keystr(path, simple=True, separator="/") for path, _ in paths_and_leaves]
  leaves = [leaf for _, leaf in paths_and_leaves]
  replicated = jax.sharding.NamedSharding(leaves[0].sharding.mesh, jax.sharding.PartitionSpec())
  sums = jax.jit(lambda xs: [_word_sum(x) for x in xs], out_shardings=replicated)(leaves)
  return {name: int(value) for name, value in zip(names, sums, strict=True)}


def _word_sum(x: jax.Array) -> jax.Array:
  if x.dtype == jnp.bool_:
    words = x.astype(jnp.uint32)
  else:
    words = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")).astype(jnp.uint32)
  return jnp.sum(words, dtype=jnp.uint32)


def _summary(error: Exception) -> str:
  first_line = (str(error).strip().splitlines() or [""])[0]
  return f"{type(error).__name__}: {first_line[:300]}"


def _agree(error: str | None) -> str | None:
  """Every process's verdict on one checkpoint: unusable when any process could not read it."""
  if jax.process_count() == 1:
    return error
  from jax.experimental import multihost_utils

  failed = multihost_utils.process_allgather(np.int32(error is not None))
  if error is None and failed.any():
    bad = [int(p) for p in np.flatnonzero(failed)]
    return f"process(es) {bad} could not read it (see their logs)"
  return error


