"""qwen3_30b_a3b: the shape of Qwen3-30B-A3B (Qwen team, arXiv:2505.09388), for compile-only analysis.

  python -m experiments.aot --config=experiments/configs/qwen3_30b_a3b.py --target=h100 --devices=64 --out=report.json

(`experiments.aot` compiles the real train step for that cluster without GPUs and reports memory, FLOPs and
communication; tests/test_configs.py validates and shape-checks this file.) This config does not train on CPU:
its float32 parameters alone are 122 GB.

Model: 48 decoder layers, d_model 2048, grouped-query attention with 32 query / 4 key-value heads of
dimension 128 (so the attention width, 4096, is twice d_model), RoPE theta 1e6, native context 32768.
Every layer is an MoE block of 128 fine-grained SwiGLU experts of width 768, top-8 softmax routing with
the chosen eight renormalised (norm_topk_prob), no shared experts, no dense layers. Vocabulary 151936,
untied embeddings, RMSNorm eps 1e-6, QK-norm.

Parameters (meshmoe.analysis.cost_model.active_params): 30,532,122,624 total and 3,353,032,704 active per token
(30.53B / 3.35B), as many as the Hugging Face checkpoint has; published 30.5B / 3.3B (3.35B rounds to 3.3B
or 3.4B; the model card says 3.3B). Qwen3 RMS-normalises each query and key head before the rotation
(`qk_norm`). Model FLOPs of a training step (cost_model.train_step_flops at seq_len 4096): 23.1 GFLOP
per token: 47% routed experts, 24% attention projections, 21% attention scores (the attention is
4096 wide on a 2048-wide model), 8% output logits.

Choices:
- mesh: the planner's best layout on 64 H100s (`python -m experiments.plan --config=<this file> --gpus=64`,
  4.25 s per step, 36.0% MFU, modelled at its stated 50% GEMM efficiency, 2026-11-29): preset "ep" with
  expert=2 (64 whole 768-wide experts per rank, inside a node, so the fused MoE kernels' ring is driven
  by one process), data=-1 (32 at 64 devices), every weight's model dimension also split over data for
  storage (mesh.weight_storage="data": 10 GB of float32 parameters, gradients and Adam moments per device;
  each layer's weights gathered where it runs). Compiled deviceless for 64 H100s (2026-11-29,
  experiments/benchmarks/RESULTS.md) the step peaks at 52.9 GB per device; the cost model says 53.9 GB.
  The layout before (megascale 2x32x1x1, 32 micro-batches) ranks 2243rd at 7.0%: its MoE kernels' ring
  over 32 devices spans 4 nodes, so the plan runs the xla tier's exchange there.
- remat "dots": keeping the q/k/v/output projections and router logits (~7.4K values per token per layer
  beside the 2K input) skips their recompute, 26% of a layer's matmul FLOPs at 4096 tokens. The expert
  GEMMs are custom kernels, which "dots" recomputes like "full" does. Use remat="full" where memory is short.
- train: 4096-token sequences (Qwen3's pre-training stages 1-2), 1024 per step (4.2M tokens; the
  report does not give the batch) in 2 micro-batches of 512 (the fewest that fit). steps only sets the
  schedule length (~1T tokens of the published 36T).
- parallel.impl "pallas": the fused MoE kernels (dispatch + grouped GEMM, grouped GEMM + return) on
  Hopper GPUs with one process per node (experiments/slurm/train.sbatch runs that for this config); the
  xla tier elsewhere (on CPUs "pallas" runs it, with a warning).
- optimizer: the report gives no optimizer settings; AdamW, peak lr 3e-4, 2000 warmup steps, cosine to
  10%, betas (0.9, 0.95), weight decay 0.1, clip 1.0.
- router losses: aux_loss_weight 0.008 is the Hugging Face router_aux_loss_coef 0.001 times top_k: HF's
  Switch loss equals top_k when balanced, meshmoe's equals 1. Qwen3 balances over the global batch:
  balance_loss "global_batch" (the loads of every device and of the step's micro-batches so far). No z-loss.
"""

from meshmoe.config import (CheckpointConfig, Config, MeshConfig, ModelConfig, MoEConfig, OptimizerConfig,
                            ParallelConfig, TrainConfig)


def get_config() -> Config:
  return Config(
      model=ModelConfig(
          vocab_size=151936, embed_dim=2048, num_layers=48, num_dense_layers=0, num_heads=32, num_kv_heads=4,
          head_dim=128, mlp_dim=6144,  # mlp_dim: unused, no dense layers
          max_seq_len=32768, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, tie_embeddings=False,
          init_std=0.02, dtype="bfloat16", remat="dots",
          moe=MoEConfig(
              num_experts=128, top_k=8, expert_mlp_dim=768, num_shared_experts=0, score_fn="softmax",
              normalize_top_k=True, routed_scaling=1.0, expert_bias=False, aux_loss_weight=0.008,
              balance_loss="global_batch", z_loss_weight=0.0, capacity_factor=None),
      ),
      mesh=MeshConfig(data=-1, expert=2, tensor=1, sequence=1, preset="ep", weight_storage="data"),
      parallel=ParallelConfig(impl="pallas"),
      optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2000, min_learning_rate_ratio=0.1, b1=0.9,
                                b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0),
      train=TrainConfig(steps=250_000, global_batch_size=1024, seq_len=4096, grad_accum_steps=2,
                        log_every=10, eval_every=1000),
      checkpoint=CheckpointConfig(every_steps=1000),
  )
