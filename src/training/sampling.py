"""Text generation from a prompt: greedy and temperature sampling, one row per temperature.

Each new token reruns the model over a fixed-length buffer (causal attention makes the positions after
the current one irrelevant), so one compiled program serves every position. That is quadratic in the
length and meant for short samples that show what a model learned, not for serving.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(graphdef: Any, params: Any, others: Any, prompt_ids: np.ndarray, *, temperatures: Sequence[float],
             max_new_tokens: int, max_len: int, rng: jax.Array) -> list[np.ndarray]:
  """For each temperature, prompt + `max_new_tokens` new token ids (the prompt keeps its end to fit).

  Temperature 0 picks the most likely token (greedy); otherwise tokens are drawn from softmax(logits / T).
  """
  prompt_ids = np.asarray(prompt_ids, np.int32)[-(max_len - 1):]
  length = min(max_len, len(prompt_ids) + max(max_new_tokens, 0))
  rows = len(temperatures)
  buffer = np.zeros((rows, length), np.int32)
  buffer[:, :len(prompt_ids)] = prompt_ids
  temperature_R = jnp.asarray(temperatures, jnp.float32)

  @jax.jit
  def next_tokens(params, others, tokens_RS, position, key):
    logits_RSV, _ = nnx.merge(graphdef, params, others)(tokens_RS)
    logits_RV = logits_RSV[:, position - 1]
    sampled = jax.random.categorical(key, logits_RV / jnp.maximum(temperature_R, 1e-6)[:, None])
    return jnp.where(temperature_R > 0, sampled, jnp.argmax(logits_RV, axis=-1)).astype(jnp.int32)

  tokens = jnp.asarray(buffer)
  for position in range(len(prompt_ids), length):
    rng, key = jax.random.split(rng)
    tokens = tokens.at[:, position].set(next_tokens(params, others, tokens, position, key))
  return list(np.asarray(tokens))
