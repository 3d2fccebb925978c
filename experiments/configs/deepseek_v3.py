"""deepseek_v3: a DeepSeek-V3-671B-like model (DeepSeek-AI, arXiv:2412.19437), for compile-only analysis.

  python -m experiments.aot --config=experiments/configs/deepseek_v3.py --target=h100 --devices=256 --hosts=32 \
      --out=report.json
  python -m experiments.plan --config=experiments/configs/deepseek_v3.py --gpus=256

(`experiments.aot` compiles the real train step for that cluster without GPUs and reports memory, FLOPs and
communication; `experiments.plan` ranks every layout; tests/test_configs.py validates and shape-checks this
file.) This config does not train on CPU (2.7 TB of float32 parameters). On 256 H100s its step compiles to
66.7 GB per device of 84.9, and its dropless fallback step (see "mesh" below) to 65.6 GB (2026-12-03,
deviceless, 305 s to compile both; the cost model says 72.2 and 70.7 GB).

Model: 61 decoder layers, d_model 7168; the first 3 layers dense (SwiGLU of width 18432), the other 58 MoE
blocks of 256 routed SwiGLU experts of width 2048 plus 1 shared expert of the same width. Routing: sigmoid
scores, top-8, the chosen eight renormalised and scaled by 2.5, with the aux-loss-free per-expert
selection bias (expert_bias, update rate 1e-3 as in the paper's first 14.3T tokens) and a tiny balance
loss (1e-4, the paper's alpha) over each sequence (balance_loss "sequence", the paper's sequence-wise
loss). Vocabulary 129280, untied embeddings, RMSNorm eps 1e-6, init std 0.006 (the paper's), RoPE theta
1e4 (interleaved pairs, as DeepSeek rotates) and max_seq_len 4096, the pre-training length (the 32K/128K
extension adds YaRN: model.yarn_factor and the yarn_* fields).

Attention: multi-head latent attention (model.attention="mla", models/mla.py), as the paper and the
Hugging Face checkpoint have it: 128 heads; queries through a rank-1536 bottleneck, 7168->1536->128x192;
keys and values from one 512-wide latent per token plus a 64-wide rotary key shared by the heads,
7168->512+64, then 512->128x(128+128); output 128x128->7168. 187.1M weights per layer; scores over
query/key width 192 (128 + 64 rotary), values of width 128 (padded to 192 inside attention, whose products
then run at width 192: 25% more attention-score FLOPs than useful, counted as executed by the cost model).

Parameters (meshmoe.analysis.cost_model.active_params): 671,026,404,352 total and 37,552,282,624 active per
token (671.0B / 37.6B); published 671B / 37B (+0.004% / +1.5%). Model FLOPs of a training step
(cost_model.train_step_flops at seq_len 4096): 250 GFLOP per token. Not modelled: the
multi-token-prediction module (one more layer, 14B; the Hugging Face checkpoint's 685B = 671B + 14B);
FP8 training (bf16 here). Routing is the paper's node-limited one: each token's 8 experts come
from its 4 best of 8 groups of 32 (`num_groups`, `top_k_groups`). The 58 x 256 selection biases are
ExpertBias variables, not parameters, and are not counted.

Choices:
- mesh: the planner's best layout on 256 H100s (`python -m experiments.plan --gpus=256`, 2026-12-03): preset
  "tp_sp" with tensor=8 (within a node: attention's heads), expert=2, data=-1 (16 at 256 devices), the
  routed experts folded over every axis, data x expert x tensor (mesh.expert_axes, MoE parallel folding):
  256-way expert parallelism, one whole expert per device per layer, held by no other device and never
  gathered. The other weights where the preset puts them (mesh.weight_storage="preset": attention and the
  dense and shared-expert MLPs split over `tensor`, replicated over the 32 data x expert devices), in
  bfloat16, and the float32 master weights and Adam moments over every axis (mesh.optimizer_storage="all",
  the distributed optimizer, ZeRO-1 as DeepSeek trained). The xla tier, the MoE exchange in 8 pipelined
  chunks, 80 micro-batches of 192 sequences. The token exchange's receive buffers hold 2x the rows of
  balanced routing instead of the worst case, 16x that (parallel.moe_buffer_factor=2,
  sharding/expert_parallel.py "Receive buffers"): a step whose routing overflows one runs again with
  worst-case buffers in 480 micro-batches, which fit (parallel.moe_fallback_grad_accum_steps). The planner
  predicts 26.3% MFU (236.6 s per step; modelled: the routed experts' GEMMs at the kernel table's rates
  measured at this expert shape, the rest at its stated 50% GEMM efficiency; the fallback's cost, one step
  computed twice per overflow, is left out). Before: 23.9% with the experts over expert x tensor (128-way,
  the other weights gathered per micro-batch), 14.3% with worst-case buffers, 7.5% before the distributed
  optimizer, 3.6% before folding. What is left: compute (213 s) and the communication beside it (210 s)
  are even, and 24 s are exposed, the token exchange the pipeline does not hide; the exchange is 190 s of
  it (over the network at 50 GB/s per GPU), which the remat'd forward runs a second time. DeepSeek itself
  also used 16-way pipeline parallelism and node-limited dispatch that sends a token once per node
  (DeepEP); meshmoe has neither, and sends each of a token's 8 assignments.
- remat "full": memory is what binds; "dots" would also keep each layer's MLA projections (24576-wide
  queries, 32768-wide key/value up-projection) and shared-expert GEMMs (~60K values per token per layer
  beside the 7168-wide input), and the routed expert GEMMs are recomputed under either policy.
- train: the paper's final batch, 15360 sequences of 4096 tokens (62.9M tokens; the paper ramps it up
  from 3072 over the first 469B tokens, not modelled) in 80 micro-batches of 192 (see "mesh"). steps:
  14.8T tokens / 62.9M = 235K.
- optimizer: the paper's AdamW, betas (0.9, 0.95), weight decay 0.1, clip 1.0, peak lr 2.2e-4 after 2000
  warmup steps, down to 2.2e-5 (ratio 0.1), its two moments kept in bfloat16 as the paper keeps them
  (optimizer.moments_dtype; 4 bytes per parameter less). The paper holds the peak until 10T tokens and then decays
  over 4.3T with a cosine: schedule "wsd", decay_fraction 0.29 (4.3T of 14.8T), decay_shape "cosine" (its
  last 0.5T at 2.2e-5 and 7.3e-6 are not modelled).
- no z-loss (DeepSeek-V3 has none).
"""

from meshmoe.config import (CheckpointConfig, Config, MeshConfig, ModelConfig, MoEConfig, OptimizerConfig,
                            ParallelConfig, TrainConfig)


def get_config() -> Config:
  return Config(
      model=ModelConfig(
          vocab_size=129280, embed_dim=7168, num_layers=61, num_dense_layers=3, num_heads=128, num_kv_heads=128,
          head_dim=192, attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
          qk_rope_head_dim=64, v_head_dim=128, rope_interleave=True,
          mlp_dim=18432, max_seq_len=4096, rope_theta=1e4, norm_eps=1e-6, tie_embeddings=False,
          init_std=0.006, dtype="bfloat16", remat="full",
          moe=MoEConfig(
              num_experts=256, top_k=8, expert_mlp_dim=2048, num_shared_experts=1, score_fn="sigmoid",
              normalize_top_k=True, routed_scaling=2.5, expert_bias=True, expert_bias_update_rate=1e-3,
              num_groups=8, top_k_groups=4,
              aux_loss_weight=1e-4, balance_loss="sequence", z_loss_weight=0.0, capacity_factor=None),
      ),
      mesh=MeshConfig(data=-1, expert=2, tensor=8, sequence=1, preset="tp_sp", weight_storage="preset",
                      expert_axes="data,expert,tensor", optimizer_storage="all"),
      parallel=ParallelConfig(impl="xla", moe_chunks=8, moe_buffer_factor=2.0, moe_fallback_grad_accum_steps=480),
      optimizer=OptimizerConfig(learning_rate=2.2e-4, warmup_steps=2000, schedule="wsd", decay_fraction=0.29,
                                decay_shape="cosine", min_learning_rate_ratio=0.1, b1=0.9, b2=0.95, eps=1e-8,
                                weight_decay=0.1, grad_clip_norm=1.0, moments_dtype="bfloat16"),
      train=TrainConfig(steps=235_000, global_batch_size=15360, seq_len=4096, grad_accum_steps=80,
                        log_every=10, eval_every=1000),
      checkpoint=CheckpointConfig(every_steps=1000),
  )
