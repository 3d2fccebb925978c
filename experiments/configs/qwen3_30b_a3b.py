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
- mesh: preset "megascale" with expert=32 (4 experts per rank), tensor=1, data=-1 (2 at 64 devices).
  megascale splits nothing over data, so the float32 parameter + gradient + two Adam moments (16 bytes
  per parameter) per device are 83 GB with expert=8, tensor=1 (no fit on an 80 GB H100 at any device
  count) and 39 GB with expert=32. Growing the expert axis rather than tensor keeps each 768-wide
  expert whole (tensor=4 would leave 192-wide expert GEMMs) and makes attention sequence parallel over
  the same 32 devices (MegaScale-MoE's layout), which is cheap here: only 4 key-value heads are
  gathered. The 4 key-value heads cap tensor at 4.
- remat "dots": per device activations are small (d_model 2048; 16 sequences x 128 tokens = 2K
  tokens per device per micro-batch at 64 devices), so keeping the q/k/v/output projections and router
  logits (~7.4K values per token per layer beside the 2K input, ~3 GB in all here) is affordable and
  skips their recompute, 26% of a layer's matmul FLOPs at 4096 tokens. The expert GEMMs (ragged_dot) are not
  dot_general, so "dots" recomputes them like "full" does. Use remat="full" where memory is short.
- train: 4096-token sequences (Qwen3's pre-training stages 1-2), 1024 per step (4.2M tokens; the
  report does not give the batch) in 32 micro-batches (memory, below). steps only sets the schedule
  length (~1T tokens of the published 36T).
- parallel.impl "pallas" with the 32 micro-batches set here, so that the step fits an 80 GB H100 whichever
  tier runs it: the fused kernels where they apply, else the xla tier (grouped GEMM kernels, chunked ragged
  all-to-alls; on CPUs "pallas" runs it, with a warning). The xla tier peaks at 62.6 GB per device
  compiled for 64 H100s (experiments/benchmarks/RESULTS.md); the dropless exchange's worst-case receive
  buffers grow with the micro-batch. The reference tier does not fit: XLA multiplies each device's
  dropless worst-case receive buffer by all 4 local experts densely (101x the useful FLOPs).
- optimizer: the report gives no optimizer settings; AdamW, peak lr 3e-4, 2000 warmup steps, cosine to
  10%, betas (0.9, 0.95), weight decay 0.1, clip 1.0.
- router losses: aux_loss_weight 0.008 is the Hugging Face router_aux_loss_coef 0.001 times top_k: HF's
  Switch loss equals top_k when balanced, meshmoe's equals 1. Qwen3 balances over the global batch,
  and so does meshmoe's loss (it is computed over all the tokens of a micro-batch). No z-loss.
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
              z_loss_weight=0.0, capacity_factor=None),
      ),
      mesh=MeshConfig(data=-1, expert=32, tensor=1, sequence=1, preset="megascale"),
      parallel=ParallelConfig(impl="pallas"),
      optimizer=OptimizerConfig(learning_rate=3e-4, warmup_steps=2000, min_learning_rate_ratio=0.1, b1=0.9,
                                b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0),
      train=TrainConfig(steps=250_000, global_batch_size=1024, seq_len=4096, grad_accum_steps=32,
                        log_every=10, eval_every=1000),
      checkpoint=CheckpointConfig(every_steps=1000),
  )
