"""mixtral_8x7b: the shape of Mixtral-8x7B (Mistral AI, arXiv:2401.04088), for compile-only analysis.

  python -m experiments.aot --config=experiments/configs/mixtral_8x7b.py --target=h100 --devices=64 --out=report.json

(`experiments.aot` compiles the real train step for that cluster without GPUs and reports memory, FLOPs and
communication; tests/test_configs.py validates and shape-checks this file.) This config does not train on CPU:
its float32 parameters alone are 187 GB.

Model: 32 decoder layers, d_model 4096, grouped-query attention with 32 query / 8 key-value heads of
dimension 128, RoPE theta 1e6, context 32768. Every layer is an MoE block of 8 SwiGLU experts of width
14336, top-2 softmax routing renormalised over the chosen two (equal to Mixtral's softmax over the top-2
logits), no shared experts, no dense layers. Vocabulary 32000, untied input and output embeddings,
RMSNorm eps 1e-5. This is exactly the published architecture (no sliding window, as in v0.1).

Parameters (meshmoe.analysis.cost_model.active_params): 46,702,792,704 total and 12,879,925,248 active per token
(46.70B / 12.88B); published 46.7B / 12.9B. The total equals the Hugging Face checkpoint's count: nothing
in Mixtral is missing from meshmoe. Model FLOPs of a training step (cost_model.train_step_flops at
seq_len 4096): 79.7 GFLOP per token.

Compiled for 64 H100s as set here (deviceless, 2026-12-01; experiments/benchmarks/RESULTS.md), the step
peaks at 68.7 GB per device (the cost model says 66.6 GB), 90% of the 76.45 GB JAX's allocator holds at
train.gpu_memory_fraction=0.9.

Choices (the planner's best layout on 64 H100s: `python -m experiments.plan --config=<this file> --gpus=64`,
12.88 s per step, 41.0% MFU, modelled: the routed experts' GEMMs at the kernel table's rates measured at
this expert shape, the rest at its stated 50% GEMM efficiency, 2026-12-01; 40.2% on 2026-11-29, before the
attention projections' ring passes were counted hidden like every block's and the MoE pipeline's depth
was searched):
- mesh: preset "tp_sp" with data=-1 (4 at 64 devices), expert=4, tensor=2 (heads and MLP widths), sequence=2 (context
  parallel), and the experts folded over expert x sequence (mesh.expert_axes="expert,sequence": one whole
  expert per device of that group of 8, so no expert weight is gathered). The weights stay where the
  preset puts them, in bfloat16, and the float32 master weights and Adam moments are split over every axis
  (mesh.optimizer_storage="all", the distributed optimizer): 2 bytes per parameter resident and 16 split,
  gathered once per step; each micro-batch's gradient is reduce-scattered into the master's slices. The
  layout before (1x8x2x4 with every weight's storage split over every axis and gathered per micro-batch)
  is 14.47 s now that the cost model counts the embedding gradient XLA sums whole per micro-batch.
- remat "none": the layout's memory leaves room to keep every layer's activations, which saves the extra
  forward (4/3 the compute under "full").
- parallel.impl "xla": the ring projections and the chunked MoE pipeline (4 chunks: 1,024 rows per chunk
  for each device's expert) overlap their transfers. The compute, at the measured kernel rates, leaves 44%
  as the most any layout of this model gets on 64 H100s (11.9 s with nothing exposed); the rest waits on
  faster grouped GEMMs. Receive buffers of 2x the balanced rows (parallel.moe_buffer_factor=2) would take
  the modelled peak from 66.6 to 50.6 GB, but fewer micro-batches still would not fit, so they buy
  nothing here.
- train: 4096-token sequences, 1024 per step (4.2M tokens, the Llama-2 recipe; Mistral did not publish
  Mixtral's) in 64 micro-batches of 16 sequences (the fewest that fit: the dropless exchange's worst-case
  receive buffers grow with the micro-batch). steps only sets the schedule length (~1T tokens).
- optimizer: AdamW, peak lr 3e-4, 2000 warmup steps, cosine to 10%, betas (0.9, 0.95), weight decay 0.1,
  clip 1.0 (Llama-2 style; no published Mixtral recipe).
- router losses: aux_loss_weight 0.04 is the Hugging Face router_aux_loss_coef 0.02 times top_k: HF's
  Switch loss equals top_k when balanced, meshmoe's equals 1. No z-loss (Mixtral has none).
"""

from meshmoe.config import (CheckpointConfig, Config, MeshConfig, ModelConfig, MoEConfig, OptimizerConfig,
                            ParallelConfig, TrainConfig)


def get_config() -> Config:
  return Config(
      model=ModelConfig(
          vocab_size=32000, embed_dim=4096, num_layers=32, num_dense_layers=0, num_heads=32, num_kv_heads=8,
          head_dim=128, mlp_dim=14336, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5, tie_embeddings=False,
          init_std=0.02, dtype="bfloat16", remat="none",
          moe=MoEConfig(
              num_experts=8, top_k=2, expert_mlp_dim=14336, num_shared_experts=0, score_fn="softmax",
              normalize_top_k=True, routed_scaling=1.0, expert_bias=False, aux_loss_weight=0.04,
              z_loss_weight=0.0, capacity_factor=None),
      ),
      mesh=MeshConfig(data=-1, expert=4, tensor=2, sequence=2, preset="tp_sp", expert_axes="expert,sequence",
                      optimizer_storage="all"),
      parallel=ParallelConfig(impl="xla", moe_chunks=4),
      optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2000, min_learning_rate_ratio=0.1, b1=0.9,
                                b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0),
      train=TrainConfig(steps=250_000, global_batch_size=1024, seq_len=4096, grad_accum_steps=64,
                        log_every=10, eval_every=1000),
      checkpoint=CheckpointConfig(every_steps=1000),
  )
