"""Text generation from a prompt: greedy or temperature sampling.

Each new token reruns the model over a fixed-length buffer (causal attention makes the padding after the
current position irrelevant), so one compiled program serves every position. That is quadratic in the
length and meant for short samples that show what a model learned, not for serving.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(graphdef: Any, params: Any, others: Any, prompt_ids: np.ndarray, *, max_new_tokens: int,
             max_len: int, temperature: float, rng: jax.Array) -> np.ndarray:
  """Prompt + up to `max_new_tokens` new token ids (the prompt is cut to fit `max_len`, keeping its end).

  temperature 0 picks the most likely token (greedy); otherwise tokens are drawn from softmax(logits / T).
  """
  if max_new_tokens <= 0:
    return np.asarray(prompt_ids)
  prompt_ids = np.asarray(prompt_ids, np.int32)[-(max_len - 1):]
  length = min(max_len, len(prompt_ids) + max_new_tokens)
  buffer = np.zeros((1, length), np.int32)
  buffer[0, :len(prompt_ids)] = prompt_ids
  tokens = jnp.asarray(buffer)

  @jax.jit
  def next_token(params, others, tokens, position, key):
    logits_BSV, _ = nnx.merge(graphdef, params, others)(tokens)
    logits = logits_BSV[0, position - 1]
    if temperature == 0:
      return jnp.argmax(logits).astype(jnp.int32)
    return jax.random.categorical(key, logits / temperature).astype(jnp.int32)

  for position in range(len(prompt_ids), length):
    rng, key = jax.random.split(rng)
    token = next_token(params, others, tokens, position, key)
    tokens = tokens.at[0, position].set(token)
  return np.asarray(tokens[0])
