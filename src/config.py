"""Typed configuration for meshmoe, validated up front: the one import path for every config name.

Every section is a plain dataclass so that experiment files, notebooks and absl `--config.a.b=v` overrides
all edit the same fields. `Config.validate(num_devices)` checks every field, and the mesh against the device
count, before any array is built; a bad value raises one `ConfigError` that names the field, the value and
what is allowed. The config is plain data that every layer imports, so it imports nothing of meshmoe.

The sections live in modules of their own, and this one gathers them; import every name from here:
  config_model.py     ModelConfig, MoEConfig
  config_parallel.py  MeshConfig, ParallelConfig, the mesh-size arithmetic and the parallel options' checks
  config_run.py       OptimizerConfig, TrainConfig, DataConfig, CheckpointConfig, SampleConfig, ResilienceConfig
  config_checks.py    ConfigError and the field checks every section's validation uses
They import nothing of meshmoe but each other (tests/test_layering.py).

What depends on the rules table (a dimension that a preset splits over mesh axes must divide evenly) is
checked where the table lives, when the run's parallel plan is built (meshmoe.sharding.plan,
`ParallelPlan.build`), also before any array is built.
"""

import dataclasses

from meshmoe.config_checks import ConfigError
from meshmoe.config_model import (ATTENTION_TYPES, BALANCE_LOSSES, DTYPES, REMAT_POLICIES, SCORE_FNS, ModelConfig,
                                  MoEConfig, validate_model)
from meshmoe.config_parallel import (ATTENTION_KERNELS, ATTENTION_KINDS, EXCHANGE_FORMAT_FIELDS, EXCHANGE_FORMATS,
                                     GEMM_FORMS, GEMM_IMPLEMENTATIONS, GRADIENT_COMPRESSIONS, GROUPED_GEMMS, IMPLS,
                                     KERNEL_BACKENDS, KERNEL_TILES, LAYER_SCHEDULES, MESH_AXES, PRESETS,
                                     OPTIMIZER_STORAGES, SWIGLU_GRADIENTS, WEIGHT_STORAGES, XLA_FLAG_PRESETS,
                                     MeshConfig, ParallelConfig, check_weight_storage, gemm_kernel_overrides,
                                     mesh_axes_choice, resolve_mesh_sizes, validate_mesh)
from meshmoe.config_run import (DATA_SOURCES, LR_DECAY_SHAPES, LR_SCHEDULES, MOMENTS_DTYPES, NAN_POLICIES,
                                OPTIMIZERS, CheckpointConfig,
                                DataConfig, OptimizerConfig, ResilienceConfig, SampleConfig, TrainConfig,
                                mixture_entries, profile_range,
                                validate_checkpoint_and_sample, validate_data, validate_optimizer,
                                validate_resilience, validate_train)

__all__ = [
    # Sections.
    "Config", "ModelConfig", "MoEConfig", "MeshConfig", "ParallelConfig", "OptimizerConfig", "TrainConfig",
    "DataConfig", "CheckpointConfig", "SampleConfig", "ResilienceConfig",
    # Errors and helpers.
    "ConfigError", "from_dict", "resolve_mesh_sizes", "check_weight_storage", "gemm_kernel_overrides",
    "mesh_axes_choice",
    "mixture_entries", "profile_range",
    # The allowed values of the choice fields.
    "MESH_AXES", "PRESETS", "WEIGHT_STORAGES", "OPTIMIZER_STORAGES", "IMPLS", "KERNEL_BACKENDS", "KERNEL_TILES",
    "ATTENTION_KINDS", "ATTENTION_KERNELS", "XLA_FLAG_PRESETS", "GROUPED_GEMMS", "GEMM_FORMS", "GEMM_IMPLEMENTATIONS",
    "EXCHANGE_FORMATS", "EXCHANGE_FORMAT_FIELDS", "LAYER_SCHEDULES", "SWIGLU_GRADIENTS", "GRADIENT_COMPRESSIONS",
    "DTYPES", "SCORE_FNS", "ATTENTION_TYPES", "REMAT_POLICIES", "DATA_SOURCES", "NAN_POLICIES",
    "LR_SCHEDULES", "LR_DECAY_SHAPES", "OPTIMIZERS", "MOMENTS_DTYPES", "BALANCE_LOSSES",
]


@dataclasses.dataclass(kw_only=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
  optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  sample: SampleConfig = dataclasses.field(default_factory=SampleConfig)
  resilience: ResilienceConfig = dataclasses.field(default_factory=ResilienceConfig)

  def validate(self, num_devices: int | None = None) -> "Config":
    """Checks every field; with `num_devices`, also that the mesh axes multiply to it. Returns self. The
    divisibility of the dimensions a preset splits is checked by ParallelPlan.build."""
    validate_model(self.model)
    validate_train(self.train, self.model)
    validate_optimizer(self.optimizer)
    validate_data(self.data)
    validate_checkpoint_and_sample(self.checkpoint, self.sample)
    validate_resilience(self.resilience)
    validate_mesh(self.mesh)
    self.parallel.validate()
    check_weight_storage(self.mesh.weight_storage, self.parallel, self.mesh.optimizer_storage)
    fallback = self.parallel.moe_fallback_grad_accum_steps
    if fallback and self.train.global_batch_size % fallback:
      raise ConfigError("parallel.moe_fallback_grad_accum_steps", fallback,
                        f"0 or a divisor of train.global_batch_size={self.train.global_batch_size}")
    if num_devices is not None:
      resolve_mesh_sizes(self.mesh, num_devices)
    return self


def from_dict(cls, values: dict):
  """The config dataclass `cls` from `dataclasses.asdict`'s output (a run's config.json): nested sections
  rebuilt, lists back into the tuples the defaults use. A field that does not exist is an error."""
  default = cls()
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(cls.__name__, unknown, "only fields this section has (a config.json of another meshmoe version?)")
  kwargs = {}
  for name, value in values.items():
    current = getattr(default, name)
    if dataclasses.is_dataclass(current):
      value = from_dict(type(current), value)
    elif isinstance(current, tuple) and isinstance(value, list):
      value = tuple(value)
    kwargs[name] = value
  return cls(**kwargs)
