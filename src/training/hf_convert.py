"""A Hugging Face folder as a run's step-0 checkpoint, and a run's newest checkpoint as a Hugging Face folder
(experiments/convert.py is the command line; models/hf_checkpoint.py and models/hf_export.py do the
tensors)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax

from meshmoe.config import Config, ConfigError, from_dict
from meshmoe.data import pipeline as data_lib
from meshmoe.models import hf_checkpoint, hf_export
from meshmoe.sharding.mesh import make_mesh
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.training import model_state, train_step
from meshmoe.training.checkpointing import Checkpointer


def to_run_checkpoint(config: Config, folder: pathlib.Path, workdir: pathlib.Path) -> None:
  """Writes `workdir`'s config.json and the checkpoint of step 0 that `experiments.train` with `config` and
  `train.init_from=hf:<folder>` would start from: the folder's parameters, a fresh optimizer state and the
  data position of step 0. The workdir must hold no checkpoint yet."""
  config = dataclasses.replace(config, train=dataclasses.replace(config.train, init_from=f"hf:{folder}"))
  config = hf_checkpoint.with_checkpoint_model(config).validate(jax.device_count())
  checkpointer = Checkpointer(workdir, config.checkpoint, config.optimizer.name, config.optimizer.moments_dtype)
  try:
    if checkpointer.latest_step() is not None:
      raise hf_checkpoint.CheckpointError(f"{workdir} holds checkpoints already (newest: step "
                                          f"{checkpointer.latest_step()}); convert into a new workdir")
    plan = ParallelPlan.build(config, make_mesh(config.mesh))
    data = data_lib.build_data(config, train_step.process_rows(config, plan))
    _, state = train_step.create(config, plan, model_state.checkpoint_variables(config, plan))
    if jax.process_index() == 0:
      workdir.mkdir(parents=True, exist_ok=True)
      (workdir / "config.json").write_text(json.dumps(dataclasses.asdict(config), indent=1) + "\n")
    checkpointer.save(0, state, data.train.get_state())
    checkpointer.wait()
  finally:
    checkpointer.close()


def to_hf_folder(workdir: pathlib.Path, folder: pathlib.Path, dtype: str) -> int:
  """Writes the parameters of `workdir`'s newest checkpoint as a Hugging Face folder (models/hf_export.py)
  with the run's tokenizer.json, if it has one; returns the checkpoint's step."""
  saved = workdir / "config.json"
  if not saved.is_file():
    raise ConfigError("workdir", str(workdir), "a run's folder, holding the config.json experiments.train writes")
  config = from_dict(Config, json.loads(saved.read_text())).validate(jax.device_count())
  plan = ParallelPlan.build(config, make_mesh(config.mesh))
  _, abstract = train_step.create_abstract(config, plan)
  checkpointer = Checkpointer(workdir, config.checkpoint, config.optimizer.name, config.optimizer.moments_dtype)
  try:
    restored = checkpointer.restore_latest(abstract)
    if restored is None:
      raise ConfigError("workdir", str(workdir), "a run's folder with at least one checkpoint")
    hf_export.save(restored.state.params, config.model, folder, others=restored.state.others, dtype=dtype,
                   **export_options(config))
  finally:
    checkpointer.close()
  return restored.step


def export_options(config: Config) -> dict:
  """hf_export.save's tokenizer, base config and companion files for a run: the run's tokenizer.json, and
  what the Hugging Face folder it started from (train.init_from) holds besides its weights."""
  options = {"tokenizer": config.data.tokenizer if config.data.tokenizer.endswith(".json") else None}
  if config.train.init_from:
    folder = hf_checkpoint.folder_of(config.train.init_from)
    if (folder / "config.json").is_file():  # the folder may be gone since the run started
      options.update(base_config=hf_checkpoint.read_config(folder), extra_files=hf_export.companions(folder))
  return options
