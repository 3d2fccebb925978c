"""maxtext_tiny_moe: MaxText's tiny MoE shape, to time meshmoe's dropless CPU step against MaxText's.

  bash experiments/run.sh bench --config=maxtext_tiny_moe --preset=dp --data=8 --expert=1
  bash experiments/run.sh bench --config=maxtext_tiny_moe --preset=ep --data=2 --expert=4
  (python -m experiments.bench --config=maxtext_tiny_moe ... from the repository root does the same)

Shape: 4 layers, every one MoE (no dense first layer), d_model 256, 8 query heads of 32 with 8 key-value
heads, 8 experts of width 512 with top-2 softmax routing, dropless, untied embeddings, vocabulary 256,
sequences of 256 tokens, 16 sequences per step, float32, full rematerialisation of every layer. The mesh
defaults to 8 devices under `ep` with the experts over 4 of them (data=2 x expert=4); `--preset=dp
--data=8 --expert=1` gives the data-parallel layout with every expert on every device.
"""

from meshmoe.config import Config, MeshConfig, ModelConfig, MoEConfig, TrainConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(
          vocab_size=256, embed_dim=256, num_layers=4, num_dense_layers=0, num_heads=8, num_kv_heads=8,
          head_dim=32, mlp_dim=512, max_seq_len=256, tie_embeddings=False, dtype="float32", remat="full",
          moe=MoEConfig(num_experts=8, top_k=2, expert_mlp_dim=512, score_fn="softmax"),
      ),
      mesh=MeshConfig(data=2, expert=4, preset="ep"),
      train=TrainConfig(steps=100, global_batch_size=16, seq_len=256),
  )
