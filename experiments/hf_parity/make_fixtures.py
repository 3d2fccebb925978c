"""Parity fixtures for models/hf_checkpoint.py, made with Hugging Face `transformers` and CPU torch.

  python -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
  /tmp/hf/bin/python experiments/hf_parity/make_fixtures.py tests/golden/hf
  # meshmoe's export read back by transformers (after `bash experiments/run.sh convert --to=hf ...`):
  /tmp/hf/bin/python experiments/hf_parity/make_fixtures.py --check EXPORTED_FOLDER tests/golden/hf/<case>

Builds tiny random models of each supported family with `transformers` (float32, seeded), saves each as
a Hugging Face folder (config.json + model.safetensors) under the output folder, and beside it
`expected.npz`: the input tokens, `transformers`' float32 logits, and every MoE layer's chosen experts per
token (sorted ids). DeepSeek-V3 is also written with FP8 weights and 16 x 16 block scales
(`deepseek_v3_fp8`; its logits are those of the dequantised weights, as transformers' FP8 loading needs a
GPU). tests/test_hf_checkpoint.py loads the folders with meshmoe and compares. Not run by CI (CI has no
torch); rerun it when a case is added, and commit its output. Norm scales are drawn around 1 and weights
with std 0.2 (transformers' default 0.02 would leave every logit near zero and routing near uniform,
which would test little).
"""

import json
import pathlib
import sys

import numpy as np
import torch
import transformers

COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10_000.0,
              tie_word_embeddings=False, initializer_range=0.2)
CASES = {
    "mixtral_top2": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "mixtral_top1": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=1, intermediate_size=48)),
    "qwen3_moe_norm_topk": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                                   intermediate_size=80, norm_topk_prob=True)),
    "qwen3_moe_no_norm_topk": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                                      moe_intermediate_size=32, intermediate_size=80,
                                                      norm_topk_prob=False)),
    "qwen3_moe_dense_first": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, intermediate_size=80,
                                                     norm_topk_prob=True, mlp_only_layers=[0])),
    # MLA with a query bottleneck and YaRN, sigmoid routing with a selection bias over 4 groups (2 kept),
    # a shared expert and a dense first layer.
    "deepseek_v3": ("DeepseekV3Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=80,
        n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=12, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0})),
    # No query bottleneck, plain RoPE, values wider than the scores' heads, no group limit.
    "deepseek_v3_no_q_lora": ("DeepseekV3Config", dict(
        n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, intermediate_size=80,
        n_shared_experts=2, first_k_dense_replace=0, n_group=1, topk_group=1, routed_scaling_factor=1.5,
        norm_topk_prob=False, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=24)),
}
FP8_CASE = "deepseek_v3"  # also written with FP8 weights and 16 x 16 block scales as "<case>_fp8"


def _experts_recorder(model, k: int) -> list:
  """DeepSeek's routers return (logits, weights, indices): record each MoE layer's chosen experts."""
  chosen = []
  for module in model.modules():
    if type(module).__name__ == "DeepseekV3TopkRouter":
      module.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].numpy()))
  return chosen


def _quantize_fp8(folder: pathlib.Path, block: int):
  """Rewrites `folder`'s linear weights (all 2-D tensors but the embeddings, the output layer and the
  routers) as float8 e4m3 with one float32 scale per block x block tile (`<name>_scale_inv`, the factor
  that dequantizes); returns the model with the dequantized weights (loaded by transformers from a copy of
  the folder holding them)."""
  import shutil
  import tempfile
  from safetensors.torch import load_file, save_file
  tensors = load_file(folder / "model.safetensors")
  dequantized_tensors = dict(tensors)
  for name in [n for n, t in tensors.items() if t.ndim == 2 and "embed" not in n and "lm_head" not in n
               and not n.endswith("mlp.gate.weight")]:
    w = tensors[name].float()
    rows, columns = -(-w.shape[0] // block), -(-w.shape[1] // block)
    padded = torch.zeros(rows * block, columns * block).index_put_(
        (torch.arange(w.shape[0])[:, None], torch.arange(w.shape[1])[None, :]), w)
    tiles = padded.view(rows, block, columns, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    dequantized = (q.float() * scale[:, None, :, None]).view(rows * block, columns * block)[:w.shape[0], :w.shape[1]]
    tensors[name] = q.view(rows * block, columns * block)[:w.shape[0], :w.shape[1]].contiguous()
    tensors[name + "_scale_inv"] = scale.contiguous()
    dequantized_tensors[name] = dequantized.contiguous()
  with tempfile.TemporaryDirectory() as plain:
    shutil.copy(folder / "config.json", plain)
    save_file(dequantized_tensors, pathlib.Path(plain) / "model.safetensors", metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((folder / "config.json").read_text())
  config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [block, block]}
  (folder / "config.json").write_text(json.dumps(config, indent=2))
  return model


def make(name: str, config_class: str, fields: dict, out: pathlib.Path, fp8_block: int = 0) -> None:
  torch.manual_seed(0)
  fields = {**COMMON, **fields}
  if config_class == "DeepseekV3Config":
    del fields["head_dim"]  # DeepSeek's is the rotary width, qk_rope_head_dim
  config = getattr(transformers, config_class)(**fields)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  with torch.no_grad():  # norms start at ones, which would not show a norm loaded into the wrong place
    for param_name, param in model.named_parameters():
      if "norm" in param_name:
        param.copy_(1.0 + 0.3 * torch.randn_like(param))
    for buffer_name, buffer in model.named_buffers():  # DeepSeek's selection bias starts at zeros
      if buffer_name.endswith("e_score_correction_bias"):
        buffer.copy_(0.05 * torch.randn_like(buffer))
  folder = out / name
  model.save_pretrained(folder, safe_serialization=True)
  if fp8_block:
    model = _quantize_fp8(folder, fp8_block)
  tokens = torch.randint(0, config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
  k = config.num_experts_per_tok
  deepseek = config_class == "DeepseekV3Config"
  recorded = _experts_recorder(model, k) if deepseek else None
  with torch.no_grad():
    result = model(tokens, output_router_logits=not deepseek)
  if deepseek:
    experts = np.stack(recorded)
  else:
    experts = np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy() for r in result.router_logits])
  experts = np.sort(experts, axis=-1)  # the chosen set; transformers' DeepSeek router returns it unsorted
  (folder / "generation_config.json").unlink(missing_ok=True)  # generation settings: not read by meshmoe
  np.savez(folder / "expected.npz", tokens=tokens.numpy().astype(np.int32),
           logits=result.logits.float().numpy(), experts=experts.astype(np.int32))
  if fp8_block:  # transformers' FP8 loading needs a GPU: the logits above are of the dequantized weights
    print(f"{name}: FP8 weights, {fp8_block} x {fp8_block} scales")
    return
  # Round trip through transformers' own loader, so the fixture is what transformers reads back.
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  with torch.no_grad():
    again = reloaded(tokens).logits.float().numpy()
  assert np.array_equal(again, result.logits.float().numpy()), name
  print(f"{name}: {sorted(p.name for p in folder.iterdir())}, logits scale {np.abs(again).max():.3f}")


def check(exported: str, fixture: str) -> None:
  """transformers loads meshmoe's export of a fixture and gives the fixture's logits."""
  expected = np.load(pathlib.Path(fixture) / "expected.npz")
  model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
  with torch.no_grad():
    logits = model(torch.from_numpy(expected["tokens"]).long()).logits.float().numpy()
  error = np.abs(logits - expected["logits"]).max() / np.abs(expected["logits"]).max()
  print(f"{exported}: max |logits - fixture's| / scale = {error:.2e}")
  if error > 1e-4:
    raise SystemExit(f"{exported} does not reproduce {fixture}")


def main(out: str) -> None:
  for name, (config_class, fields) in CASES.items():
    make(name, config_class, fields, pathlib.Path(out))
  make(FP8_CASE + "_fp8", *CASES[FP8_CASE], pathlib.Path(out), fp8_block=16)


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--check":
    check(sys.argv[2], sys.argv[3])
  else:
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/hf")
