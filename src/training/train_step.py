"""The training state and the jitted train and eval steps.

`TrainState` is everything a checkpoint must hold to continue a run exactly (the data-iterator position is
saved beside it): step, float32 parameters, non-trainable variables (the experts' selection bias),
optimizer state, a PRNG key that advances every step (sampling draws from it) and, where the experts'
gradients are summed compressed with error feedback, each device's residual (sharding/gradient_sync.py).

One step = `train.grad_accum_steps` micro-batches scanned in sequence, their gradients summed, then one
optimizer update. The batch is split into micro-batches by striding (micro-batch i holds rows i, i + A,
...), so every device keeps its share of each micro-batch. The loss is the mean cross-entropy over all
the step's unmasked tokens plus the router losses averaged over micro-batches, identical to one big batch.
A step whose loss or gradient norm is NaN/Inf keeps the state it started from (meshmoe.runtime.nonfinite).

With several processes each one holds only some rows of the global batch (`process_rows`: those its
devices hold) and `place_batch` assembles the global array from every process's rows.

Everything here is built from the run's parallel plan (meshmoe.sharding.plan): the shardings, and the plan
the steps activate while they trace the model, so every parallel op runs as the plan says.
"""

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from meshmoe.config import Config, ConfigError
from meshmoe.models.decoder import combine_loss_terms, global_batch_balance_loss, lm_loss_terms
from meshmoe.runtime import nonfinite
from meshmoe.sharding.plan import ParallelPlan
from meshmoe.sharding.shardings import use_plan, with_weight_placed_gradients
from meshmoe.training import master_weights
from meshmoe.training import optimizer as optimizer_lib
from meshmoe.training.model_state import (abstract_gradient_residual, abstract_model_state, documents_in_sequence_order,
                                          in_sequence_order,
                                          init_gradient_residual, init_model, init_optimizer_state,
                                          optimizer_state_shardings)


@dataclasses.dataclass
class TrainState:
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any  # nnx.State of the nnx.Param variables
  others: Any  # nnx.State of the non-trainable variables
  opt_state: Any
  rng: jax.Array  # uint32[2] PRNG key
  # Error feedback of the experts' compressed gradient sum (ExpertWeights of [layers, replicas, ...]), or None.
  # Its name is on disk: the checkpoint item and fingerprints that hold it (training/checkpointing.py).
  grad_residual: Any = None


jax.tree_util.register_dataclass(TrainState)


@dataclasses.dataclass
class Trainer:
  """What a run needs besides the state: the model structure, the optimizer and the jitted steps."""

  graphdef: Any
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  train_step: Callable[[TrainState, dict], tuple[TrainState, dict]]
  eval_step: Callable[[Any, Any, dict], dict]
  state_shardings: Any
  # Where the plan caps the MoE receive buffers: the same step with worst-case buffers, in
  # parallel.moe_fallback_grad_accum_steps micro-batches, for the steps whose routing overflowed one
  # (`dropless_fallback`); None otherwise.
  fallback_step: Callable[[TrainState, dict], tuple[TrainState, dict]] | None = None


def create(config: Config, plan: ParallelPlan, variables: tuple[Any, Any] | None = None
           ) -> tuple[Trainer, TrainState]:
  """The initial state (sharded as `plan` says) and the jitted steps for `config`; `variables`
  (parameters, other variables; model_state.checkpoint_variables), placed as the plan says, replace the
  random initial ones."""
  model = init_model(config, plan, variables)
  graphdef, params, others = nnx.split(model, nnx.Param, ...)
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.train.steps, params)
  opt_state = init_optimizer_state(optimizer, params, plan)
  replicated = plan.replicated()
  state = TrainState(step=jax.device_put(jnp.zeros((), jnp.int32), replicated), params=params, others=others,
                     opt_state=opt_state,
                     rng=jax.device_put(jax.random.PRNGKey(config.train.seed), replicated),
                     grad_residual=init_gradient_residual(config, plan))
  return _trainer(graphdef, optimizer, config, plan, state), state


def create_abstract(config: Config, plan: ParallelPlan) -> tuple[Trainer, TrainState]:
  """The jitted steps and the state as jax.ShapeDtypeStructs with their shardings, allocating nothing: to
  compile a step for devices this machine does not have (meshmoe.analysis.aot)."""
  graphdef, params, others = abstract_model_state(config, plan)
  optimizer = optimizer_lib.make_optimizer(config.optimizer, config.train.steps, params)
  opt_shardings = optimizer_state_shardings(optimizer, params, plan)
  # The shardings tree is a prefix of the state's (a sharding where the state has a Variable of an array).
  placed = lambda sharding, subtree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), subtree)
  opt_state = jax.tree.map(placed, opt_shardings, jax.eval_shape(optimizer.init, params))
  replicated = plan.replicated()
  rng = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  state = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated), params=params,
                     others=others, opt_state=opt_state,
                     rng=jax.ShapeDtypeStruct(rng.shape, rng.dtype, sharding=replicated),
                     grad_residual=abstract_gradient_residual(config, plan))
  return _trainer(graphdef, optimizer, config, plan, state), state


def _trainer(graphdef, optimizer, config: Config, plan: ParallelPlan, state: TrainState) -> Trainer:
  """The jitted steps for `state` (arrays or their abstract shapes, placed as the plan says)."""
  shardings = jax.tree.map(lambda x: x.sharding, state)
  schedule = optimizer_lib.learning_rate_schedule(config.optimizer, config.train.steps)
  train = _make_train_step(graphdef, optimizer, schedule, config, plan, shardings)
  fallback, eval_plan = None, plan
  if plan.caps_receive_buffers:
    fallback_config, eval_plan = dropless_fallback(config, plan)
    fallback = _make_train_step(graphdef, optimizer, schedule, fallback_config, eval_plan, shardings)
  # Evaluation takes no step back, so it always receives into worst-case buffers.
  return Trainer(graphdef, optimizer, schedule, train, _make_eval_step(graphdef, config, eval_plan), shardings,
                 fallback)


def dropless_fallback(config: Config, plan: ParallelPlan) -> tuple[Config, ParallelPlan]:
  """The config and plan of the step a run with capped MoE receive buffers (`plan.caps_receive_buffers`)
  runs again where one overflowed: worst-case buffers, in parallel.moe_fallback_grad_accum_steps
  micro-batches (0: the run's). The same function of the batch as the capped step's, up to float rounding,
  but for balance losses over a micro-batch (MoEConfig.balance_loss "batch", "global_batch"), which then see
  the fallback's micro-batches."""
  fallback = copy.deepcopy(config)
  fallback.parallel.moe_buffer_factor = 0.0
  fallback.train.grad_accum_steps = config.parallel.moe_fallback_grad_accum_steps or config.train.grad_accum_steps
  try:
    return fallback.validate(), ParallelPlan.build(fallback, plan.mesh)
  except ConfigError as error:  # the one field that made it: the fallback's micro-batches
    raise ConfigError("parallel.moe_fallback_grad_accum_steps", config.parallel.moe_fallback_grad_accum_steps,
                      f"micro-batches this layout can split the batch into ({error})") from None


def process_rows(config: Config, plan: ParallelPlan) -> range:
  """The rows of each global batch that this process's devices hold: a contiguous block (the whole batch
  when the batch is not split across processes), because the mesh puts hosts outermost."""
  size, shape = config.train.global_batch_size, (config.train.global_batch_size, config.train.seq_len)
  indices = plan.batch_sharding().addressable_devices_indices_map(shape).values()
  spans = sorted(index[0].indices(size)[:2] for index in indices)
  covered = set().union(*(range(start, stop) for start, stop in spans))
  rows = range(spans[0][0], max(stop for _, stop in spans))
  if covered != set(rows):
    raise ValueError(f"this process's devices hold batch rows {sorted(covered)}, not one contiguous block")
  return rows


def place_batch(batch: dict[str, np.ndarray], config: Config, plan: ParallelPlan) -> dict[str, jax.Array]:
  """Global arrays sharded like the preset's batch, from this process's rows (`process_rows`) of it."""
  sharding = plan.batch_sharding()
  rows = process_rows(config, plan)

  def place(name: str, local: np.ndarray) -> jax.Array:
    if local.shape[0] != len(rows):
      raise ValueError(f"batch[{name!r}] holds {local.shape[0]} rows; this process holds rows {rows}")
    shape = (config.train.global_batch_size, *local.shape[1:])
    return jax.make_array_from_callback(shape, sharding, lambda index: local[_local_index(index, rows, shape)])

  return {name: place(name, value) for name, value in batch.items()}


def _local_index(index: tuple[slice, ...], rows: range, shape: tuple[int, ...]) -> tuple[slice, ...]:
  start, stop, _ = index[0].indices(shape[0])
  return (slice(start - rows.start, stop - rows.start), *index[1:])


def abstract_batch(config: Config, plan: ParallelPlan) -> dict[str, jax.ShapeDtypeStruct]:
  """Shapes, dtypes and shardings of a global batch (to compile the step before data arrives); with
  data.document_mask, each token's document start too (the data pipeline's "document_starts")."""
  shape, sharding = (config.train.global_batch_size, config.train.seq_len), plan.batch_sharding()
  batch = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding),
           "targets": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding),
           "mask": jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)}
  if config.data.document_mask:
    batch["document_starts"] = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
  return batch


def _microbatches(batch: dict[str, jax.Array], count: int) -> dict[str, jax.Array]:
  """[B, S] -> [count, B / count, S], micro-batch i holding rows i, i + count, ..."""
  return {k: jnp.moveaxis(v.reshape(v.shape[0] // count, count, *v.shape[1:]), 1, 0) for k, v in batch.items()}


def loss_terms(graphdef, params, others, batch: dict[str, jax.Array], plan: ParallelPlan,
               grad_residual=None, restart_positions: bool = False) -> dict[str, jax.Array]:
  """The loss terms of one (micro-)batch (decoder.lm_loss_terms), traced under `plan`; `grad_residual`: the
  error-feedback input of the experts' compressed gradient sum (its gradient is the new grad_residual). A
  batch with "document_starts" is attended within its documents, rotary positions restarting in each
  when `restart_positions` (data.document_mask, data.restart_positions)."""
  with use_plan(plan):
    tokens, targets, mask, positions = in_sequence_order(plan, batch["inputs"], batch["targets"], batch["mask"])
    documents = documents_in_sequence_order(plan, batch.get("document_starts"), restart_positions)
    params = with_weight_placed_gradients(params)
    return lm_loss_terms(nnx.merge(graphdef, params, others), tokens, targets, mask, positions, grad_residual,
                         documents)


def _make_train_step(graphdef, optimizer, schedule, config: Config, plan: ParallelPlan, shardings) -> Callable:
  moe, count = config.model.moe, config.train.grad_accum_steps
  grad_shardings = plan.param_shardings(shardings.params)
  weight_shardings = plan.weight_shardings(shardings.params)
  accumulator_shardings = master_weights.accumulator_shardings(shardings.params, grad_shardings,
                                                               weight_shardings)
  dtypes = master_weights.compute_dtypes(shardings.params, config.model.dtype)
  stacked = nonfinite.stacked_leaves(shardings.params)

  def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict]:
    total_tokens = jnp.sum(batch["mask"])
    # Under a distributed optimizer the model computes with a copy of the float32 master in its compute
    # dtype, gathered once here for every micro-batch (training/master_weights.py).
    weights = (master_weights.resident(state.params, dtypes, weight_shardings) if plan.distributed_optimizer
               else state.params)
    in_float32 = lambda grads: jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def loss_of(params, grad_residual, micro, earlier_load_LE):
      terms = loss_terms(graphdef, params, state.others, micro, plan, grad_residual, config.data.restart_positions)
      if moe.balance_loss == "global_batch":  # against the step's loads so far (MoEConfig.balance_loss)
        terms = {**terms, "aux_loss": global_batch_balance_loss(terms, earlier_load_LE)}
      return combine_loss_terms(terms, moe, total_tokens, count), terms

    # grad_residual's "gradient" is the new grad_residual: what the compressed sums lost (gradient_sync.py).
    grad_fn = jax.value_and_grad(loss_of, argnums=(0, 1), has_aux=True)
    no_load = jnp.zeros((config.model.num_layers - config.model.num_dense_layers, moe.num_experts), jnp.float32)
    if count == 1:
      (loss, terms), (grads, grad_residual) = grad_fn(weights, state.grad_residual, batch, no_load)
      grads, terms = in_float32(grads), jax.tree.map(lambda x: x[None], terms)
    else:
      def accumulate(carry, micro):
        loss_sum, grad_sum, grad_residual, load_LE = carry
        # Each micro-batch's compressed sum is a round of error feedback: what it loses enters the next.
        (loss, terms), (grads, grad_residual) = grad_fn(weights, grad_residual, micro, load_LE)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, in_float32(grads)), grad_residual,
                load_LE + terms["expert_load"]), terms

      grad_zeros = jax.tree.map(jnp.zeros_like, state.params)
      if plan.distributed_optimizer:  # where each weight's sums are cheapest (training/master_weights.py)
        grad_zeros = jax.lax.with_sharding_constraint(grad_zeros, accumulator_shardings)
      zeros = (jnp.zeros((), jnp.float32), grad_zeros, state.grad_residual, no_load)
      (loss, grads, grad_residual, _), terms = jax.lax.scan(accumulate, zeros, _microbatches(batch, count))
    grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
    grad_sq_norms = nonfinite.squared_norms(grads, stacked)
    grad_norm = jnp.sqrt(sum(jnp.sum(x) for x in grad_sq_norms))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # A capped MoE receive buffer that overflowed left rows out: the step is not taken (its state, step
    # count and key stay as they were), and the loop runs it again with worst-case buffers
    # (parallel.moe_buffer_factor; `fallback_step`).
    buffer_use = jnp.max(terms["buffer_use"], axis=0)
    overflowed = jnp.any(buffer_use > 1.0)
    taken = finite & ~overflowed

    expert_load = jnp.sum(terms["expert_load"], axis=0)

    def update(params, others, opt_state):
      updates, opt_state = optimizer.update(grads, opt_state, params)
      params = optax.apply_updates(params, updates)
      model = nnx.merge(graphdef, params, others)
      model.update_expert_bias(expert_load)
      _, _, others = nnx.split(model, nnx.Param, ...)
      return params, others, opt_state

    kept = nonfinite.guard(taken, update, (state.params, state.others, state.opt_state))
    grad_residual = jax.tree.map(lambda new, old: jnp.where(taken, new, old), grad_residual, state.grad_residual)
    new_state = TrainState(jnp.where(overflowed, state.step, state.step + 1), *kept,
                           jnp.where(overflowed, state.rng, jax.random.split(state.rng)[0]), grad_residual)
    metrics = {
        "loss": loss, "cross_entropy": jnp.sum(terms["ce_sum"]) / jnp.maximum(total_tokens, 1.0),
        "aux_loss": jnp.mean(terms["aux_loss"]), "z_loss": jnp.mean(terms["z_loss"]),
        "grad_norm": grad_norm,
        "learning_rate": schedule(optimizer_lib.applied_updates(state.opt_state)),  # what this update used
        "expert_load": expert_load, "dropped_fraction": jnp.mean(terms["dropped_fraction"], axis=0),
        "tokens": total_tokens, "finite": finite, "grad_sq_norms": grad_sq_norms,
        "moe_buffer_use": buffer_use, "overflowed": overflowed,
    }
    return new_state, metrics

  # Metrics are small and replicated, so every process can read them.
  return jax.jit(train_step, in_shardings=(shardings, None), out_shardings=(shardings, plan.replicated()),
                 donate_argnums=0)


def _make_eval_step(graphdef, config: Config, plan: ParallelPlan) -> Callable:
  def eval_step(params, others, batch):
    if plan.distributed_optimizer:  # the weights the train step computes with, gathered once per eval batch
      dtypes = master_weights.compute_dtypes(params, config.model.dtype)
      params = master_weights.resident(params, dtypes, plan.weight_shardings(params))
    terms = loss_terms(graphdef, params, others, batch, plan, restart_positions=config.data.restart_positions)
    return {"ce_sum": terms["ce_sum"], "tokens": terms["tokens"]}

  return jax.jit(eval_step, out_shardings=plan.replicated())
