"""Low-precision token exchanges of the MoE layer: FP8 dispatch and a low-precision combine.

The `all_to_all` expert path (expert_parallel.py) moves rows twice per layer and the backward moves their
cotangents back: the dispatch sends each token's row to its experts' devices, the return sends each expert
output back to the token's device, where the combine sums them in float32. `move_rows` performs one such
trip in a chosen format ("wire format"), with the format of its backward chosen apart:

Formats (meshmoe.config.EXCHANGE_FORMATS):
- "auto": the rows travel as they are (the activation dtype); the plain path, no conversion;
- "bfloat16": cast to bfloat16 for the trip (as uint16: XLA:CPU widens bfloat16 collectives to float32) and
  back to the destination's dtype;
- "float8_e4m3fn": DeepEP's FP8 layout. Each row is cut into blocks of 128 channels (the last block may be
  shorter); block j of a row is scaled by s_j = amax_j / 448 (448: e4m3's largest finite value) and
  rounded to float8 e4m3. The row travels as D bytes of float8 followed by the ceil(D/128) float32 scales
  as 4 bytes each: one [R, D + 4 ceil(D/128)] uint8 payload, so one collective carries values and scales
  (`row_bytes`: 1.03 bytes per channel against 2 for bfloat16). All-zero rows (padding) decode to zeros.

Error bound (float8). For a value v in a block with largest magnitude a, u = v/s has |u| <= 448. e4m3 keeps
3 mantissa bits: a normal |u| >= 2^-6 is rounded to within 2^-4 |u|; below, the subnormal spacing is 2^-9,
so within 2^-10. Scaling back by s: |dequantised - v| <= 2^-4 |v| + 2^-10 a/448 (`float8_error_bound`),
plus the rounding of the destination dtype (half its epsilon, relatively) and float32's (2^-24, relatively).

Gradients. A trip only moves rows: its transpose moves them back (`Movers.forward`/`.backward`, which
expert_parallel builds from one exchange as mutual transposes). The conversion is straight-through: the
backward treats dequantise(quantise(x)) as x, and sends the cotangent back in the backward format (the
cotangent of a row that did not travel, a padding row, is dropped). This is a custom VJP on purpose: were the
uint8 payload left to autodiff, the gradient through `bitcast_convert_type` and the integer collective would
silently be zero. The gradient is therefore the exact gradient of the op with its input replaced by the
dequantised rows (tests/test_exchange_formats.py checks it against finite differences of that op), and
exact when the backward format is "auto".
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

FLOAT8_BLOCK = 128  # channels per float32 scale (DeepEP's FP8 dispatch)
FLOAT8_MAX = 448.0  # e4m3fn's largest finite magnitude
_SCALE_BYTES = 4

Mover = Callable[[jax.Array, Any], jax.Array]  # (payload rows [X, W] of any dtype, route) -> rows [Y, W]


class Movers(NamedTuple):
  """One trip and its transpose: `backward` moves every row `forward` delivered back to where it was read."""

  forward: Mover
  backward: Mover


class Trip(NamedTuple):
  """Static description of one trip: the wire formats and the dtypes at both ends."""

  forward_format: str
  backward_format: str
  source_dtype: Any  # the rows' dtype before the trip (and of their cotangents after the backward)
  destination_dtype: Any  # the rows' dtype after the trip


def is_plain(forward_format: str, backward_format: str) -> bool:
  """Whether a trip needs no conversion either way (the exchange runs as it would without this module)."""
  return forward_format == "auto" and backward_format == "auto"


def row_bytes(wire_format: str, width: int, dtype) -> float:
  """Bytes one row of `width` channels of `dtype` takes on the wire."""
  if wire_format == "float8_e4m3fn":
    return width + _SCALE_BYTES * math.ceil(width / FLOAT8_BLOCK)
  if wire_format == "bfloat16":
    return 2 * width
  return jnp.dtype(dtype).itemsize * width


def float8_error_bound(x_RD: jax.Array) -> jax.Array:
  """The bound above on |dequantise(quantise(x)) - x|, elementwise (before the destination's rounding)."""
  x = x_RD.astype(jnp.float32)
  return 2.0**-4 * jnp.abs(x) + 2.0**-10 * _per_channel(_block_amax(x), x.shape[-1]) / FLOAT8_MAX


def _block_amax(x_RD: jax.Array) -> jax.Array:
  """[R, ceil(D/128)]: the largest magnitude of each block of 128 channels (the last one padded)."""
  r, d = x_RD.shape
  blocks = math.ceil(d / FLOAT8_BLOCK)
  padded = jnp.pad(jnp.abs(x_RD), ((0, 0), (0, blocks * FLOAT8_BLOCK - d)))
  return jnp.max(padded.reshape(r, blocks, FLOAT8_BLOCK), axis=-1)


def _per_channel(x_RB: jax.Array, width: int) -> jax.Array:
  """[R, width]: each block's value repeated over its channels."""
  return jnp.repeat(x_RB, FLOAT8_BLOCK, axis=-1)[:, :width]


def encode(x_RD: jax.Array, wire_format: str) -> jax.Array:
  """Rows as they travel: the same dtype ("auto"), bfloat16 bits (uint16), or the packed float8 payload
  (uint8)."""
  if wire_format == "auto":
    return x_RD
  if wire_format == "bfloat16":
    # As 16-bit integers: XLA:CPU would otherwise widen a bfloat16 collective back to float32.
    return jax.lax.bitcast_convert_type(x_RD.astype(jnp.bfloat16), jnp.uint16)
  x = x_RD.astype(jnp.float32)
  r, d = x.shape
  amax_RB = _block_amax(x)
  # A block of zeros keeps scale 1 (any scale decodes zeros to zeros; 0 would make 0/0 here).
  scale_RB = jnp.where(amax_RB > 0, amax_RB / FLOAT8_MAX, 1.0)
  values = jax.lax.bitcast_convert_type((x / _per_channel(scale_RB, d)).astype(jnp.float8_e4m3fn), jnp.uint8)
  scales = jax.lax.bitcast_convert_type(scale_RB, jnp.uint8).reshape(r, -1)
  return jnp.concatenate([values, scales], axis=-1)


def decode(payload: jax.Array, wire_format: str, width: int, dtype) -> jax.Array:
  """`encode`'s inverse (up to its rounding), as rows of `width` channels of `dtype`."""
  if wire_format == "auto":
    return payload.astype(dtype)
  if wire_format == "bfloat16":
    return jax.lax.bitcast_convert_type(payload, jnp.bfloat16).astype(dtype)
  r = payload.shape[0]
  values = jax.lax.bitcast_convert_type(payload[:, :width], jnp.float8_e4m3fn).astype(jnp.float32)
  scale_RB = jax.lax.bitcast_convert_type(payload[:, width:].reshape(r, -1, _SCALE_BYTES), jnp.float32)
  return (values * _per_channel(scale_RB, width)).astype(dtype)


def _trip(mover: Mover, wire_format: str, rows: jax.Array, route, dtype) -> jax.Array:
  return decode(mover(encode(rows, wire_format), route), wire_format, rows.shape[-1], dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def move_rows(movers: Movers, trip: Trip, rows_XD: jax.Array, route) -> jax.Array:
  """rows_XD moved by `movers.forward` in `trip.forward_format`, arriving as `trip.destination_dtype`;
  `route` (integer arrays the movers read) has no gradient."""
  return _trip(movers.forward, trip.forward_format, rows_XD, route, trip.destination_dtype)


def _move_rows_fwd(movers, trip, rows_XD, route):
  return move_rows(movers, trip, rows_XD, route), route


def _move_rows_bwd(movers, trip, route, grad_YD):
  grad_XD = _trip(movers.backward, trip.backward_format, grad_YD, route, trip.source_dtype)
  return grad_XD, jax.tree.map(lambda _: None, route)


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)
