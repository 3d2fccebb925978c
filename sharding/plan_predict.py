"""The parallel plan's predictions for a config's shapes (ParallelPlan.build): every op's choice as the op
will make it when it traces those shapes, recorded for the table, plan.json and the cost model, and the
choices that depend on the config beyond the shapes (the gradient sums, the MoE layers' schedule)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from meshmoe.config import Config, ConfigError
from meshmoe.sharding import parallel
from meshmoe.sharding.plan_choices import STREAM_TOKENS, OpChoice, describe_axes
from meshmoe.sharding.projection_blocks import attention_width, projection_blocks


def predict(plan, config: Config) -> dict[str, OpChoice]:
  """Every op's choice for the shapes `config` gives each device (the table, plan.json, the cost model)."""
  m, moe, t = config.model, config.model.moe, config.train
  dtype = jnp.dtype(m.dtype)
  token_spec = plan.activation_spec(STREAM_TOKENS)
  rows = (t.global_batch_size // t.grad_accum_steps // plan.axis_size(parallel.dim_axes(token_spec, 0))
          * (t.seq_len // plan.axis_size(parallel.dim_axes(token_spec, 1))))
  ops: dict[str, OpChoice] = {"attention": plan.attention(dtype, attention_width(m))}
  for block in projection_blocks(config):
    tp_axes, gather = plan.projection_axes([names for names, _, _ in block.weights_in])
    local = lambda names, width: width // plan.axis_size(parallel.all_axes(plan.weight_spec(names)))
    in_width = sum(local(names, width) for names, width, _ in block.weights_in)
    ops[f"{block.name}.project_in"] = plan.project_in(gather, rows, block.gathered, in_width, dtype)
    directions = [(f"{block.name}.project_in", "input gradients")]
    if block.weight_out:
      ops[f"{block.name}.project_out"] = plan.project_out(gather, rows, local(*block.weight_out), m.embed_dim,
                                                          dtype)
      directions.append((f"{block.name}.project_out", "partial sums"))
    replicated = parallel.without(tp_axes, gather)
    for name, what in directions:
      if ops[name].implementation == "local":  # say what the matmuls need besides themselves
        reduced = plan.axis_size(replicated) > 1
        detail = f"{what} all-reduced over {describe_axes(plan, replicated)}" if reduced else "no communication"
        ops[name] = dataclasses.replace(ops[name], detail=detail)
  if m.num_layers > m.num_dense_layers:
    lay = plan.expert_layout()
    width = moe.expert_mlp_dim // plan.axis_size(lay.width_axes)
    ops["moe"] = plan.expert_ffn(lay.ep, m.embed_dim, width, dtype)
    ops["layer"] = _layer_schedule(plan, config, ops["moe"])
  ops["gradients"] = _gradient_sync(plan, config)
  return ops


def _gradient_sync(plan, config: Config) -> OpChoice:
  """How gradients are summed over the replicas (ParallelConfig.gradient_compression, gradient_sync.py)."""
  p = plan.parallel
  exact = ("all-reduce over the devices that hold different tokens (in the ops' backward passes; GSPMD's "
           "outside them)")
  if p.gradient_compression == "none":
    return OpChoice("xla", exact)
  m = config.model
  axes = plan.gradient_replica_axes
  if m.num_layers == m.num_dense_layers:
    problem = "the model has no MoE layers, whose experts' gradients it compresses"
  elif plan.axis_size(axes) == 1:
    problem = (f"under preset {plan.preset!r} on this mesh every device that holds an expert's weights computes "
               "the same tokens' share of its gradient or holds other experts: there are no replicas to sum over")
  elif set(parallel.all_axes(plan.param_spec(("exp", "embed", "exp_mlp")))) & set(axes):
    problem = (f"preset {plan.preset!r} stores the experts split over {' x '.join(axes)} (FSDP), so their "
               "gradients are reduce-scattered there, not summed")
  else:
    feedback = " with error feedback" if plan.gradient_feedback else ""
    return OpChoice(p.gradient_compression, (
        f"the routed experts' gradients summed over {describe_axes(plan, axes)} in {p.gradient_compression}"
        f"{feedback}; the other weights': {exact}"))
  raise ConfigError("parallel.gradient_compression", p.gradient_compression,
                    f"{problem}; use 'none'")


def _layer_schedule(plan, config: Config, moe: OpChoice) -> OpChoice:
  """How MoE layers order attention and the MoE (ParallelConfig.layer_schedule, models/decoder.py)."""
  if plan.parallel.layer_schedule == "sequential":
    return OpChoice("sequential", "attention, then the MoE")
  t = config.train
  batch_axes = parallel.dim_axes(plan.activation_spec(STREAM_TOKENS), 0)
  rows = t.global_batch_size // t.grad_accum_steps // plan.axis_size(batch_axes)
  if rows % 2:
    raise ConfigError("parallel.layer_schedule", "two_halves", (
        f"it cuts each device's rows (sequences) of a micro-batch in two, and here each device has {rows} "
        f"(train.global_batch_size={t.global_batch_size} / train.grad_accum_steps={t.grad_accum_steps} / "
        f"{plan.axis_size(batch_axes)} batch shards): use an even number per device, or 'sequential'"))
  detail = ("each device's rows in two halves whose attention and MoE alternate, one half's token exchanges "
            "beside the other's compute")
  if moe.implementation == "local":
    detail += "; here the MoE exchanges no tokens, so there is nothing to hide"
  return OpChoice("two_halves", detail)
