"""Fixed tolerances per dtype (ARCHITECTURE.md, "Testing") and the one comparison every test uses.

Relative error is measured against the size of the expected tensor: max|actual - expected| <= rtol *
max|expected|. Elementwise relative error would be dominated by entries that happen to be near zero.
"""

import numpy as np

FP32_MODULE_RTOL = 1e-5  # one module (router, MoE block) against its reference
FP32_MODEL_RTOL = 1e-4  # a whole model's loss and gradients against the single-device result
# bfloat16 keeps 8 significant bits: each rounding is off by up to u = 2^-8 = 3.9e-3. A whole model's
# gradient collects tens of them (seen: up to 2.8e-2 per tensor against float32); its loss, a mean over
# every token, far fewer (seen: 1.2e-4 at initialisation, 1.7e-3 after thirty optimizer steps).
BF16_MODEL_RTOL = 5e-2  # a whole model's gradients under bfloat16 compute against float32
BF16_LOSS_RTOL = 5e-3  # its loss
# A float32 computation whose state is rounded to bfloat16 between steps (optimizer.moments_dtype) against a
# reference doing the same in another order: where float32 rounding puts a value on the other side of a
# bfloat16 rounding boundary, that element differs by one bfloat16 step (up to 2^-7 of it) and so does what
# it feeds (a parameter's change through Adam's m / sqrt(v): within about 2^-7 too).
BF16_ROUNDING_RTOL = 2**-7


def assert_close(actual, expected, rtol: float, what: str = "") -> None:
  actual = np.asarray(actual, np.float64)
  expected = np.asarray(expected, np.float64)
  assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
  scale = float(np.max(np.abs(expected))) if expected.size else 0.0
  error = float(np.max(np.abs(actual - expected))) if expected.size else 0.0
  assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
  assert error <= rtol * scale, (
      f"{what}: max abs error {error:.3e} exceeds {rtol:g} x max |expected| {scale:.3e} "
      f"(relative {error / scale if scale else float('inf'):.3e})")
