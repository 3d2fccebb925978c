"""Checkpoint restore falls back from unreadable, tampered or unfinished checkpoints, says so, and never
deletes anything; fingerprints do not depend on the mesh layout."""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from meshmoe.config import CheckpointConfig, MeshConfig
from meshmoe.training import train_step
from meshmoe.training.checkpointing import Checkpointer, CheckpointError, fingerprints
from tests.model_steps import plan_for
from tests.test_model_sharded import small_config


def _state(value: float, spec=PartitionSpec("x")) -> dict:
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
  # Random values, large enough that the array's data file is the checkpoint's largest file.
  w = jax.random.normal(jax.random.key(0), (64, 256), jnp.float32) * value
  return {"w": put(w, spec),
          "count": put(jnp.int32(value), PartitionSpec())}


@pytest.fixture
def saved(tmp_path) -> Checkpointer:
  """Checkpoints of steps 1, 2, 3 holding states 1, 2, 3; the checkpointer reopened as a new run would."""
  checkpointer = Checkpointer(tmp_path, CheckpointConfig(keep=5))
  for step in (1, 2, 3):
    checkpointer.save(step, _state(step), {"next_index": step}, skipped_steps=step - 1)
  checkpointer.wait()
  checkpointer.close()
  return Checkpointer(tmp_path, CheckpointConfig(keep=5))


def _check_restored(restored, step: int) -> None:
  assert restored.step == step and restored.data_state == {"next_index": step}
  assert restored.skipped_steps == step - 1
  np.testing.assert_array_equal(np.asarray(restored.state["w"]), np.asarray(_state(step)["w"]))


def test_the_newest_checkpoint_restores_when_intact(saved, capsys):
  _check_restored(saved.restore_latest(_state(0)), 3)
  assert "warning" not in capsys.readouterr().out


@pytest.mark.parametrize("damage", ["truncate", "delete", "metadata"])
def test_an_unreadable_newest_checkpoint_falls_back_and_is_kept(saved, tmp_path, capsys, damage):
  newest = tmp_path / "checkpoints" / "3"
  data_files = sorted((p for p in (newest / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
                      key=lambda p: p.stat().st_size)
  if damage == "truncate":
    os.truncate(data_files[-1], data_files[-1].stat().st_size // 2)
  elif damage == "delete":
    data_files[-1].unlink()
  else:
    (newest / "state" / "_METADATA").write_text("{not json")
  _check_restored(saved.restore_latest(_state(0)), 2)
  out = capsys.readouterr().out
  assert f"warning: checkpoint 3 in {tmp_path / 'checkpoints'} cannot be used: " in out
  assert f"moved unusable checkpoint 3 from {tmp_path / 'checkpoints'} to {tmp_path / 'checkpoints_unusable' / '3'}" in out
  assert (tmp_path / "checkpoints_unusable" / "3" / "state").is_dir()
  assert saved.latest_step() == 2


def test_a_flipped_bit_is_caught_by_the_fingerprint(saved, tmp_path, capsys):
  run_state = tmp_path / "checkpoints" / "3" / "run_state" / "metadata"
  recorded = json.loads(run_state.read_text())
  recorded["fingerprints"]["w"] ^= 1 << 7  # as if one bit of w had changed on disk
  run_state.write_text(json.dumps(recorded))
  _check_restored(saved.restore_latest(_state(0)), 2)
  assert "cannot be used: arrays that do not match their saved fingerprint: w" in capsys.readouterr().out


def test_an_unfinished_save_is_moved_aside_with_a_message(saved, tmp_path, capsys):
  leftover = tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp-123"
  (leftover / "state").mkdir(parents=True)
  _check_restored(saved.restore_latest(_state(0)), 3)
  assert f"moved the unfinished save {leftover.name} (the run stopped while writing it)" in capsys.readouterr().out
  assert (tmp_path / "checkpoints_unusable" / leftover.name / "state").is_dir()


def test_when_nothing_restores_nothing_is_moved(saved, tmp_path):
  for step in (1, 2, 3):
    (tmp_path / "checkpoints" / str(step) / "state" / "_METADATA").write_text("{")
  with pytest.raises(CheckpointError, match=r"no checkpoint in .* can be restored \(step 3: .*; step 2: .*; "
                                            r"step 1: .*\)\. Nothing was moved or deleted"):
    saved.restore_latest(_state(0))
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["1", "2", "3"]
  assert not (tmp_path / "checkpoints_unusable").exists()


def test_no_checkpoint_means_a_fresh_start(tmp_path):
  assert Checkpointer(tmp_path, CheckpointConfig()).restore_latest(_state(0)) is None


def test_fingerprints_are_the_same_on_any_layout_and_see_every_bit():
  split, replicated = _state(3.0), _state(3.0, PartitionSpec())
  assert fingerprints(split) == fingerprints(replicated)
  words = np.asarray(split["w"]).view(np.uint32).astype(np.uint64)
  assert fingerprints(split)["w"] == int(words.sum() % 2**32)  # the documented definition
  flipped = np.asarray(split["w"]).copy()
  flipped.view(np.uint32)[5, 2] ^= 1 << 30
  assert fingerprints({**split, "w": jax.device_put(flipped, split["w"].sharding)})["w"] != fingerprints(split)["w"]


def test_unusable_folder_names_never_clash(saved, tmp_path):
  (tmp_path / "checkpoints_unusable" / "3").mkdir(parents=True)  # an earlier fallback's
  (tmp_path / "checkpoints" / "3" / "state" / "_METADATA").write_text("{")
  _check_restored(saved.restore_latest(_state(0)), 2)
  moved = sorted(p.name for p in (tmp_path / "checkpoints_unusable").iterdir())
  assert moved[0] == "3" and moved[1].startswith("3.") and len(moved) == 2
  assert pathlib.Path(tmp_path / "checkpoints_unusable" / moved[1] / "state").is_dir()


@pytest.mark.parametrize("restore_as", ["data", "preset", "all"])
def test_a_run_with_weights_stored_over_data_saves_and_restores(tmp_path, restore_as):
  """A train state whose weights and moments are stored split over `data` (mesh.weight_storage="data")
  restores bit for bit, into the same storage or, resharded, into another one (a run may change it when it
  resumes)."""
  states = {}
  for name, storage, seed in (("saved", "data", 0), ("target", restore_as, 1)):
    config = small_config()
    config.mesh = MeshConfig(data=2, expert=2, sequence=2, preset="megascale", weight_storage=storage)
    config.train.seed = seed  # the target starts from other values: what it holds after restoring was read
    states[name] = train_step.create(config, plan_for(config))[1]
  checkpointer = Checkpointer(tmp_path, CheckpointConfig())
  checkpointer.save(1, states["saved"], {"next_index": 1})
  checkpointer.wait()
  restored = checkpointer.restore(1, states["target"])
  checkpointer.close()
  gate = restored.state.params["moe_layers"]["layer"]["ffn"]["gate_EDF"][...]
  assert gate.sharding.spec[2] == ("data" if restore_as == "data" else None if restore_as == "preset"
                                   else ("data", "sequence"))
  for saved, got, target in zip(*(jax.tree.leaves(s) for s in (states["saved"], restored.state, states["target"])),
                                strict=True):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(saved))
    assert got.sharding == target.sharding
