"""The logical-axis rules table: which mesh axes split each logical tensor dimension, per preset.

Models name dimensions logically (`embed`, `heads`, `exp`, ...; activations start with `act_`). A preset
maps each logical name to a tuple of mesh axes; names a preset leaves out are replicated. Presets are data:
switching a preset swaps the whole table and changes no model code.

`act_tokens` names a dimension that mixes the batch and sequence dimensions (the rows of the MoE dispatch
buffer); it is split over every axis that splits either.

Axis precedence: a mesh axis can split only one dimension of a tensor. When two dimensions of one tensor
ask for the same mesh axis, the name listed first in `PRIORITY` keeps it (an `exp` dimension keeps `expert`
even when the tensor also has a batch dimension that would otherwise use it).

Presets (see sharding/PLACEMENT.md for the placement of every tensor):
- dp:        every device is a data-parallel replica; parameters replicated.
- fsdp:      as dp, and every parameter's `embed` dimension split over all devices.
- zero1:     as dp, and the optimizer state split like fsdp's parameters.
- ep:        experts split over `expert`; everything else data parallel.
- tp_sp:     Megatron tensor parallelism over `tensor` (heads, MLP width, vocabulary) with the residual
             stream's sequence split over `tensor` too; experts over `expert`; context parallel over
             `sequence`; batch over `data` and `expert`.
- megascale: MegaScale-MoE: attention sequence-parallel over the `expert` and `sequence` devices, the MoE
             FFN expert-parallel over `expert` (expert width over `tensor`), batch over `data`.

Weight storage (`mesh.weight_storage`, `with_storage`): on top of any preset, every weight's `embed` dimension
(and so its gradient's and its Adam moments') can also be split for storage over `data` ("data": expert-data
parallelism, the experts' storage split over `expert` and `data`) or over every axis (ALL_AXES, "all":
ZeRO-3/FSDP on top of the preset). The axes are appended to what the preset already has for `embed`, and by
the precedence above a tensor's `embed` then gets exactly the axes its higher-priority dimensions leave it:
the experts [E, D, F] of `ep` under "all" are D over (data, tensor, sequence), the router [D, E] D over all
four. The parallel ops take weights with `embed` whole (ParallelPlan.weight_spec), so XLA all-gathers each
layer's weights where the layer uses them and sums their gradients into each device's slice (a reduce-scatter
where it forms one): the `fsdp` preset's mechanism, which "all" applied to `dp` reproduces. The MoE op gathers
its experts itself (expert_parallel._gather_stored). The optimizer rules get the same axes, so the optimizer
state is never less split than the parameters.

Optimizer storage (`mesh.optimizer_storage`, `with_optimizer_storage`; the distributed optimizer): the
optimizer rules alone get `data` (or every axis) appended to `embed`. The train state's float32 parameters
are then a master copy placed by the optimizer rules (ParallelPlan.param_shardings), while the model computes
with a copy in its compute dtype placed by the parameter rules (ParallelPlan.weight_shardings).

MoE parallel folding (`mesh.expert_axes`, `mesh.expert_width_axes`, `fold_experts`; Megatron-Core's name):
the routed experts' rules (`exp`, `exp_mlp` and their activations) can be set apart from the preset's, so
that the MoE layers lay their experts over mesh axes that attention and the dense layers use otherwise:
tp_sp with the experts over `expert` x `tensor` keeps Megatron tensor parallelism in attention and holds
each expert whole on one device of the expert x tensor group (expert parallelism over the devices attention
splits by heads), and the experts over every axis leave no expert weight replicated or gathered. The token
exchange runs over exactly the expert axes (expert_parallel.py), so each must split the tokens
(`check_expert_axes`). A preset's own placement is the folding "preset"; folding changes no other rule.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec

from meshmoe.config import OPTIMIZER_STORAGES, Config, ConfigError, mesh_axes_choice

ALL_AXES = ("data", "expert", "tensor", "sequence")

# Logical dimension names, highest precedence first.
PRIORITY = (
    # parameters ("layers": the stacked dimension of a LayerStack; no preset splits it)
    "layers", "exp", "vocab", "heads", "kv_heads", "mlp", "exp_mlp", "embed", "head_dim", "norm",
    "q_lora", "kv_lora",  # MLA's latent widths (models/mla.py); no preset splits them
    # activations
    "act_exp", "act_tokens", "act_batch", "act_attn_seq", "act_seq", "act_heads", "act_kv_heads", "act_mlp",
    "act_exp_mlp", "act_vocab", "act_embed", "act_head_dim",
)

Rules = Mapping[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class Preset:
  params: Rules
  activations: Rules
  optimizer: Rules | None = None  # None: optimizer state is placed like the parameters

  def optimizer_rules(self) -> Rules:
    return self.params if self.optimizer is None else self.optimizer


_DATA_PARALLEL_ACTS: Rules = {"act_batch": ALL_AXES, "act_tokens": ALL_AXES}
_FSDP_PARAMS: Rules = {"embed": ALL_AXES}

PRESETS: dict[str, Preset] = {
    "dp": Preset(params={}, activations=_DATA_PARALLEL_ACTS),
    "fsdp": Preset(params=_FSDP_PARAMS, activations=_DATA_PARALLEL_ACTS),
    "zero1": Preset(params={}, activations=_DATA_PARALLEL_ACTS, optimizer=_FSDP_PARAMS),
    "ep": Preset(
        params={"exp": ("expert",)},
        activations={"act_exp": ("expert",), "act_batch": ALL_AXES, "act_tokens": ALL_AXES},
    ),
    "tp_sp": Preset(
        params={
            "exp": ("expert",), "vocab": ("tensor",), "heads": ("tensor",), "kv_heads": ("tensor",),
            "mlp": ("tensor",), "exp_mlp": ("tensor",),
        },
        activations={
            "act_exp": ("expert",), "act_batch": ("data", "expert"),
            "act_tokens": ("data", "expert", "sequence", "tensor"),
            "act_attn_seq": ("sequence",), "act_seq": ("sequence", "tensor"),
            "act_heads": ("tensor",), "act_kv_heads": ("tensor",), "act_mlp": ("tensor",),
            "act_exp_mlp": ("tensor",), "act_vocab": ("tensor",),
        },
    ),
    "megascale": Preset(
        params={"exp": ("expert",), "exp_mlp": ("tensor",), "heads": ("tensor",), "kv_heads": ("tensor",)},
        activations={
            "act_exp": ("expert",), "act_batch": ("data",), "act_tokens": ("data", "expert", "sequence"),
            "act_attn_seq": ("expert", "sequence"), "act_seq": ("expert", "sequence"),
            "act_heads": ("tensor",), "act_kv_heads": ("tensor",), "act_exp_mlp": ("tensor",),
        },
    ),
}


def get_preset(name: str) -> Preset:
  if name not in PRESETS:
    raise ConfigError("mesh.preset", name, "one of " + ", ".join(repr(p) for p in PRESETS))
  return PRESETS[name]


# `mesh.weight_storage` -> the mesh axes it adds to every weight's `embed` dimension (module docstring).
STORAGE_AXES: dict[str, tuple[str, ...]] = {"preset": (), "data": ("data",), "all": ALL_AXES}


def placement(preset: str, weight_storage: str = "preset", expert_axes: str = "preset",
              expert_width_axes: str = "preset", optimizer_storage: str = "weights") -> Preset:
  """The rules of a run: the preset with its experts folded (`fold_experts`), its weights stored
  (`with_storage`) and its optimizer state stored (`with_optimizer_storage`) as the mesh config's fields say."""
  folded = fold_experts(get_preset(preset), expert_axes, expert_width_axes)
  return with_optimizer_storage(with_storage(folded, weight_storage), optimizer_storage)


def placement_of(config: Config) -> Preset:
  m = config.mesh
  return placement(m.preset, m.weight_storage, m.expert_axes, m.expert_width_axes, m.optimizer_storage)


def fold_experts(preset: Preset, expert_axes: str = "preset", expert_width_axes: str = "preset") -> Preset:
  """`preset` with the routed experts split over `expert_axes` and their width over `expert_width_axes`
  (MeshConfig's fields of those names: "preset", "none" or axes joined by commas; module docstring). Width
  axes left as the preset has them lose the axes the experts take."""
  experts = mesh_axes_choice("mesh.expert_axes", expert_axes)
  width = mesh_axes_choice("mesh.expert_width_axes", expert_width_axes)
  if experts is None and width is None:
    return preset
  if experts is None:
    experts = preset.params.get("exp", ())
  if width is None:
    width = tuple(a for a in preset.params.get("exp_mlp", ()) if a not in experts)
  elif both := [a for a in experts if a in width]:
    raise ConfigError("mesh.expert_width_axes", expert_width_axes, (
        f"axes the experts do not take (here {', '.join(experts)}): a mesh axis splits the experts or their "
        f"width, not both ({', '.join(both)})"))

  def fold(table: Rules, names: tuple[str, str]) -> Rules:
    table = {k: v for k, v in table.items() if k not in names}
    return {**table, **{name: axes for name, axes in zip(names, (experts, width)) if axes}}

  return dataclasses.replace(
      preset, params=fold(preset.params, ("exp", "exp_mlp")),
      activations=fold(preset.activations, ("act_exp", "act_exp_mlp")),
      optimizer=None if preset.optimizer is None else fold(preset.optimizer, ("exp", "exp_mlp")))


def split_token_axes(table: Preset) -> set[str]:
  """The mesh axes that split the residual stream's tokens (its batch or its sequence): those the experts'
  token exchange can run over."""
  return {a for name in ("act_batch", "act_seq") for a in table.activations.get(name, ())}


def check_expert_axes(table: Preset, mesh_sizes: Mapping[str, int], field_value: str = "preset") -> None:
  """Raises ConfigError when the experts are split over a mesh axis (of more than one device) that does not
  split the tokens: the token exchange sends each device's tokens to the devices of the other experts, and
  devices holding the same tokens would each send them (the experts computing every token twice)."""
  token_axes = split_token_axes(table)
  unsplit = [a for a in table.params.get("exp", ()) if a not in token_axes and mesh_sizes[a] > 1]
  if unsplit:
    allowed = [a for a in ALL_AXES if a in token_axes]
    raise ConfigError("mesh.expert_axes", field_value, (
        f"mesh axes that split the tokens ({', '.join(allowed) or 'none'} under this preset): the experts' "
        f"token exchange runs between devices that hold different tokens, and {', '.join(unsplit)} does not "
        "split them"))


def with_storage(preset: Preset, weight_storage: str) -> Preset:
  """`preset` with its parameters (and optimizer state) stored as `weight_storage` says: the storage axes
  appended to the `embed` rule of the parameter rules, and of the optimizer rules where the preset has its
  own (ZeRO-1's already split `embed` over every axis: appending keeps it at least as split as the
  parameters)."""
  if weight_storage not in STORAGE_AXES:
    raise ConfigError("mesh.weight_storage", weight_storage, "one of " + ", ".join(map(repr, STORAGE_AXES)))
  extra = STORAGE_AXES[weight_storage]
  if not extra:
    return preset

  def split(table: Rules) -> Rules:
    return {**table, "embed": tuple(dict.fromkeys((*table.get("embed", ()), *extra)))}

  return dataclasses.replace(preset, params=split(preset.params),
                             optimizer=None if preset.optimizer is None else split(preset.optimizer))


def with_optimizer_storage(preset: Preset, optimizer_storage: str) -> Preset:
  """`preset` with its optimizer state (the distributed optimizer's float32 master weights and moments)
  split further as `optimizer_storage` says: its storage axes appended to the optimizer rules' `embed`
  (MeshConfig.optimizer_storage; "weights" leaves the preset as it is)."""
  if optimizer_storage == "weights":
    return preset
  if optimizer_storage not in OPTIMIZER_STORAGES:
    raise ConfigError("mesh.optimizer_storage", optimizer_storage, "one of " + ", ".join(map(repr, OPTIMIZER_STORAGES)))
  table = preset.optimizer_rules()
  embed = tuple(dict.fromkeys((*table.get("embed", ()), *STORAGE_AXES[optimizer_storage])))
  return dataclasses.replace(preset, optimizer={**table, "embed": embed})


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules) -> PartitionSpec:
  """Turns one tensor's logical dimension names into a PartitionSpec over mesh axes."""
  unknown = [name for name in logical_axes if name is not None and name not in PRIORITY]
  if unknown:
    raise ValueError(f"unknown logical axis names {unknown}; known: {PRIORITY}")
  taken: set[str] = set()
  assigned: dict[int, tuple[str, ...]] = {}
  order = sorted((i for i, n in enumerate(logical_axes) if n is not None),
                 key=lambda i: PRIORITY.index(logical_axes[i]))
  for i in order:
    axes = tuple(a for a in rules.get(logical_axes[i], ()) if a not in taken)
    taken.update(axes)
    assigned[i] = axes
  entries = []
  for i in range(len(logical_axes)):
    axes = assigned.get(i, ())
    entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*entries)


def _dimension_sizes(config: Config) -> dict[str, list[tuple[str, int, int]]]:
  """For each logical name: the (config field, field value, dimension size) pairs that set its size."""
  m, moe = config.model, config.model.moe
  mlp = [("model.mlp_dim", m.mlp_dim, m.mlp_dim)] if m.num_dense_layers else []
  if moe.num_shared_experts:  # shared experts are one dense SwiGLU of width num_shared * expert_mlp_dim
    mlp.append(("model.moe.num_shared_experts", moe.num_shared_experts,
                moe.num_shared_experts * moe.expert_mlp_dim))
  one = lambda field: [(field, _field_value(config, field), _field_value(config, field))]
  sizes = {
      "vocab": one("model.vocab_size"), "embed": one("model.embed_dim"), "heads": one("model.num_heads"),
      "kv_heads": one("model.num_kv_heads"), "head_dim": one("model.head_dim"), "mlp": mlp,
      "exp": one("model.moe.num_experts"), "exp_mlp": one("model.moe.expert_mlp_dim"),
      # One micro-batch is what a step's forward pass holds.
      "act_batch": [("train.global_batch_size", config.train.global_batch_size,
                     config.train.global_batch_size // config.train.grad_accum_steps)],
      "act_seq": one("train.seq_len"),
      "act_attn_seq": one("train.seq_len"),
  }
  for name in ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "exp", "exp_mlp"):
    sizes["act_" + name] = sizes[name]
  return sizes


# How a divisibility error names each split dimension.
_DESCRIPTION = {
    "vocab": "the vocabulary", "embed": "the model dimension", "heads": "the attention heads",
    "kv_heads": "the key/value heads", "head_dim": "the head dimension", "mlp": "the dense MLP width",
    "exp": "the experts", "exp_mlp": "the expert MLP width", "act_batch": "the batch",
    "act_seq": "the sequence between blocks", "act_attn_seq": "the sequence inside attention",
    "act_attn_seq_chunks": "the sequence into an early and a late chunk per device for attention",
    "act_ulysses_heads": "the attention heads for Ulysses attention (parallel.attention='ulysses')",
    "act_ulysses_kv_heads": "the key/value heads for Ulysses attention (parallel.attention='ulysses')",
}


def check_divisibility(config: Config, mesh_sizes: Mapping[str, int]) -> None:
  """Raises ConfigError when a preset (with its weight storage) splits a dimension over mesh axes whose
  product does not divide it.

  A dimension is checked against the product of all the axes its rule lists, except the weights' `embed`:
  a tensor's higher-priority dimensions may take some of its axes (the experts' `expert` under
  weight_storage "all"), so it is checked against the axes it really gets in each weight of the model
  (`embed_layouts`). Dimensions set by one field directly are checked before derived ones (the shared
  experts' width), so the error names the field to change.
  """
  preset = placement_of(config)
  sizes = _dimension_sizes(config)
  problems = []
  for rules in (preset.params, preset.activations, preset.optimizer_rules()):
    for name, rule_axes in rules.items():
      splits = _embed_splits(config, rules, mesh_sizes) if name == "embed" else [rule_axes]
      for axes in splits:
        parts = math.prod(mesh_sizes[a] for a in axes)
        for field, value, size in sizes.get(name, []):
          if size % parts:
            problems.append((size != value, name, axes, parts, field, value, size))
  problems += _context_parallel_problems(config, preset, mesh_sizes)
  if not problems:
    return
  _, name, axes, parts, field, value, size = min(problems, key=lambda p: p[0])
  split = " x ".join(f"{a}={mesh_sizes[a]}" for a in axes)
  need = (f"a multiple of {parts}" if size == value else
          f"a value that makes the dimension it sets (now {size}) a multiple of {parts}")
  what = _DESCRIPTION.get(name) or _DESCRIPTION.get(name.removeprefix("act_"), name)
  defaults = {"weight_storage": "preset", "expert_axes": "preset", "expert_width_axes": "preset",
              "optimizer_storage": "weights"}
  changed = [f"mesh.{f}={getattr(config.mesh, f)!r}" for f, default in defaults.items()
             if getattr(config.mesh, f) != default]
  who = f"preset {config.mesh.preset!r}" + (f" with {' and '.join(changed)}" if changed else "")
  raise ConfigError(field, value, f"{need}: {who} splits {what} over mesh axes {split}")


def embed_layouts(config: Config) -> list[tuple[str | None, ...]]:
  """The logical names of every weight of the model that has an `embed` dimension, less the stacked
  `layers` one (models/: layers.py, attention.py, mla.py, moe.py, router.py, decoder.py;
  tests/test_config.py checks this list against the model's parameters)."""
  m = config.model
  layouts: list[tuple[str | None, ...]] = [("vocab", "embed")]
  if not m.tie_embeddings:
    layouts.append(("embed", "vocab"))
  if m.attention == "mla":
    layouts += [("embed", "q_lora") if m.q_lora_rank else ("embed", "heads", "head_dim"), ("embed", "kv_lora")]
  else:
    layouts += [("embed", "heads", "head_dim"), ("embed", "kv_heads", "head_dim")]
  layouts.append(("heads", "head_dim", "embed"))
  num_moe = m.num_layers - m.num_dense_layers
  if m.num_dense_layers or (num_moe and m.moe.num_shared_experts):
    layouts += [("embed", "mlp"), ("mlp", "embed")]
  if num_moe:
    layouts += [("exp", "embed", "exp_mlp"), ("exp", "exp_mlp", "embed"), ("embed", None)]
  return layouts


def _embed_splits(config: Config, rules: Rules, mesh_sizes: Mapping[str, int]) -> list[tuple[str, ...]]:
  """The distinct axes the model's weights' `embed` dimensions get under `rules`, the most devices first
  (so an error names the largest split that does not divide)."""
  splits = {logical_to_spec(layout, rules)[layout.index("embed")] for layout in embed_layouts(config)}
  axes = [() if s is None else (s,) if isinstance(s, str) else tuple(s) for s in splits]
  return sorted(axes, key=lambda a: (-math.prod(mesh_sizes[x] for x in a), a))


def _context_parallel_problems(config: Config, preset: Preset, mesh_sizes: Mapping[str, int]) -> list:
  """Attention over a split sequence cuts it into 2n chunks (an early and a late one per device); Ulysses
  also splits the (already tensor-split) heads n ways."""
  axes = preset.activations.get("act_attn_seq", ())
  n = math.prod(mesh_sizes[a] for a in axes)
  if n == 1:
    return []
  problems = []
  if config.train.seq_len % (2 * n):
    problems.append((False, "act_attn_seq_chunks", axes, 2 * n, "train.seq_len", config.train.seq_len,
                     config.train.seq_len))
  if config.parallel.attention == "ulysses":
    for name, field in (("heads", "model.num_heads"), ("kv_heads", "model.num_kv_heads")):
      split = math.prod(mesh_sizes[a] for a in preset.params.get(name, ()))
      value = _field_value(config, field)
      if value % (split * n):
        problems.append((False, "act_ulysses_" + name, axes + preset.params.get(name, ()), split * n, field,
                         value, value))
  return problems


def _field_value(config: Config, field: str) -> int:
  value = config
  for part in field.split("."):
    value = getattr(value, part)
  return value
