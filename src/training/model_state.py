"""Sharded model and optimizer-state creation, and the batch in the order the plan's attention wants.

Parameters are created directly in their sharded layout (the init is jitted with the plan's shardings as
outputs), so no device ever holds a full copy. Each jitted function built from a plan is tied to its mesh
and preset, so nothing global leaks between meshes.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshmoe.config import Config
from meshmoe.models import hf_checkpoint
from meshmoe.models.decoder import Transformer
from meshmoe.models.layers import Documents
from meshmoe.sharding import gradient_sync
from meshmoe.sharding.grouped_ffn import ExpertWeights
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.training import optimizer as optimizer_lib


def init_model(config: Config, plan: ParallelPlan, variables: tuple[Any, Any] | None = None) -> Transformer:
  """The model of `config`, initialised from `config.train.seed`, with parameters sharded as `plan` says;
  or with `variables` (parameters, other variables), placed already (`checkpoint_variables`)."""
  create = lambda: Transformer(config.model, rngs=nnx.Rngs(config.train.seed))
  abstract = nnx.eval_shape(create)
  if variables is None:
    state = jax.jit(lambda: nnx.state(create()), out_shardings=plan.param_shardings(nnx.state(abstract)))()
    return nnx.merge(nnx.graphdef(abstract), state)
  return nnx.merge(nnx.graphdef(abstract), *variables)


def checkpoint_variables(config: Config, plan: ParallelPlan, report: dict | None = None) -> tuple[Any, Any]:
  """(parameters, other variables) of `config.train.init_from` (a Hugging Face folder), each device
  reading its blocks (`report`: hf_checkpoint.load's)."""
  _, params, others = abstract_model_state(config, plan)
  folder = hf_checkpoint.folder_of(config.train.init_from)
  return hf_checkpoint.load(folder, params, others, config.model, report=report)


def init_optimizer_state(optimizer: optax.GradientTransformation, params: Any, plan: ParallelPlan) -> Any:
  """`optimizer.init(params)` with every parameter-shaped leaf (moments, ...) placed by the preset's
  optimizer rules (ZeRO-1 splits them over the devices) and scalars such as the step count replicated."""
  shardings = optimizer_state_shardings(optimizer, params, plan)
  return jax.jit(optimizer.init, out_shardings=shardings)(params)


def optimizer_state_shardings(optimizer: optax.GradientTransformation, params: Any, plan: ParallelPlan) -> Any:
  """The shardings `init_optimizer_state` gives (`params` may be abstract): each parameter's statistics lie
  like it, the rest is replicated (`_statistic_placement`)."""
  placed = _statistic_placement(params, plan)
  return jax.tree_util.tree_map_with_path(placed, jax.eval_shape(optimizer.init, params))


def abstract_model_state(config: Config, plan: ParallelPlan) -> tuple[Any, Any, Any]:
  """(graphdef, params, others) of the model with every leaf a jax.ShapeDtypeStruct carrying the sharding
  `init_model` would give it: the model's shape on the plan's mesh without allocating it."""
  abstract = nnx.eval_shape(lambda: Transformer(config.model, rngs=nnx.Rngs(config.train.seed)))
  graphdef, params, others = nnx.split(abstract, nnx.Param, ...)
  placed = lambda variable, sharding: variable.replace(
      jax.ShapeDtypeStruct(variable.shape, variable.dtype, sharding=sharding))
  is_variable = lambda x: isinstance(x, nnx.Variable)
  params = jax.tree.map(placed, params, plan.param_shardings(params), is_leaf=is_variable)
  others = jax.tree.map(lambda v: placed(v, plan.replicated()), others, is_leaf=is_variable)
  return graphdef, params, others


def in_sequence_order(plan: ParallelPlan, tokens_BS: jax.Array, targets_BS: jax.Array,
                      mask_BS: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """(tokens, targets, mask, positions) permuted alike into the order the plan's context-parallel
  attention wants (ParallelPlan.sequence_order), with each token's place in its sequence; unchanged, with
  no positions, when the sequence is not split. The loss is a sum over tokens, so it is the same."""
  order_S = plan.sequence_order(tokens_BS.shape[1])
  if order_S is None:
    return tokens_BS, targets_BS, mask_BS, None
  positions_BS = jnp.broadcast_to(jnp.asarray(order_S), tokens_BS.shape)
  tokens_BS, targets_BS, mask_BS = (a[:, order_S] for a in (tokens_BS, targets_BS, mask_BS))
  return tokens_BS, targets_BS, mask_BS, positions_BS


def documents_in_sequence_order(plan: ParallelPlan, starts_BS: jax.Array | None,
                                restart_positions: bool) -> Documents | None:
  """The packed rows' documents (models/layers.Documents) from each token's document start (the batch's
  "document_starts", in row order), permuted like `in_sequence_order`'s tokens; None without starts. Rotary
  positions count from each document's start when `restart_positions` (data.restart_positions)."""
  if starts_BS is None:
    return None
  order_S = plan.sequence_order(starts_BS.shape[1])
  places_BS = jnp.broadcast_to(jnp.arange(starts_BS.shape[1]) if order_S is None else jnp.asarray(order_S),
                               starts_BS.shape)
  if order_S is not None:
    starts_BS = starts_BS[:, order_S]
  return Documents(starts_BS, places_BS - starts_BS if restart_positions else places_BS)


def abstract_gradient_residual(config: Config, plan: ParallelPlan) -> ExpertWeights | None:
  """The error-feedback residual of the routed experts' compressed gradient sum (sharding/gradient_sync.py),
  as jax.ShapeDtypeStructs with their shardings: float32 [MoE layers, replicas, *weight], each device
  holding its replica's copy of its expert weights; None when the plan keeps none."""
  m = config.model
  if not plan.gradient_feedback:
    return None
  lay = plan.expert_layout()
  e, d, f = m.moe.num_experts, m.embed_dim, m.moe.expert_mlp_dim
  axes = plan.gradient_replica_axes
  lead = (m.num_layers - m.num_dense_layers, plan.axis_size(axes))
  placed = lambda shape, spec: jax.ShapeDtypeStruct(
      (*lead, *shape), jnp.float32,
      sharding=NamedSharding(plan.mesh, PartitionSpec(None, *gradient_sync.replica_spec(spec, axes))))
  return ExpertWeights(placed((e, d, f), lay.gate_spec), placed((e, d, f), lay.gate_spec),
                       placed((e, f, d), lay.down_spec))


def init_gradient_residual(config: Config, plan: ParallelPlan) -> ExpertWeights | None:
  """`abstract_gradient_residual`, zeros: nothing lost yet."""
  abstract = abstract_gradient_residual(config, plan)
  if abstract is None:
    return None
  shardings = jax.tree.map(lambda a: a.sharding, abstract)
  return jax.jit(lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract), out_shardings=shardings)()


def _statistic_placement(params: Any, plan: ParallelPlan):
  """(path, leaf of an optimizer state) -> its sharding: a statistic of a parameter (optimizer.parameter_of)
  where optimizer.statistic_spec puts it beside the parameter's optimizer placement; anything else (counts)
  replicated."""
  is_variable = lambda x: isinstance(x, nnx.Variable)
  shardings = jax.tree.leaves(plan.optimizer_shardings(params))
  shapes = [variable.shape for variable in jax.tree.leaves(params, is_leaf=is_variable)]
  owner = optimizer_lib.parameter_of(params)

  def placed(path, leaf) -> NamedSharding:
    i = owner(path)
    spec = None if i is None else optimizer_lib.statistic_spec(shardings[i].spec, shapes[i], leaf.shape)
    return plan.replicated() if spec is None else NamedSharding(plan.mesh, PartitionSpec(*spec))

  return placed
