"""Typed configuration for meshmoe, validated up front.

Every section is a plain dataclass so that experiment files, notebooks and absl `--config.a.b=v` overrides
all edit the same fields. `Config.validate(num_devices)` checks every field, and the mesh against the device
count, before any array is built; a bad value raises one `ConfigError` that names the field, the value and
what is allowed. This module is plain data that every layer imports, so it imports nothing of meshmoe.

What depends on the rules table (a dimension that a preset splits over mesh axes must divide evenly) is
checked where the table lives, when the run's parallel plan is built (meshmoe.sharding.plan,
`ParallelPlan.build`), also before any array is built.
"""


import dataclasses
import math
from typing import Any

MESH_AXES = ("data", "expert", "tensor", "sequence")
PRESETS = ("dp", "fsdp", "zero1", "ep", "tp_sp", "megascale")
# Where weights are stored beside the preset's placement (MeshConfig.weight_storage, sharding/rules.py).
WEIGHT_STORAGES = ("preset", "data", "all")
# Parallel-op tiers: what each runs is meshmoe.sharding.plan.TIERS.
IMPLS = ("reference", "xla", "pallas")
KERNEL_BACKENDS = ("auto", "collectives")
ATTENTION_KINDS = ("allgather", "ring", "ulysses")
ATTENTION_KERNELS = ("auto", "einsum", "tokamax")
# meshmoe.runtime.xla_flags.PRESETS
XLA_FLAG_PRESETS = ("none", "overlap", "overlap_double_buffered", "overlap_windowed_einsum")
DTYPES = ("float32", "bfloat16")
SCORE_FNS = ("softmax", "sigmoid")
ATTENTION_TYPES = ("gqa", "mla")
GROUPED_GEMMS = ("auto", "blocked", "kernels", "ragged_dot")
# The grouped GEMM's forms and the GPU implementations of each (sharding/grouped_gemm_kernels.py).
GEMM_FORMS = ("forward", "input_gradient", "weight_gradient")
GEMM_IMPLEMENTATIONS = ("tokamax_mosaic", "tokamax_triton", "jax_mgpu", "xla", "xla_cudnn", "meshmoe_mosaic")
# Wire formats of the MoE token exchanges (sharding/exchange_formats.py).
EXCHANGE_FORMATS = ("auto", "bfloat16", "float8_e4m3fn")
EXCHANGE_FORMAT_FIELDS = ("moe_dispatch_dtype", "moe_combine_dtype", "moe_exchange_grad_dtype")  # of `parallel`
REMAT_POLICIES = ("none", "full", "dots")
# How an MoE layer orders its attention and MoE (models/decoder.py).
LAYER_SCHEDULES = ("sequential", "two_halves")
# How the fused MoE kernels' SwiGLU gets gate and up for its gradient (pallas_kernels/moe_dispatch_gemm/swiglu.py).
SWIGLU_GRADIENTS = ("recompute", "keep")
# The Mosaic GPU kernels' thread-block layouts (pallas_kernels/mosaic_tiles.LAYOUTS).
KERNEL_TILES = ("one_warpgroup", "warp_specialized")
# How the routed experts' gradients are summed over `data` (sharding/gradient_sync.py).
GRADIENT_COMPRESSIONS = ("none", "bfloat16", "int8", "sign")
# Raw sources are tokenized into a cache on first use; "tokenized" reads experiments.tokenize's folders.
DATA_SOURCES = ("stdlib", "text", "jsonl", "parquet", "arrayrecord", "tokenized")
NAN_POLICIES = ("halt", "skip")


class ConfigError(ValueError):
  """An invalid configuration value: names the field, the value and what is allowed."""

  def __init__(self, field: str, value: Any, allowed: str):
    self.field, self.value, self.allowed = field, value, allowed
    super().__init__(f"config.{field}={value!r} is invalid: {allowed}")


@dataclasses.dataclass(kw_only=True)
class MoEConfig:
  num_experts: int = 8
  top_k: int = 2
  expert_mlp_dim: int = 256
  num_shared_experts: int = 0  # each shared expert is a SwiGLU of width expert_mlp_dim
  score_fn: str = "softmax"  # softmax (Mixtral, Qwen3) or sigmoid (DeepSeek-V3)
  normalize_top_k: bool = True  # rescale the chosen k weights to sum to 1
  routed_scaling: float = 1.0  # multiplies the routed output (DeepSeek-V3: 2.5)
  # Group-limited routing (DeepSeek-V3's node-limited routing): the experts form `num_groups` equal groups
  # (in id order); each token ranks the groups by the sum of their two highest selection scores, keeps the
  # best `top_k_groups` and picks its top_k experts among theirs. 1 group: no limit.
  num_groups: int = 1
  top_k_groups: int = 1
  # Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores only to choose experts.
  # It is a non-trainable variable, nudged by `update_rate * sign(mean load - load)` after each step.
  expert_bias: bool = False
  expert_bias_update_rate: float = 1e-3
  aux_loss_weight: float = 0.01  # Switch-style load-balancing loss
  z_loss_weight: float = 1e-3  # router z-loss (ST-MoE)
  # None: dropless (every token reaches its k experts). A number: each expert takes at most
  # ceil(capacity_factor * tokens * top_k / num_experts) tokens per sequence; the rest are dropped and counted.
  capacity_factor: float | None = None


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
  vocab_size: int = 256
  embed_dim: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 32
  mlp_dim: int = 512  # width of the dense SwiGLU in dense layers
  num_dense_layers: int = 0  # the first k layers use a dense MLP instead of the MoE block
  max_seq_len: int = 256
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  qk_norm: bool = False  # RMSNorm over head_dim on every query and key head before the rotation (Qwen3)
  # "gqa": grouped-query attention (num_kv_heads key/value heads of head_dim). "mla": DeepSeek's multi-head
  # latent attention (models/mla.py): queries through a rank-q_lora_rank bottleneck (0: a full
  # projection), keys and values up-projected per head from one kv_lora_rank latent per token, heads of
  # qk_nope_head_dim + qk_rope_head_dim (the rotary part, one per token shared by every head) for scores
  # and v_head_dim for values; head_dim is unused and num_kv_heads must equal num_heads.
  attention: str = "gqa"
  q_lora_rank: int = 0
  kv_lora_rank: int = 512
  qk_nope_head_dim: int = 128
  qk_rope_head_dim: int = 64
  v_head_dim: int = 128
  rope_interleave: bool = False  # rotate pairs (x0, x1), (x2, x3), ... (DeepSeek) instead of the two halves
  # YaRN rope scaling (DeepSeek-V3's long context; transformers' "yarn" rope_type), on when yarn_factor > 1:
  # frequencies interpolated between beta_fast and beta_slow rotations over yarn_original_max_len
  # positions, cos/sin scaled by mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim) and the
  # scores by mscale(factor, yarn_mscale_all_dim)^2, mscale(f, m) = 0.1 m ln f + 1.
  yarn_factor: float = 1.0
  yarn_original_max_len: int = 4096
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_mscale: float = 1.0
  yarn_mscale_all_dim: float = 0.0
  tie_embeddings: bool = True
  init_std: float = 0.02
  dtype: str = "float32"  # compute dtype; parameters are always float32
  # Activation rematerialisation per decoder layer: "none" keeps everything, "full" recomputes the whole
  # layer in the backward pass, "dots" keeps matmul outputs and recomputes the elementwise work.
  remat: str = "none"
  # The training loss computes the output layer's float32 logits in chunks of each device's tokens, at
  # most this many bytes of them at a time (models/output.py); 0 forms them whole. 256 MiB: up to 441
  # tokens of Qwen3's 151,936-entry vocabulary, 2,048 of a 32K one (a divisor of the device's positions).
  logits_chunk_bytes: int = 256 * 2**20
  moe: MoEConfig = dataclasses.field(default_factory=MoEConfig)


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
  # impl="pallas": "auto" runs the Mosaic GPU kernels on Hopper GPUs (each op's "xla" tier elsewhere);
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
  # float32 copy of the device's expert weights, checkpointed). Off by default: with AdamW it did not help
  # (tiny_moe, 4 seeds: signs ended 0.09 nats worse with it, 0.02 without; int8 alike either way; see
  # experiments/benchmarks/RESULTS.md). Adam's per-value normalisation already makes its steps sign-like.
  gradient_error_feedback: bool = False
  # XLA flag preset for GPUs (src/runtime/xla_flags.py): "overlap" (latency-hiding scheduler, reductions
  # pipelined across loop iterations, combining), "overlap_double_buffered" (also double-buffered loops: more
  # memory), "overlap_windowed_einsum" or "none" (XLA's defaults).
  xla_flags: str = "overlap"

  def validate(self) -> "ParallelConfig":
    """Checks every field (Config.validate does, and so does a parallel plan built without a Config)."""
    _check_choice("parallel.impl", self.impl, IMPLS)
    _check_choice("parallel.kernel_backend", self.kernel_backend, KERNEL_BACKENDS)
    _check_choice("parallel.kernel_tiles", self.kernel_tiles, KERNEL_TILES)
    _check_choice("parallel.attention", self.attention, ATTENTION_KINDS)
    _check_choice("parallel.attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
    _check_positive_int("parallel.moe_chunks", self.moe_chunks)
    _check_choice("parallel.grouped_gemm", self.grouped_gemm, GROUPED_GEMMS)
    gemm_kernel_overrides(self.gemm_kernels)
    if not isinstance(self.kernel_table, str):
      raise ConfigError("parallel.kernel_table", self.kernel_table,
                        "a path to a measure.jsonl of experiments/benchmarks/gpu_measure.py, or '' (none)")
    _check_int("parallel.gemm_block_rows", self.gemm_block_rows, 0,
               "0 (chosen from the shapes) or a positive number of rows")
    for name in EXCHANGE_FORMAT_FIELDS:
      _check_choice(f"parallel.{name}", getattr(self, name), EXCHANGE_FORMATS)
    _check_choice("parallel.layer_schedule", self.layer_schedule, LAYER_SCHEDULES)
    _check_choice("parallel.moe_swiglu_gradient", self.moe_swiglu_gradient, SWIGLU_GRADIENTS)
    _check_choice("parallel.gradient_compression", self.gradient_compression, GRADIENT_COMPRESSIONS)
    _check_bool("parallel.gradient_error_feedback", self.gradient_error_feedback)
    _check_choice("parallel.xla_flags", self.xla_flags, XLA_FLAG_PRESETS)
    return self


@dataclasses.dataclass(kw_only=True)
class OptimizerConfig:
  """AdamW with linear warmup then cosine decay to `learning_rate * min_learning_rate_ratio`."""

  learning_rate: float = 3e-3
  warmup_steps: int = 20
  min_learning_rate_ratio: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1
  # Which parameters weight decay applies to besides matrices.
  decay_norms: bool = False
  decay_biases: bool = False
  decay_embeddings: bool = False
  grad_clip_norm: float = 1.0  # global-norm clipping; 0 disables it


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
  steps: int = 100
  seed: int = 0
  global_batch_size: int = 16  # sequences per optimizer step, over all devices and micro-batches
  seq_len: int = 128
  grad_accum_steps: int = 1  # micro-batches per step; each holds global_batch_size / grad_accum_steps
  log_every: int = 10
  eval_every: int = 50  # 0: evaluate only at the end
  eval_batches: int = 4
  # Peak dense FLOP/s of one device for MFU; 0 looks the device kind up (H100, H200, ...), unknown -> no MFU.
  peak_flops_per_device: float = 0.0
  profile_steps: str = ""  # "START:STOP" writes a jax.profiler trace of those steps to <workdir>/profile
  # "hf:<folder>": start from a Hugging Face checkpoint folder (config.json + *.safetensors; Mixtral,
  # Qwen3-MoE; models/hf_checkpoint.py). The model comes from its config.json (model.dtype, remat,
  # logits_chunk_bytes and the MoE capacity and loss weights stay yours), the tokenizer from its
  # tokenizer.json while data.tokenizer is "byte". A workdir that holds checkpoints resumes from them.
  init_from: str = ""
  # A folder that does not exist yet: at the end of training (not when preempted) the final parameters
  # are written there as a Hugging Face folder, bfloat16, with the tokenizer (models/hf_export.py; the
  # model must be one of the families it writes). Also: `python -m experiments.convert --to=hf`.
  export_hf: str = ""


@dataclasses.dataclass(kw_only=True)
class DataConfig:
  # "stdlib": bytes of this interpreter's standard-library source files (no download). Else files in `paths`:
  # "text" (each file a document), "jsonl" (a `text` field per line), "parquet" (a `text` column),
  # "arrayrecord" (UTF-8 text records); these are tokenized once into a cache ($MESHMOE_CACHE, default
  # ~/.cache/meshmoe). "tokenized": folders written by `python -m experiments.tokenize`, mixed by weight:
  # paths="[name=]folder[:weight],..." (weights summing to 1; one folder needs none). src/data/pipeline.py.
  source: str = "stdlib"
  paths: str = ""  # comma-separated files or glob patterns; for "tokenized", the dataset folders
  eval_paths: str = ""  # held-out files; empty: hold out `eval_fraction` of the documents, chosen by hash
  eval_fraction: float = 0.05
  # "byte" (vocabulary 256) or the path of a Hugging Face tokenizer.json; "tokenized" datasets name their own.
  tokenizer: str = "byte"
  packing: bool = True  # concatenate documents into full rows; else one document per row, padded
  loader_threads: int = 4  # background threads that read and assemble batches ahead; 0: in the train loop


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
  every_steps: int = 100  # 0: only at the end; -1: never (benchmark runs: a stopped run loses its steps)
  keep: int = 3  # newest checkpoints kept on disk
  async_save: bool = True


@dataclasses.dataclass(kw_only=True)
class SampleConfig:
  """Text generated at the end of training, greedy and with temperature sampling."""

  prompt: str = "def "
  max_new_tokens: int = 96
  temperature: float = 0.8


@dataclasses.dataclass(kw_only=True)
class ResilienceConfig:
  """What a run does when something goes wrong (src/resilience.py, src/nonfinite.py, src/stragglers.py)."""

  # A step whose loss or gradient norm is NaN/Inf never updates the state. "halt": stop with a diagnostic
  # naming the first parameter whose gradient is non-finite. "skip": go on with the next batch and count it.
  nan_policy: str = "halt"
  max_consecutive_skips: int = 5  # nan_policy="skip": halt anyway after this many non-finite steps in a row
  # A step, evaluation or checkpoint wait that makes no progress for this long (a collective waiting for a
  # process that died or hangs) ends the process with a clear error and exit status 3.
  watchdog_timeout_s: float = 300.0
  # Every this many steps the processes compare the time each spends on its own work per step (0: never);
  # one slower than the median process by `straggler_factor` is named in the logs and metrics.jsonl.
  straggler_every_steps: int = 50
  straggler_factor: float = 1.5


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
    _validate_model(self.model)
    _validate_train(self.train, self.model)
    _validate_optimizer(self.optimizer)
    _validate_data(self.data)
    _validate_checkpoint_and_sample(self.checkpoint, self.sample)
    _validate_resilience(self.resilience)
    _validate_mesh(self.mesh)
    self.parallel.validate()
    check_weight_storage(self.mesh.weight_storage, self.parallel)
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


def resolve_mesh_sizes(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
  """Mesh axis sizes with the -1 axis (if any) filled so that the product is `num_devices`."""
  if not isinstance(num_devices, int) or num_devices < 1:
    raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
  _validate_mesh(mesh)
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


def _validate_mesh(mesh: MeshConfig) -> None:
  for axis, size in mesh.sizes().items():
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ConfigError(f"mesh.{axis}", size, "a positive integer, or -1 to fill the remaining devices")
  if sum(s == -1 for s in mesh.sizes().values()) > 1:
    raise ConfigError("mesh", _describe(mesh.sizes()), "at most one axis may be -1")
  _check_choice("mesh.preset", mesh.preset, PRESETS)
  _check_choice("mesh.weight_storage", mesh.weight_storage, WEIGHT_STORAGES)


def check_weight_storage(weight_storage: str, parallel: ParallelConfig) -> None:
  """What `mesh.weight_storage` rules out among the parallel options (Config.validate and the parallel plan
  check it): a compressed gradient sum runs over replicas that each hold whole expert weights
  (sharding/gradient_sync.py); split storage reduce-scatters that gradient instead."""
  if weight_storage != "preset" and parallel.gradient_compression != "none":
    raise ConfigError("parallel.gradient_compression", parallel.gradient_compression, (
        f"'none' with mesh.weight_storage={weight_storage!r}: the compressed sum runs over replicas that each "
        "hold whole expert weights, and split storage reduce-scatters their gradient instead (or "
        "mesh.weight_storage='preset')"))


def _validate_model(m: ModelConfig) -> None:
  for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
               "max_seq_len"):
    _check_positive_int(f"model.{name}", getattr(m, name))
  _check_positive_float("model.rope_theta", m.rope_theta)
  _check_positive_float("model.norm_eps", m.norm_eps)
  _check_positive_float("model.init_std", m.init_std)
  _check_choice("model.dtype", m.dtype, DTYPES)
  _check_choice("model.remat", m.remat, REMAT_POLICIES)
  _check_bool("model.tie_embeddings", m.tie_embeddings)
  _check_bool("model.qk_norm", m.qk_norm)
  _check_choice("model.attention", m.attention, ATTENTION_TYPES)
  _check_bool("model.rope_interleave", m.rope_interleave)
  _check_int("model.q_lora_rank", m.q_lora_rank, 0, "an integer >= 0 (0: no query bottleneck)")
  for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim", "qk_rope_head_dim"):
    _check_positive_int(f"model.{name}", getattr(m, name))
  if m.qk_rope_head_dim % 2:
    raise ConfigError("model.qk_rope_head_dim", m.qk_rope_head_dim, "an even number (rotary embeddings "
                      "rotate pairs)")
  if m.attention == "mla":
    if m.num_kv_heads != m.num_heads:
      raise ConfigError("model.num_kv_heads", m.num_kv_heads, f"model.num_heads={m.num_heads} with "
                        "model.attention='mla' (every head has its own keys and values)")
    if m.qk_norm:
      raise ConfigError("model.qk_norm", m.qk_norm, "False with model.attention='mla'")
  if not _is_number(m.yarn_factor) or not 1 <= m.yarn_factor < math.inf:
    raise ConfigError("model.yarn_factor", m.yarn_factor, "a finite number >= 1 (1: no YaRN scaling)")
  _check_positive_int("model.yarn_original_max_len", m.yarn_original_max_len)
  _check_positive_float("model.yarn_beta_fast", m.yarn_beta_fast)
  _check_positive_float("model.yarn_beta_slow", m.yarn_beta_slow)
  _check_non_negative("model.yarn_mscale", m.yarn_mscale)
  _check_non_negative("model.yarn_mscale_all_dim", m.yarn_mscale_all_dim)
  _check_int("model.logits_chunk_bytes", m.logits_chunk_bytes, 0,
             "0 (the logits whole) or a positive number of bytes of logits per chunk")
  if m.head_dim % 2:
    raise ConfigError("model.head_dim", m.head_dim, "an even number (rotary embeddings rotate pairs)")
  if m.num_heads % m.num_kv_heads:
    raise ConfigError("model.num_kv_heads", m.num_kv_heads,
                      f"a divisor of model.num_heads={m.num_heads} (grouped-query attention)")
  if (not isinstance(m.num_dense_layers, int) or isinstance(m.num_dense_layers, bool)
      or not 0 <= m.num_dense_layers <= m.num_layers):
    raise ConfigError("model.num_dense_layers", m.num_dense_layers,
                      f"an integer from 0 to model.num_layers={m.num_layers}")
  _validate_moe(m.moe)


def _validate_moe(moe: MoEConfig) -> None:
  _check_positive_int("model.moe.num_experts", moe.num_experts)
  _check_positive_int("model.moe.top_k", moe.top_k)
  _check_positive_int("model.moe.expert_mlp_dim", moe.expert_mlp_dim)
  if moe.top_k > moe.num_experts:
    raise ConfigError("model.moe.top_k", moe.top_k,
                      f"at most model.moe.num_experts={moe.num_experts} (each token picks distinct experts)")
  _check_int("model.moe.num_shared_experts", moe.num_shared_experts, 0, "an integer >= 0")
  _check_choice("model.moe.score_fn", moe.score_fn, SCORE_FNS)
  _check_bool("model.moe.normalize_top_k", moe.normalize_top_k)
  _check_bool("model.moe.expert_bias", moe.expert_bias)
  _check_positive_float("model.moe.routed_scaling", moe.routed_scaling)
  _check_positive_int("model.moe.num_groups", moe.num_groups)
  if moe.num_experts % moe.num_groups or (moe.num_groups > 1 and moe.num_experts // moe.num_groups < 2):
    raise ConfigError("model.moe.num_groups", moe.num_groups,
                      f"a divisor of model.moe.num_experts={moe.num_experts} leaving at least 2 experts per group "
                      "(groups are ranked by their two best scores), or 1")
  group_size = moe.num_experts // moe.num_groups
  if (not isinstance(moe.top_k_groups, int) or isinstance(moe.top_k_groups, bool)
      or not 1 <= moe.top_k_groups <= moe.num_groups or moe.top_k_groups * group_size < moe.top_k):
    raise ConfigError("model.moe.top_k_groups", moe.top_k_groups,
                      f"an integer from 1 to model.moe.num_groups={moe.num_groups} whose groups hold at least "
                      f"model.moe.top_k={moe.top_k} experts ({group_size} per group)")
  for name in ("aux_loss_weight", "z_loss_weight", "expert_bias_update_rate"):
    _check_non_negative(f"model.moe.{name}", getattr(moe, name))
  if moe.capacity_factor is not None:
    _check_positive_float("model.moe.capacity_factor", moe.capacity_factor,
                          "None for dropless routing, or a finite number > 0")


def _validate_optimizer(o: OptimizerConfig) -> None:
  _check_positive_float("optimizer.learning_rate", o.learning_rate)
  # Warmup longer than the run is allowed (a short trial run of a long recipe): the rate never peaks.
  _check_int("optimizer.warmup_steps", o.warmup_steps, 0, "an integer >= 0")
  _check_fraction("optimizer.min_learning_rate_ratio", o.min_learning_rate_ratio, "a number from 0 to 1")
  for name in ("b1", "b2"):
    value = getattr(o, name)
    if not _is_number(value) or not 0 <= value < 1:
      raise ConfigError(f"optimizer.{name}", value, "a number in [0, 1)")
  _check_positive_float("optimizer.eps", o.eps)
  _check_non_negative("optimizer.weight_decay", o.weight_decay)
  _check_non_negative("optimizer.grad_clip_norm", o.grad_clip_norm, "a finite number >= 0 (0 disables clipping)")
  for name in ("decay_norms", "decay_biases", "decay_embeddings"):
    _check_bool(f"optimizer.{name}", getattr(o, name))


def _validate_train(t: TrainConfig, m: ModelConfig) -> None:
  _check_positive_int("train.steps", t.steps)
  _check_positive_int("train.global_batch_size", t.global_batch_size)
  _check_positive_int("train.seq_len", t.seq_len)
  if not isinstance(t.seed, int) or isinstance(t.seed, bool):
    raise ConfigError("train.seed", t.seed, "an integer")
  if t.seq_len > m.max_seq_len:
    raise ConfigError("train.seq_len", t.seq_len, f"at most model.max_seq_len={m.max_seq_len}")
  _check_positive_int("train.grad_accum_steps", t.grad_accum_steps)
  if t.global_batch_size % t.grad_accum_steps:
    raise ConfigError("train.grad_accum_steps", t.grad_accum_steps,
                      f"a divisor of train.global_batch_size={t.global_batch_size}")
  _check_positive_int("train.log_every", t.log_every)
  _check_int("train.eval_every", t.eval_every, 0, "an integer >= 0 (0: evaluate only at the end)")
  _check_positive_int("train.eval_batches", t.eval_batches)
  _check_non_negative("train.peak_flops_per_device", t.peak_flops_per_device,
                      "a finite number >= 0 (0: look the device up)")
  if not isinstance(t.init_from, str) or (t.init_from and not (t.init_from.startswith("hf:") and t.init_from[3:])):
    raise ConfigError("train.init_from", t.init_from, "empty (random initialisation) or 'hf:<folder>', a Hugging "
                      "Face checkpoint folder")
  if not isinstance(t.export_hf, str):
    raise ConfigError("train.export_hf", t.export_hf, "empty (no export) or the path of a folder to create")
  if t.profile_steps or not isinstance(t.profile_steps, str):
    parts = t.profile_steps.split(":") if isinstance(t.profile_steps, str) else []
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) >= int(parts[1]):
      raise ConfigError("train.profile_steps", t.profile_steps,
                        "empty (no trace) or 'START:STOP' with 0 <= START < STOP, e.g. '5:8'")


def profile_range(t: TrainConfig) -> range:
  """The steps `train.profile_steps` asks to trace (empty when none)."""
  if not t.profile_steps:
    return range(0)
  start, stop = (int(p) for p in t.profile_steps.split(":"))
  return range(start, stop)


def _validate_data(d: DataConfig) -> None:
  _check_choice("data.source", d.source, DATA_SOURCES)
  if not isinstance(d.paths, str) or not isinstance(d.eval_paths, str):
    bad = "data.paths" if not isinstance(d.paths, str) else "data.eval_paths"
    raise ConfigError(bad, getattr(d, bad.split(".")[1]), "a comma-separated string of files or glob patterns")
  if d.source != "stdlib" and not d.paths.strip():
    raise ConfigError("data.paths", d.paths, f"one or more files or glob patterns for data.source={d.source!r}")
  if d.source == "stdlib" and d.paths.strip():
    raise ConfigError("data.paths", d.paths, "empty for data.source='stdlib' (set data.source for your files)")
  if d.source == "tokenized":
    mixture_entries(d.paths)
    if d.eval_paths.strip():
      raise ConfigError("data.eval_paths", d.eval_paths, "empty for data.source='tokenized' (each dataset "
                        "folder holds its own eval split)")
  if not _is_number(d.eval_fraction) or not 0 < d.eval_fraction < 1:
    raise ConfigError("data.eval_fraction", d.eval_fraction, "a number strictly between 0 and 1")
  if not isinstance(d.tokenizer, str) or not (d.tokenizer == "byte" or d.tokenizer.endswith(".json")):
    raise ConfigError("data.tokenizer", d.tokenizer, "'byte' or the path of a tokenizer.json file")
  _check_bool("data.packing", d.packing)
  _check_int("data.loader_threads", d.loader_threads, 0, "an integer >= 0 (0: load in the train loop)")


def mixture_entries(paths: str) -> list[tuple[str, str, float]]:
  """(name, folder, weight) of each dataset in `data.paths` for data.source='tokenized'.

  Entries are "[name=]folder[:weight]"; the name defaults to the folder's last part. One dataset needs no
  weight; several need one each, positive, summing to 1 (within 0.001: weights are fractions of the rows,
  and a sum far from 1 is usually a forgotten or mistyped source)."""
  entries = []
  for item in (p.strip() for p in paths.split(",") if p.strip()):
    head, named, tail = item.partition("=")
    name, rest = (head, tail) if named and "/" not in head else ("", item)  # a folder may hold "=" too
    folder, _, weight_text = rest.rpartition(":") if ":" in rest else (rest, "", "")
    name = name or folder.rstrip("/").rsplit("/", 1)[-1]
    try:
      weight = float(weight_text) if weight_text else None
    except ValueError:
      raise ConfigError("data.paths", paths, f"weights as numbers; {weight_text!r} in {item!r} is not") from None
    if not name or not all(c.isalnum() or c in "_.-" for c in name):
      raise ConfigError("data.paths", paths, f"dataset names of letters, digits, '_', '.', '-'; {item!r} gives "
                        f"{name!r}")
    if weight is not None and not (math.isfinite(weight) and weight > 0):
      raise ConfigError("data.paths", paths, f"positive finite weights; {item!r} has {weight_text}")
    entries.append((name, folder, weight))
  names = [e[0] for e in entries]
  if len(set(names)) < len(names):
    raise ConfigError("data.paths", paths, f"distinct dataset names (name=folder:weight); {names} repeat one")
  if len(entries) == 1:
    return [(entries[0][0], entries[0][1], 1.0)]
  if any(e[2] is None for e in entries):
    raise ConfigError("data.paths", paths, "a weight for every dataset of a mixture (folder:weight)")
  total = sum(e[2] for e in entries)
  if abs(total - 1) > 1e-3:
    raise ConfigError("data.paths", paths, f"weights that sum to 1; these sum to {total:g}")
  return entries


def _validate_checkpoint_and_sample(c: CheckpointConfig, s: SampleConfig) -> None:
  _check_int("checkpoint.every_steps", c.every_steps, -1,
             "an integer >= -1 (0: save only at the end; -1: never, for benchmark runs)")
  _check_positive_int("checkpoint.keep", c.keep)
  _check_bool("checkpoint.async_save", c.async_save)
  if not isinstance(s.prompt, str) or not s.prompt:
    raise ConfigError("sample.prompt", s.prompt, "a non-empty string")
  _check_int("sample.max_new_tokens", s.max_new_tokens, 0, "an integer >= 0")
  _check_non_negative("sample.temperature", s.temperature, "a finite number >= 0 (0: greedy only)")


def _validate_resilience(r: ResilienceConfig) -> None:
  _check_choice("resilience.nan_policy", r.nan_policy, NAN_POLICIES)
  _check_positive_int("resilience.max_consecutive_skips", r.max_consecutive_skips)
  _check_positive_float("resilience.watchdog_timeout_s", r.watchdog_timeout_s, "a finite number of seconds > 0")
  _check_int("resilience.straggler_every_steps", r.straggler_every_steps, 0, "an integer >= 0 (0: never compare)")
  if not _is_number(r.straggler_factor) or not 1 < r.straggler_factor < math.inf:
    raise ConfigError("resilience.straggler_factor", r.straggler_factor, "a finite number > 1")


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(field: str, value: Any, minimum: int, allowed: str) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
    raise ConfigError(field, value, allowed)


def _check_bool(field: str, value: Any) -> None:
  if not isinstance(value, bool):
    raise ConfigError(field, value, "True or False")


def _check_non_negative(field: str, value: Any, allowed: str = "a finite number >= 0") -> None:
  if not _is_number(value) or not 0 <= value < math.inf:
    raise ConfigError(field, value, allowed)


def _check_fraction(field: str, value: Any, allowed: str) -> None:
  if not _is_number(value) or not 0 <= value <= 1:
    raise ConfigError(field, value, allowed)


def _check_positive_int(field: str, value: Any) -> None:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    raise ConfigError(field, value, "a positive integer")


def _check_positive_float(field: str, value: Any, allowed: str = "a finite number > 0") -> None:
  if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or math.isinf(value):
    raise ConfigError(field, value, allowed)


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


def _check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ConfigError(field, value, "one of " + ", ".join(repr(c) for c in choices))
