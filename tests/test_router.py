"""Router and router-loss unit tests against hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax.sharding import NamedSharding, PartitionSpec

from meshmoe.analysis import deviceless, hlo_collectives
from meshmoe.config import MoEConfig
from meshmoe.models.router import Router, top_k_experts, update_expert_bias
from tests.tolerances import FP32_MODULE_RTOL, assert_close
from tests.model_steps import gpu_mesh

D, E = 8, 4


def _router(**overrides) -> Router:
  return Router(D, MoEConfig(num_experts=E, **{"top_k": 2, **overrides}), std=0.5, rngs=nnx.Rngs(0))


def _softmax(z):
  z = np.asarray(z, np.float64)
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_softmax_top2_weights_and_choice():
  router = _router()
  x = jax.random.normal(jax.random.key(0), (5, D))
  out = router(x)
  probs = _softmax(np.asarray(x, np.float64) @ np.asarray(router.kernel_DE[...], np.float64))
  expected_choice = np.argsort(-probs, axis=-1)[:, :2]
  np.testing.assert_array_equal(np.asarray(out.experts_TK), expected_choice)
  top = np.take_along_axis(probs, expected_choice, -1)
  assert_close(out.weights_TK, top / top.sum(-1, keepdims=True), FP32_MODULE_RTOL, "weights")


def test_sigmoid_unnormalised_scaled_weights():
  router = _router(score_fn="sigmoid", normalize_top_k=False, routed_scaling=2.5)
  x = jax.random.normal(jax.random.key(1), (5, D))
  out = router(x)
  scores = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(router.kernel_DE[...], np.float64))))
  choice = np.argsort(-scores, axis=-1)[:, :2]
  np.testing.assert_array_equal(np.asarray(out.experts_TK), choice)
  assert_close(out.weights_TK, 2.5 * np.take_along_axis(scores, choice, -1), FP32_MODULE_RTOL, "weights")


def test_expert_bias_changes_choice_but_not_weights():
  router = _router(expert_bias=True)
  x = jax.random.normal(jax.random.key(2), (6, D))
  router.bias_E[...] = jnp.array([0.0, 0.0, 5.0, 5.0])
  out = router(x)
  np.testing.assert_array_equal(np.sort(np.asarray(out.experts_TK), -1), np.tile([2, 3], (6, 1)))
  probs = _softmax(np.asarray(x, np.float64) @ np.asarray(router.kernel_DE[...], np.float64))
  top = np.take_along_axis(probs, np.asarray(out.experts_TK), -1)
  assert_close(out.weights_TK, top / top.sum(-1, keepdims=True), FP32_MODULE_RTOL, "unbiased weights")


def _group_limited_reference(scores, bias, num_groups, top_k_groups, k, scaling):
  """DeepSeek-V3's routing as transformers' DeepseekV3TopkRouter writes it, in numpy float64."""
  choice = scores + bias
  tokens, experts = choice.shape
  grouped = choice.reshape(tokens, num_groups, experts // num_groups)
  group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
  kept = np.argsort(-group_scores, axis=-1, kind="stable")[:, :top_k_groups]
  mask = np.zeros((tokens, num_groups), bool)
  np.put_along_axis(mask, kept, True, axis=-1)
  masked = np.where(np.repeat(mask, experts // num_groups, axis=-1), choice, -np.inf)
  chosen = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
  weights = np.take_along_axis(scores, chosen, -1)
  return chosen, scaling * weights / (weights.sum(-1, keepdims=True) + 1e-20)


def test_group_limited_routing_matches_deepseek_v3():
  moe = MoEConfig(num_experts=16, top_k=4, score_fn="sigmoid", expert_bias=True, routed_scaling=2.5,
                  num_groups=4, top_k_groups=2)
  router = Router(D, moe, std=0.5, rngs=nnx.Rngs(3))
  router.bias_E[...] = 0.1 * jax.random.normal(jax.random.key(4), (16,))
  x = jax.random.normal(jax.random.key(5), (64, D))
  out = router(x)
  scores = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(router.kernel_DE[...], np.float64))))
  chosen, weights = _group_limited_reference(scores, np.asarray(router.bias_E[...], np.float64), 4, 2, 4, 2.5)
  np.testing.assert_array_equal(np.asarray(out.experts_TK), chosen)
  assert_close(out.weights_TK, weights, FP32_MODULE_RTOL, "weights")
  # The limit binds: every token's experts lie in at most 2 groups, and without it some would not.
  assert max(len(set(row // 4)) for row in np.asarray(out.experts_TK)) == 2
  unlimited = Router(D, MoEConfig(**{**vars(moe), "num_groups": 1, "top_k_groups": 1}), std=0.5, rngs=nnx.Rngs(3))
  unlimited.bias_E[...] = router.bias_E[...]
  assert max(len(set(row // 4)) for row in np.asarray(unlimited(x).experts_TK)) > 2


def test_expert_bias_is_not_a_trainable_param():
  router = _router(expert_bias=True)
  params = nnx.state(router, nnx.Param)
  assert "bias_E" not in params
  assert "bias_E" in nnx.state(router)


def test_update_expert_bias_moves_toward_balance():
  bias = jnp.zeros((E,))
  load = jnp.array([10.0, 2.0, 4.0, 4.0])  # mean 5
  new = update_expert_bias(bias, load, rate=0.1)
  np.testing.assert_allclose(np.asarray(new), [-0.1, 0.1, 0.1, 0.1])


def test_uniform_router_losses():
  """Zero logits: every probability is 1/E, so the balance loss is exactly 1 and z-loss is log(E)^2."""
  router = _router()
  router.kernel_DE[...] = jnp.zeros((D, E))
  out = router(jnp.ones((7, D)))
  np.testing.assert_allclose(float(out.aux_loss), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(out.z_loss), math.log(E) ** 2, rtol=1e-6)
  assert float(jnp.sum(out.load_E)) == 7 * 2


def test_balance_loss_matches_formula_and_penalises_imbalance():
  router = _router()
  x = jax.random.normal(jax.random.key(3), (9, D))
  out = router(x)
  logits = np.asarray(x, np.float64) @ np.asarray(router.kernel_DE[...], np.float64)
  probs = _softmax(logits)
  choice = np.argsort(-probs, axis=-1)[:, :2]
  fraction = np.bincount(choice.reshape(-1), minlength=E) / (9 * 2)
  expected_aux = E * np.sum(fraction * probs.mean(0))
  assert_close(out.aux_loss, expected_aux, FP32_MODULE_RTOL, "aux loss")
  z = np.log(np.exp(logits).sum(-1))
  assert_close(out.z_loss, np.mean(z ** 2), FP32_MODULE_RTOL, "z loss")
  np.testing.assert_array_equal(np.asarray(out.load_E), np.bincount(choice.reshape(-1), minlength=E))

  # All tokens on the experts with the highest mean probability: the loss exceeds the balanced value 1.
  router.kernel_DE[...] = jnp.zeros((D, E)).at[:, 0].set(3.0).at[:, 1].set(2.0)
  assert float(router(jnp.ones((9, D))).aux_loss) > 1.5


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_sequence_wise_balance_loss_and_masked_statistics_match_numpy(score_fn):
  """balance_loss="sequence" (DeepSeek-V3's sequence-wise loss) with a token mask: the loss of each
  sequence's counted tokens, E * sum_e f_e * P_e (f_e their share of the sequence's assignments, P_e their
  mean normalised score), averaged over the sequences with a counted token; the load, the batch loss and
  the z-loss over the counted tokens only."""
  router = _router(score_fn=score_fn, balance_loss="sequence")
  x = jax.random.normal(jax.random.key(5), (4, 6, D))
  mask = np.ones((4, 6), np.float32)
  mask[1, 3:] = 0  # padding
  mask[2] = 0  # a sequence with no counted token: left out of the mean
  mask[3, 0] = 0
  out = router(x, jnp.asarray(mask))
  logits = np.asarray(x, np.float64) @ np.asarray(router.kernel_DE[...], np.float64)
  scores = _softmax(logits) if score_fn == "softmax" else 1 / (1 + np.exp(-logits))
  probs = scores / scores.sum(-1, keepdims=True)
  choice = np.argsort(-scores, axis=-1, kind="stable")[..., :2]
  losses, load = [], np.zeros(E)
  for row in range(4):
    counted = mask[row] > 0
    if not counted.any():
      continue
    counts = np.bincount(choice[row][counted].reshape(-1), minlength=E)
    load += counts
    losses.append(E * np.sum(counts / counts.sum() * probs[row][counted].mean(0)))
  assert_close(out.aux_loss, np.mean(losses), FP32_MODULE_RTOL, "sequence-wise loss")
  np.testing.assert_array_equal(np.asarray(out.load_E), load)
  assert float(out.tokens) == mask.sum() and float(out.sequences) == 3
  z = np.log(np.exp(logits).sum(-1)) ** 2
  assert_close(out.z_loss, z[mask > 0].mean(), FP32_MODULE_RTOL, "z loss")
  batch = _router(score_fn=score_fn)
  batch.kernel_DE[...] = router.kernel_DE[...]
  batch_loss = E * np.sum(load / load.sum() * probs[mask > 0].mean(0))
  assert_close(batch(x, jnp.asarray(mask)).aux_loss, batch_loss, FP32_MODULE_RTOL, "batch loss, masked")


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_router_losses_have_gradients(score_fn):
  router = _router(score_fn=score_fn)
  graphdef, params = nnx.split(router)
  x = jax.random.normal(jax.random.key(4), (6, D))

  def losses(params):
    out = nnx.merge(graphdef, params)(x)
    return out.aux_loss + out.z_loss

  grads = jax.grad(losses)(params)
  assert float(jnp.sum(jnp.abs(grads["kernel_DE"][...]))) > 0


@pytest.mark.parametrize("k", [1, 2, 5, 8])
def test_top_k_experts_is_lax_top_k(k):
  """Random scores, and scores drawn from four values (many ties): the same experts in the same order."""
  random = jax.random.normal(jax.random.key(3), (3, 7, 8))
  tied = jax.random.randint(jax.random.key(4), (3, 7, 8), 0, 4).astype(jnp.float32)
  for scores in (random, tied):
    np.testing.assert_array_equal(np.asarray(top_k_experts(scores, k)),
                                  np.asarray(jax.lax.top_k(scores, k)[1]))


def test_top_k_experts_are_distinct_when_scores_are_minus_infinity():
  scores = jnp.array([[-jnp.inf] * 4, [0.5, -jnp.inf, -jnp.inf, -jnp.inf]])
  np.testing.assert_array_equal(np.asarray(top_k_experts(scores, 3)), [[0, 1, 2], [0, 1, 2]])


def test_routing_compiled_for_h100_keeps_tokens_on_their_devices():
  """Batch split over 2 devices and sequence over 4 (the megascale layout), compiled for 8 H100s: the
  routing (choice, weights and losses) needs only all-reduces of per-expert sums. With `lax.top_k` XLA's
  GPU partitioner all-gathered every token's scores to every device."""
  mesh = gpu_mesh((2, 4), ("data", "sequence"))
  tokens = NamedSharding(mesh, PartitionSpec("data", "sequence", None))
  router = Router(D, MoEConfig(num_experts=16, top_k=4), std=0.5, rngs=nnx.Rngs(0))

  def route(x):
    out = router(x)
    return out.experts_TK, out.weights_TK, out.aux_loss, out.z_loss, out.load_E

  x = jax.ShapeDtypeStruct((8, 64, D), jnp.float32, sharding=tokens)
  compiled = deviceless.compile_for_analysis(jax.jit(route, out_shardings=(tokens, tokens, None, None, None)).lower(x))
  kinds = {c.kind for c in hlo_collectives.collectives(compiled.as_text(), 8)}
  assert kinds <= {"all-reduce"}, kinds
