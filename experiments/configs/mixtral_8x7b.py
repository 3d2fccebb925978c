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

Compiled for 64 H100s with the 32 micro-batches set here (experiments/benchmarks/RESULTS.md), the step
peaks at 48.8 GB per device with the fused kernels (parallel.impl "pallas", the default here) and at
51.4 GB with the xla tier (grouped GEMM kernels, chunked ragged all-to-alls), which "pallas" runs where no
kernel applies (on CPUs, with a warning). Fewer micro-batches need more memory: the worst-case receive
buffers of the dropless exchange grow with the micro-batch.

Choices:
- mesh: preset "megascale" with expert=8 (one expert per rank, as there are 8), tensor=4, data=-1 (2 at
  64 devices). megascale splits only the experts (over expert), expert width and heads (over tensor) and
  nothing over data, so the float32 parameter + gradient + two Adam moments (16 bytes per parameter)
  per device are 116 GB with tensor=1 (does not fit an 80 GB H100 at any device count) and 32 GB with
  tensor=4 (18 GB with tensor=8, data=1).
- remat "full": only each layer's input (4096 values per token) is kept for the backward pass, at the
  cost of one extra forward (~4/3 the compute). "dots" would also keep the q/k/v/output projections
  (10240 more values per token per layer, 3.5x the memory) but save little compute: the expert GEMMs are
  ragged_dot, which the "dots" policy (dot_general without batch dimensions) does not keep, so they
  are recomputed either way, and they are ~85% of the layer's matmul FLOPs.
- train: 4096-token sequences, 1024 per step (4.2M tokens, the Llama-2 recipe; Mistral did not publish
  Mixtral's) in 32 micro-batches of 32 sequences: at 64 devices 16 per data rank, each device holding
  512 tokens of each (8K tokens per device per micro-batch, enough rows per expert for full GEMM tiles).
  steps only sets the schedule length (~1T tokens).
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
          init_std=0.02, dtype="bfloat16", remat="full",
          moe=MoEConfig(
              num_experts=8, top_k=2, expert_mlp_dim=14336, num_shared_experts=0, score_fn="softmax",
              normalize_top_k=True, routed_scaling=1.0, expert_bias=False, aux_loss_weight=0.04,
              z_loss_weight=0.0, capacity_factor=None),
      ),
      mesh=MeshConfig(data=-1, expert=8, tensor=4, sequence=1, preset="megascale"),
      parallel=ParallelConfig(impl="pallas"),
      optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2000, min_learning_rate_ratio=0.1, b1=0.9,
                                b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0),
      train=TrainConfig(steps=250_000, global_batch_size=1024, seq_len=4096, grad_accum_steps=32,
                        log_every=10, eval_every=1000),
      checkpoint=CheckpointConfig(every_steps=1000),
  )
