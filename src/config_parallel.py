"""The mesh and parallel sections of meshmoe.config: `MeshConfig`, `ParallelConfig`, their choices and checks.

Plain data, like the rest of meshmoe.config: it imports nothing of meshmoe but the config's own modules.
Import these names from meshmoe.config.
"""

import dataclasses
import math

from meshmoe.config_checks import ConfigError, check_bool, check_choice, check_int, check_positive_int, is_number

MESH_AXES = ("data", "expert", "tensor", "sequence")
PRESETS = ("dp", "fsdp", "zero1", "ep", "tp_sp", "megascale")
# Where weights are stored beside the preset's placement (MeshConfig.weight_storage, sharding/rules.py).
WEIGHT_STORAGES = ("preset", "data", "all")
# Where the optimizer keeps its state (MeshConfig.optimizer_storage, sharding/rules.py, `with_optimizer_storage`).
OPTIMIZER_STORAGES = ("weights", "data", "all")
# Parallel-op tiers: what each runs is meshmoe.sharding.plan.TIERS.
IMPLS = ("reference", "xla", "pallas")
KERNEL_BACKENDS = ("auto", "mosaic_gpu", "collectives")
ATTENTION_KINDS = ("allgather", "ring", "ulysses")
ATTENTION_KERNELS = ("auto", "einsum", "tokamax")
# meshmoe.runtime.xla_flags.PRESETS
XLA_FLAG_PRESETS = ("none", "overlap", "overlap_double_buffered", "overlap_windowed_einsum")
GROUPED_GEMMS = ("auto", "blocked", "kernels", "ragged_dot")
# The grouped GEMM's forms and the GPU implementations of each (sharding/grouped_gemm_kernels.py).
GEMM_FORMS = ("forward", "input_gradient", "weight_gradient")
GEMM_IMPLEMENTATIONS = ("tokamax_mosaic", "tokamax_triton", "jax_mgpu", "xla", "xla_cudnn", "meshmoe_mosaic")
# Wire formats of the MoE token exchanges (sharding/exchange_formats.py).
EXCHANGE_FORMATS = ("auto", "bfloat16", "float8_e4m3fn")
EXCHANGE_FORMAT_FIELDS = ("moe_dispatch_dtype", "moe_combine_dtype", "moe_exchange_grad_dtype")  # of `parallel`
# How an MoE layer orders its attention and MoE (models/decoder.py).
LAYER_SCHEDULES = ("sequential", "two_halves")
# How the fused MoE kernels' SwiGLU gets gate and up for its gradient (pallas_kernels/moe_dispatch_gemm/swiglu.py).
SWIGLU_GRADIENTS = ("recompute", "keep")
# The Mosaic GPU kernels' thread-block layouts (pallas_kernels/mosaic_tiles.LAYOUTS).
KERNEL_TILES = ("one_warpgroup", "warp_specialized")
# How the routed experts' gradients are summed over `data` (sharding/gradient_sync.py).
GRADIENT_COMPRESSIONS = ("none", "bfloat16", "int8", "sign")


@dataclasses.dataclass(kw_only=True)
class MeshConfig:
  """Mesh axis sizes; one of them may be -1 to take the remaining devices."""

  data: int = -1
  expert: int = 1
  tensor: int = 1
  sequence: int = 1
  preset: str = "ep"  # rules preset, see meshmoe.sharding.rules
  # Where the weights (and their gradients and Adam moments) are stored (sharding/rules.py, `with_storage`):
  # "preset" as the preset places them; "data" also splits every weight's model dimension (`embed`) over
  # `data` (expert-data parallelism: the experts' storage split over `expert` and `data`); "all" over every
  # mesh axis the preset leaves the weight replicated on (ZeRO-3/FSDP on top of the preset). It exists for
  # models whose float32 weights, gradients and Adam state do not fit otherwise (DeepSeek-V3: experts split
  # only over `expert` and `tensor`, the other weights only over `tensor`). It costs an all-gather of each
  # layer's weights in the forward, and again in the backward under remat; gradients are summed to each
  # device's slice (reduce-scattered where XLA forms one, on GPUs; moe_1b's routed experts' bfloat16 sum
  # stays an all-reduce, then sliced) instead of all-reduced whole. moe_1b, megascale on 4 x 2 H100s
  # (compiled): 14.5 GB peak per device as the preset stores it, 7.7 GB with "data".
  weight_storage: str = "preset"
  # MoE parallel folding (sharding/rules.py, `fold_experts`): the mesh axes that split the routed experts, set
  # apart from how attention and the dense layers use those axes. "preset" (the preset's own: `expert`, or
  # none for dp/fsdp/zero1), "none" (every device holds every expert) or mesh axes joined by commas, major
  # first: "expert,tensor" spreads the experts over the devices attention also splits by tensor parallelism,
  # "data,expert,tensor" over every device, so that each holds its experts whole and no expert weight is
  # gathered or replicated. Each axis must split the tokens (the token exchange runs between the devices
  # that hold different tokens and different experts).
  expert_axes: str = "preset"
  # The mesh axes that split each routed expert's width (expert-tensor parallelism): "preset" (the preset's
  # own, less any axis `expert_axes` takes), "none" (each expert's width whole) or mesh axes joined by commas.
  expert_width_axes: str = "preset"
  # The distributed optimizer (ZeRO-1; Megatron-Core's name; training/master_weights.py): "weights" keeps the
  # float32 weights, their gradients and the Adam moments where `weight_storage` puts the weights (the float32
  # weights are what the model computes with, cast in each layer). "data" or "all" keeps a float32 master copy
  # of the weights and the moments split further, over `data` or over every axis (their `embed` dimension),
  # and the model computes with a copy of the weights in its compute dtype, placed as `weight_storage` says
  # and made once per step from the master (an all-gather per step, not per micro-batch). Each micro-batch's
  # gradient of the layers' weights is summed into the master's slices of a float32 accumulator (a
  # reduce-scatter on GPUs, where "weights" all-reduces it); the tables' once per step. Bytes per parameter:
  # 16 (float32 weights, gradient, two moments) become 2 (bfloat16 weights) + 16 / N (master, gradient and
  # moments over N devices).
  optimizer_storage: str = "weights"

  def sizes(self) -> dict[str, int]:
    return {axis: getattr(self, axis) for axis in MESH_AXES}


@dataclasses.dataclass(kw_only=True)
class ParallelConfig:
  # Parallel-op tier (ARCHITECTURE.md): "reference" (plain collectives under shard_map), "xla" (decomposed so
  # that XLA's asynchronous collectives overlap independent compute: ring collective matmuls, a chunked
  # MoE dispatch/GEMM/combine pipeline, ring attention that overlaps each transfer with a block) or
  # "pallas" (fused communication + GEMM kernels of meshmoe.pallas_kernels on Hopper GPUs; an op runs
  # its "xla" tier where no kernel applies: other platforms, shapes the kernels do not tile, attention).
  impl: str = "reference"
  # impl="pallas": "auto" runs the Mosaic GPU kernels on Hopper GPUs where their rings are driven by one
  # process (each op's "xla" tier elsewhere, the plan says why); "mosaic_gpu" runs them too, but a layout
  # where one cannot run (another GPU, a shape they do not tile, a ring across processes) is a ConfigError;
  # "collectives" runs the tier's layouts with each kernel replaced by its plain-collective version (the
  # kernel's reference.py), on any platform (to check the tier on CPU).
  kernel_backend: str = "auto"
  # impl="pallas" on Hopper: the Mosaic GPU kernels' thread blocks (pallas_kernels/mosaic_tiles.LAYOUTS):
  # "one_warpgroup" (64 x 128 tiles; one warpgroup loads, multiplies and communicates) or "warp_specialized"
  # (Hopper's GEMM layout: 128 x 256 tiles, a producer warpgroup loading and communicating, two consumers
  # multiplying, and in the MoE dispatch a sender putting to the peers meanwhile; the MoE tile plan's tiles
  # are 128 rows). Both verified without a GPU; not yet timed.
  kernel_tiles: str = "one_warpgroup"
  # Attention over a sequence split across devices (sharding/context_parallel.py): "allgather" (gather
  # K/V, load-balanced causal blocks), "ring" (K/V blocks passed around a ring) or "ulysses" (all-to-all
  # from sequence-split to head-split; needs the KV heads divisible by the sequence split).
  attention: str = "allgather"
  # What computes attention's blocks (sharding/attention_kernels.py): "auto" picks per device: tokamax's
  # flash attention on GPUs ("mosaic" on compute capability 9.x/10.x, "triton" on 8.x; bf16/fp16 operands,
  # head_dim <= 256), the einsum blocks (float32 scores in memory) elsewhere; "einsum" always the einsum
  # blocks; "tokamax" tokamax's kernels on GPUs and its plain-XLA version on CPUs (to check the kernel path).
  attention_kernel: str = "auto"
  # impl="xla": each device's MoE tokens go through dispatch -> expert GEMM -> combine in this many
  # chunks, so one chunk's all-to-alls overlap another chunk's GEMM. 1 turns the pipeline off.
  moe_chunks: int = 2
  # The expert-parallel token exchange's receive buffers (the `all_to_all` path; sharding/expert_parallel.py,
  # "Receive buffers"). 0: each is sized for the dropless worst case, every peer's rows coming to one device
  # (ep x min(top_k, E/ep) x the tokens a device routes: 32 x the balanced rows for DeepSeek-V3 on 256 GPUs).
  # f >= 1: f x the rows a device receives under balanced routing (top_k x its tokens). A step whose
  # routing sends some device more rows than its buffer holds is not taken: the state stays as it was and
  # the step runs again on the same batch with worst-case buffers, in `moe_fallback_grad_accum_steps`
  # micro-batches (the dropless fallback), so no assignment is ever dropped. metrics.jsonl records the
  # fullest buffer of each MoE layer (`moe_buffer_use`, 1 = full) and the fallback steps.
  moe_buffer_factor: float = 0.0
  # The dropless fallback's micro-batches: 0 takes train.grad_accum_steps; more fit its worst-case buffers
  # into less memory (the planner picks the fewest that fit). A divisor of train.global_batch_size.
  moe_fallback_grad_accum_steps: int = 0
  # The routed experts' grouped GEMM where no fused kernel runs (sharding/grouped_ffn.py): "auto" picks per
  # platform: "blocked" on CPU, "kernels" on GPUs, "ragged_dot" (XLA's own; dense over every expert) elsewhere.
  # "kernels": for each form (forward, input gradient, weight gradient) the GPU kernel that measurements
  # chose for the GPU, dtype and widths (sharding/gpu_kernel_table.py; off GPUs XLA's ragged dot, to check
  # the path); on GPUs without kernels, or for float32 operands, the blocked GEMM, as the plan says.
  grouped_gemm: str = "auto"
  # "kernels" on GPUs: your choice for some forms over the measured one, "form=implementation,..." (e.g.
  # "weight_gradient=meshmoe_mosaic"; GEMM_FORMS, GEMM_IMPLEMENTATIONS).
  gemm_kernels: str = ""
  # "kernels" on GPUs: a measure.jsonl of experiments/benchmarks/gpu_measure.py run at your own shapes (the
  # opt-in tuning; nothing autotunes by default), read before the packaged table.
  kernel_table: str = ""
  gemm_block_rows: int = 0  # rows per overflow tile of the "blocked" GEMM; 0: its default (16)
  # How the expert-parallel token exchanges travel (sharding/exchange_formats.py): "auto" in the activation
  # dtype, "bfloat16", or "float8_e4m3fn" (float8 with a float32 scale per 128 channels, DeepEP's format;
  # about half of bfloat16's bytes). The dispatch sends tokens to their experts; the combine returns the
  # experts' outputs (summed in float32 either way); the grad format is both exchanges' backward. They apply
  # to the `all_to_all` expert path; the fused kernels (pallas tier) do not run when one is set.
  moe_dispatch_dtype: str = "auto"
  moe_combine_dtype: str = "auto"
  moe_exchange_grad_dtype: str = "auto"
  # How each MoE layer orders its work (models/decoder.py): "sequential" (attention, then the MoE) or
  # "two_halves": each device's rows of the micro-batch are cut into two halves whose attention and MoE
  # alternate, so one half's token exchanges run beside the other half's attention or expert GEMMs
  # (inter-operator overlap, as in MegaScale-MoE). Same results: attention, routing and expert capacity are
  # per sequence. Needs an even number of rows per device; applies where the MoE exchanges tokens.
  layer_schedule: str = "sequential"
  # impl="pallas": the fused MoE kernels compute SwiGLU in the dispatch kernel, and its gradient either
  # "recompute"s gate and up per tile in the backward (no [R, F] gate or up buffer exists, R the dropless
  # worst-case receive rows; 2 more of the layer's 9 expert GEMM units) or "keep"s them from the forward
  # (2 x [R, F] per layer; under remat only the layer being differentiated holds them). Mixtral-8x7B on
  # 64 H100s: 48.8 GB peak recomputing, 50.7 GB keeping (compiled), and 1.185x against 1.016x the useful
  # expert FLOPs (modelled; experiments/benchmarks/RESULTS.md). Keep where memory is not short.
  moe_swiglu_gradient: str = "recompute"
  # How the routed experts' gradients are summed over their replicas, the devices that hold the same experts
  # and compute on other tokens (`data`, and `sequence` where it splits the tokens; sharding/gradient_sync.py):
  # "none" (as computed: float32, or bfloat16 in a bfloat16 model), "bfloat16", "int8" (a float32 scale per
  # 128 values; about half of bfloat16's bytes) or "sign" (1 bit per value and a scale per 128 values, then
  # int8: about 30% of bfloat16's). The other weights' gradients are summed in full precision. Needs MoE
  # layers and more than one replica.
  gradient_compression: str = "none"
  # For "int8" and "sign": keep what each device's compression lost and add it to its next gradient (a
  # float32 copy of the device's expert weights, checkpointed). Off by default: AdamW's per-value
  # normalisation already makes its steps sign-like, and feedback does not help it (tiny_moe, 4 seeds: sign
  # compression 0.09 nats worse with it, 0.02 without; int8 alike either way; experiments/benchmarks/RESULTS.md).
  gradient_error_feedback: bool = False
  # XLA flag preset for GPUs (src/runtime/xla_flags.py): "overlap" (latency-hiding scheduler, reductions
  # pipelined across loop iterations, combining), "overlap_double_buffered" (also double-buffered loops: more
  # memory), "overlap_windowed_einsum" or "none" (XLA's defaults).
  xla_flags: str = "overlap"

  def validate(self) -> "ParallelConfig":
    """Checks every field (Config.validate does, and so does a parallel plan built without a Config)."""
    check_choice("parallel.impl", self.impl, IMPLS)
    check_choice("parallel.kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
    check_choice("parallel.kernel_tiles", self.kernel_tiles, KERNEL_TILES)
    check_choice("parallel.attention", self.attention, ATTENTION_KINDS)
    check_choice("parallel.attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
    check_positive_int("parallel.moe_chunks", self.moe_chunks)
    if not is_number(self.moe_buffer_factor) or not (self.moe_buffer_factor == 0 or 1 <= self.moe_buffer_factor
                                                     < math.inf):
      raise ConfigError("parallel.moe_buffer_factor", self.moe_buffer_factor,
                        "0 (receive buffers for the dropless worst case) or a number >= 1 (that many times the "
                        "rows of balanced routing; an overflowing step runs again with worst-case buffers)")
    check_int("parallel.moe_fallback_grad_accum_steps", self.moe_fallback_grad_accum_steps, 0,
              "0 (train.grad_accum_steps) or a positive number of micro-batches")
    check_choice("parallel.grouped_gemm", self.grouped_gemm, GROUPED_GEMMS)
    gemm_kernel_overrides(self.gemm_kernels)
    if not isinstance(self.kernel_table, str):
      raise ConfigError("parallel.kernel_table", self.kernel_table,
                        "a path to a measure.jsonl of experiments/benchmarks/gpu_measure.py, or '' (none)")
    check_int("parallel.gemm_block_rows", self.gemm_block_rows, 0,
              "0 (chosen from the shapes) or a positive number of rows")
    for name in EXCHANGE_FORMAT_FIELDS:
      check_choice(f"parallel.{name}", getattr(self, name), EXCHANGE_FORMATS)
    check_choice("parallel.layer_schedule", self.layer_schedule, LAYER_SCHEDULES)
    check_choice("parallel.moe_swiglu_gradient", self.moe_swiglu_gradient, SWIGLU_GRADIENTS)
    check_choice("parallel.gradient_compression", self.gradient_compression, GRADIENT_COMPRESSIONS)
    check_bool("parallel.gradient_error_feedback", self.gradient_error_feedback)
    check_choice("parallel.xla_flags", self.xla_flags, XLA_FLAG_PRESETS)
    return self


def resolve_mesh_sizes(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
  """Mesh axis sizes with the -1 axis (if any) filled so that the product is `num_devices`."""
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
  validate_mesh(mesh)
  sizes = mesh.sizes()
  fixed = math.prod(s for s in sizes.values() if s != -1)
  free = [axis for axis, s in sizes.items() if s == -1]
  described = _describe(sizes)
  if free:
    if num_devices % fixed:
      raise ConfigError(
          f"mesh.{free[0]}", -1,
          f"-1 fills the devices left by the other axes, but {num_devices} devices are not divisible by "
          f"their product {fixed} ({described})")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ConfigError(
        "mesh", described,
        f"the product of the mesh axis sizes ({fixed}) must equal the device count ({num_devices}); "
        "set one axis to -1 to fill the rest")
  return sizes


def _describe(sizes: dict[str, int]) -> str:
  return ", ".join(f"{axis}={size}" for axis, size in sizes.items())


def validate_mesh(mesh: MeshConfig) -> None:
  for axis, size in mesh.sizes().items():
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ConfigError(f"mesh.{axis}", size, "a positive integer, or -1 to fill the remaining devices")
  if sum(s == -1 for s in mesh.sizes().values()) > 1:
    raise ConfigError("mesh", _describe(mesh.sizes()), "at most one axis may be -1")
  check_choice("mesh.preset", mesh.preset, PRESETS)
  check_choice("mesh.weight_storage", mesh.weight_storage, WEIGHT_STORAGES)
  check_choice("mesh.optimizer_storage", mesh.optimizer_storage, OPTIMIZER_STORAGES)
  experts = mesh_axes_choice("mesh.expert_axes", mesh.expert_axes)
  width = mesh_axes_choice("mesh.expert_width_axes", mesh.expert_width_axes)
  if experts is not None and width is not None and (both := [a for a in experts if a in width]):
    raise ConfigError("mesh.expert_width_axes", mesh.expert_width_axes, (
        f"axes other than mesh.expert_axes={mesh.expert_axes!r}: a mesh axis splits the experts or their width, "
        f"not both ({', '.join(both)})"))


def mesh_axes_choice(field: str, value: str) -> tuple[str, ...] | None:
  """A field naming mesh axes (MeshConfig.expert_axes, expert_width_axes) as a tuple; None for "preset"."""
  allowed = f"'preset', 'none', or mesh axes ({', '.join(MESH_AXES)}) joined by commas, each once"
  if not isinstance(value, str):
    raise ConfigError(field, value, allowed)
  if value == "preset":
    return None
  if value == "none":
    return ()
  axes = tuple(part.strip() for part in value.split(","))
  if any(a not in MESH_AXES for a in axes) or len(set(axes)) != len(axes):
    raise ConfigError(field, value, allowed)
  return axes


def check_weight_storage(weight_storage: str, parallel: ParallelConfig, optimizer_storage: str = "weights") -> None:
  """What `mesh.weight_storage` and `mesh.optimizer_storage` rule out among the parallel options
  (Config.validate and the parallel plan check it): a compressed gradient sum runs over replicas that each
  hold whole float32 expert weights (sharding/gradient_sync.py, its error feedback a copy of them); split
  storage reduce-scatters that gradient instead, and a distributed optimizer sums it once per step."""
  if weight_storage != "preset" and parallel.gradient_compression != "none":
    raise ConfigError("parallel.gradient_compression", parallel.gradient_compression, (
        f"'none' with mesh.weight_storage={weight_storage!r}: the compressed sum runs over replicas that each "
        "hold whole expert weights, and split storage reduce-scatters their gradient instead (or "
        "mesh.weight_storage='preset')"))
  if optimizer_storage != "weights" and parallel.gradient_compression != "none":
    raise ConfigError("parallel.gradient_compression", parallel.gradient_compression, (
        f"'none' with mesh.optimizer_storage={optimizer_storage!r}: the distributed optimizer sums the "
        "gradients into its master weights' slices in float32 (or mesh.optimizer_storage='weights')"))


def gemm_kernel_overrides(text: str) -> dict[str, str]:
  """`parallel.gemm_kernels` ("form=implementation,...") as {form: implementation}; ConfigError if malformed."""
  allowed = (f"comma-separated form=implementation, each form once; forms: {', '.join(GEMM_FORMS)}; "
             f"implementations: {', '.join(GEMM_IMPLEMENTATIONS)}")
  if not isinstance(text, str):
    raise ConfigError("parallel.gemm_kernels", text, allowed)
  overrides = {}
  for item in filter(None, (part.strip() for part in text.split(","))):
    form, _, implementation = item.partition("=")
    if form not in GEMM_FORMS or implementation not in GEMM_IMPLEMENTATIONS or form in overrides:
      raise ConfigError("parallel.gemm_kernels", text, allowed)
    overrides[form] = implementation
  return overrides
