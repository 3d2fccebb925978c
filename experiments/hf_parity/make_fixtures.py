"""Parity fixtures for models/hf_checkpoint.py, made with Hugging Face `transformers` and CPU torch.

  python -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
  /tmp/hf/bin/python experiments/hf_parity/make_fixtures.py tests/golden/hf
  # meshmoe's export read back by transformers (after `bash experiments/run.sh convert --to=hf ...`):
  /tmp/hf/bin/python experiments/hf_parity/make_fixtures.py --check EXPORTED_FOLDER tests/golden/hf/<case>

Builds tiny random models of each supported family with `transformers` (float32, seeded), saves each as
a Hugging Face folder (config.json + model.safetensors) under the output folder, and beside it
`expected.npz`: the input tokens, `transformers`' float32 logits, and every layer's chosen experts per
token (top-k of its router logits, highest first). tests/test_hf_checkpoint.py loads the folders with
meshmoe and compares. Not run by CI (CI has no torch); rerun it when a case is added, and commit its
output. Norm scales are drawn around 1 and weights with std 0.2 (transformers' default 0.02 would leave every logit near zero
and routing near uniform, which would test little).
"""

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
}


def make(name: str, config_class: str, fields: dict, out: pathlib.Path) -> None:
  torch.manual_seed(0)
  config = getattr(transformers, config_class)(**COMMON, **fields)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  with torch.no_grad():  # norms start at ones, which would not show a norm loaded into the wrong place
    for param_name, param in model.named_parameters():
      if "norm" in param_name:
        param.copy_(1.0 + 0.3 * torch.randn_like(param))
  folder = out / name
  model.save_pretrained(folder, safe_serialization=True)
  tokens = torch.randint(0, config.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    result = model(tokens, output_router_logits=True)
  k = config.num_experts_per_tok
  experts = np.stack([torch.topk(r.float(), k, dim=-1).indices.numpy() for r in result.router_logits])
  (folder / "generation_config.json").unlink(missing_ok=True)  # generation settings: not read by meshmoe
  np.savez(folder / "expected.npz", tokens=tokens.numpy().astype(np.int32),
           logits=result.logits.float().numpy(), experts=experts.astype(np.int32))
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


if __name__ == "__main__":
  if len(sys.argv) == 4 and sys.argv[1] == "--check":
    check(sys.argv[2], sys.argv[3])
  else:
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/golden/hf")
