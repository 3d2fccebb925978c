"""The vocabulary of the parallel plan (sharding/plan.py): the tiers, the fused kernels' backends and the
process layout they need, and the records of each op's choice and of the experts' layout.

Plain data and the rules that depend only on the config (`process_layout`, which the launchers ask before
any device exists); the decisions that need the mesh and the devices are ParallelPlan's.
"""

from __future__ import annotations

import dataclasses

from jax.sharding import PartitionSpec

from meshmoe.config import ParallelConfig
from meshmoe.pallas_kernels import mosaic_tiles
from meshmoe.sharding.grouped_gemm_kernels import GemmKernels
from meshmoe.sharding.parallel import Axes

# The logical axes of the residual stream's tokens [B, S, ...], its last dimension left out: where the
# parallel ops find each device's tokens.
STREAM_TOKENS = ("act_batch", "act_seq", None)


@dataclasses.dataclass(frozen=True)
class Tier:
  """What a tier (`parallel.impl`) runs, op by op, before any fallback."""

  ring_attention: str  # the implementation behind attention kind "ring"
  gathered_projection: str  # a projection that gathers (scatters) the sequence over tensor-parallel axes
  moe_pipeline: bool  # expert parallelism in `parallel.moe_chunks` pipelined chunks (else in one pass)
  fused_kernels: bool  # meshmoe.pallas_kernels' fused kernels where they apply, this tier's rest elsewhere


TIERS = {
    "reference": Tier(ring_attention="ring", gathered_projection="collectives", moe_pipeline=False,
                      fused_kernels=False),
    "xla": Tier(ring_attention="zigzag_ring", gathered_projection="ring", moe_pipeline=True,
                fused_kernels=False),
    "pallas": Tier(ring_attention="zigzag_ring", gathered_projection="ring", moe_pipeline=True,
                   fused_kernels=True),
}

# `parallel.kernel_backend` -> the backend of meshmoe.pallas_kernels that runs the fused kernels.
# "auto": Mosaic GPU on Hopper, the op's unfused implementation elsewhere; "mosaic_gpu": Mosaic GPU, and a
# ConfigError where a kernel cannot run; "collectives": every kernel's plain-collective version (its
# reference.py), on any platform and shape, to check the tier's layouts.
FUSED_KERNEL_BACKENDS = {"auto": "mosaic_gpu", "mosaic_gpu": "mosaic_gpu", "collectives": "collectives"}

# What the launchers do about it (experiments/slurm/train.sbatch, experiments.launch: `process_layout`).
ONE_PROCESS_PER_NODE = ("run one process per node (train.sbatch and experiments.launch do for parallel.impl="
                        "'pallas'), with the ring's axes inside a node")


def process_layout(parallel: ParallelConfig) -> tuple[str, str]:
  """("node", why) where a run of these parallel options needs one process to drive every device of a node
  (the tier's communicating Mosaic GPU kernels store into peers' memory, so every device of their rings
  must be in one process; rings stay inside a node: sharding/mesh.py), else ("any", why not). From the
  config alone, before any device is known: the launchers ask before they start the processes."""
  if not TIERS[parallel.impl].fused_kernels:
    return "any", f"parallel.impl={parallel.impl!r} runs no fused kernels"
  if FUSED_KERNEL_BACKENDS[parallel.kernel_backend] != "mosaic_gpu":
    return "any", f"parallel.kernel_backend={parallel.kernel_backend!r} runs the kernels as plain collectives"
  return "node", (f"parallel.impl={parallel.impl!r}: its Mosaic GPU kernels store into peer GPUs' memory, so "
                  "one process must drive every GPU of their rings")


@dataclasses.dataclass(frozen=True)
class OpChoice:
  """How one op runs: a key of the op's implementation table, what it does, and for fused kernels their
  backend; `fallback` says why the tier's first choice does not run (empty when it does)."""

  implementation: str
  detail: str = ""
  kernel_backend: str = ""
  fallback: str = ""
  tiles: mosaic_tiles.Tiles = mosaic_tiles.DEFAULT_TILES  # fused kernels: their tiles (`parallel.kernel_tiles`)


@dataclasses.dataclass(frozen=True)
class ExpertChoice(OpChoice):
  """The routed experts' choice: besides OpChoice, how their unfused paths exchange and multiply."""

  exchange: str = ""  # "ragged_all_to_all" (GPU) or "padded_all_to_all" (XLA:CPU has no ragged one)
  grouped_gemm: str = ""  # "kernels", "ragged_dot" or "blocked" (sharding/grouped_ffn.py)
  gemm_kernels: GemmKernels | None = None  # the three forms' kernels, for "kernels"
  block_rows: int = 0  # rows per overflow tile of the blocked GEMM; 0: blocked_gemm.DEFAULT_TILE_ROWS
  chunks: int = 1  # pipelined chunks of each device's tokens (clamped to the tokens: moe_pipeline)
  # Receive buffers (`parallel.moe_buffer_factor`): 0 for the dropless worst case, f >= 1 for f x the rows of
  # balanced routing (expert_parallel.receive_rows), the step redone with worst-case buffers on overflow.
  buffer_factor: float = 0.0
  # Wire formats (config.EXCHANGE_FORMATS) of the dispatch and of the combine's return exchange, each as
  # (forward, backward): `parallel.moe_{dispatch,combine}_dtype` and `moe_exchange_grad_dtype`.
  dispatch_formats: tuple[str, str] = ("auto", "auto")
  combine_formats: tuple[str, str] = ("auto", "auto")
  # The fused kernels' SwiGLU gradient: gate and up "recompute"d per tile or "keep"t from the forward
  # (`parallel.moe_swiglu_gradient`).
  swiglu_gradient: str = "recompute"


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
  """Where the routed experts' work lives on the mesh (expert_parallel.py)."""

  token_spec: PartitionSpec  # the tokens [B, S, ...] as the residual stream holds them
  gate_spec: PartitionSpec  # [E, D, F] inside the op (D whole)
  down_spec: PartitionSpec  # [E, F, D] inside the op
  # D split for storage only (FSDP, `mesh.weight_storage`) over axes that split the tokens: the op takes the
  # weights so (`gate_shard_spec`, `down_shard_spec`) and all-gathers D over `weight_gather` itself
  # (expert_parallel._gather_stored); () where there is nothing to gather.
  gate_shard_spec: PartitionSpec
  down_shard_spec: PartitionSpec
  weight_gather: Axes
  expert_axes: Axes  # split the experts: expert parallelism over their product, `ep`
  width_axes: Axes  # split each expert's width (expert-tensor parallelism)
  token_dim: int  # the token dimension (0 batch, 1 sequence) gathered over `gather`
  gather: Axes  # width axes that also split the tokens: tokens gathered before, reduce-scattered after
  reduce: Axes  # width axes that do not split the tokens: partial sums psum-ed after
  ep: int


def describe_axes(plan, axes: Axes) -> str:
  """Mesh axes in words, with their devices: "expert x tensor (8 devices)"."""
  n = plan.axis_size(axes)
  return " x ".join(axes) + f" ({n} device{'s' if n != 1 else ''})"
