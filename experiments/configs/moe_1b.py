"""moe_1b: a mid-size MoE (0.94B parameters, 0.24B active) for one GPU or one node, and for AOT analysis.

  python -m experiments.aot --config=experiments/configs/moe_1b.py --target=h100 --devices=8 --out=report.json
  python -m experiments.train --config=experiments/configs/moe_1b.py --workdir=runs/moe_1b   # on GPUs

Model: 16 decoder layers, d_model 1024, grouped-query attention with 16 query / 4 key-value heads of
dimension 64, every layer an MoE block of 32 SwiGLU experts of width 512 with top-4 softmax routing
(renormalised) plus one shared expert of the same width, vocabulary 32768, untied embeddings.
Parameters (meshmoe.analysis.cost_model.active_params): 940,082,176 total and 235,439,104 active per token (0.94B /
0.24B); 1.4 GFLOP per token for a training step at seq_len 2048. The shape sits between tiny_moe and the
full-size configs: large enough that the GEMMs, not the launch overheads, set a GPU's step time, small
enough that parameters, gradients and Adam moments (16 bytes per parameter, 15 GB) fit on one 80 GB H100.

Data: the vocabulary is sized for a real tokenizer (`--config.data.tokenizer=tokenizer.json`); with the
default byte-level stdlib corpus only the first 256 rows of the embedding are used, which changes nothing
but the (tiny) cost of the unused rows.

Choices:
- mesh: preset "megascale", expert=-1 (all devices; 32 experts split 8 ways at 8 GPUs, 4 per device):
  attention is sequence parallel over the same devices, the FFN expert parallel, the switch between
  them an all-to-all. On one GPU every axis is 1 and the step is the single-device program.
- bf16 compute, remat "dots": activations at 8K tokens per device are small beside 15 GB of state.
- train: 2048-token sequences, 64 per step (131K tokens), so 8 sequences per device on 8 GPUs.
- parallel.impl "xla": the overlapped tier (ring collective matmuls, chunked MoE pipeline).
"""

from meshmoe.config import (CheckpointConfig, Config, MeshConfig, ModelConfig, MoEConfig, OptimizerConfig,
                            ParallelConfig, TrainConfig)


def get_config() -> Config:
  return Config(
      model=ModelConfig(
          vocab_size=32768, embed_dim=1024, num_layers=16, num_dense_layers=0, num_heads=16, num_kv_heads=4,
          head_dim=64, mlp_dim=4096,  # mlp_dim: unused, no dense layers
          max_seq_len=4096, rope_theta=10_000.0, tie_embeddings=False, dtype="bfloat16", remat="dots",
          moe=MoEConfig(num_experts=32, top_k=4, expert_mlp_dim=512, num_shared_experts=1, score_fn="softmax",
                        normalize_top_k=True, aux_loss_weight=0.01, z_loss_weight=1e-3),
      ),
      mesh=MeshConfig(data=1, expert=-1, tensor=1, sequence=1, preset="megascale"),
      parallel=ParallelConfig(impl="xla", moe_chunks=2),
      optimizer=OptimizerConfig(learning_rate=6e-4, warmup_steps=200, min_learning_rate_ratio=0.1),
      train=TrainConfig(steps=5000, global_batch_size=64, seq_len=2048, log_every=10, eval_every=500),
      checkpoint=CheckpointConfig(every_steps=500, keep=3),
  )
