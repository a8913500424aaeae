"""Min-max's arithmetic in jnp: the row functions every path shares, the references, the CPU path.

Each quantize path (the jnp references, the CPU path here, the row kernels of
`minmax`, the GPU kernels of `minmax_gpu`, the Mosaic GPU kernels) calls these
functions on its loaded values, so all of them agree bit for bit. See `minmax`'s
module docstring for the quantizer and the layout.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from lpdec.kernels_pallas import numerics


def order_key(v):
    """float32 <-> int32 whose signed order is the IEEE total order of the floats.

    Non-negative floats keep their bit pattern; negative ones get their magnitude
    bits flipped, so larger magnitudes sort lower. The map is its own inverse.
    The order is total: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN.
    """
    i = jax.lax.bitcast_convert_type(v, jnp.int32)
    return i ^ ((i >> 31) & jnp.int32(0x7FFFFFFF))


def from_order_key(k):
    return jax.lax.bitcast_convert_type(k ^ ((k >> 31) & jnp.int32(0x7FFFFFFF)), jnp.float32)


def _min_max_pair(a, b):
    return jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])


def row_min_max(x, *, variadic: bool):
    """Per-row (lo, hi) of a [r, c] float32 block, each [r, 1].

    The reduction runs on integer order keys. Integer min/max are exact and
    associative, so every reduction order (XLA's, a Pallas block's, a GPU's)
    returns the same bits, -0 sorts below +0, and a NaN cannot be dropped: a row
    holding +NaN gets hi = NaN, one holding -NaN gets lo = NaN, so its unit is
    NaN either way. Float `jnp.min` / `jnp.max` are two passes over x on XLA
    CPU, which hands them to YNNPACK, whose min/max drop NaN (rows of 2048
    holding a NaN came out finite, hiding the NaN from `is_finite`).

    With `variadic`, one `lax.reduce` carries both accumulators, so XLA reads x
    once, in a loop of five instructions per vector (float min/max with NaN and
    signed-zero handling take nine, and ran ~10% slower). Pallas's GPU/TPU
    lowerings know only reduce_min/reduce_max, so compiled kernels reduce the
    keys twice; the values are the same.
    """
    key = order_key(x)
    if variadic:
        init = (jnp.int32(jnp.iinfo(jnp.int32).max), jnp.int32(jnp.iinfo(jnp.int32).min))
        lo, hi = jax.lax.reduce((key, key), init, _min_max_pair, (1,))
        lo, hi = lo[:, None], hi[:, None]
    else:
        lo, hi = jnp.min(key, axis=1, keepdims=True), jnp.max(key, axis=1, keepdims=True)
    return from_order_key(lo), from_order_key(hi)


# Adding 2**23 to a float32 in [0, 2**23) leaves the nearest integer (ties to
# even, like jnp.round) in the low mantissa bits: the sum's spacing is exactly 1.
_MAGIC = 2.0**23


def codes_from_levels(t, top: int):
    """float32 levels t -> uint8 codes clip(round(t), 0, top), with NaN -> 0.

    Each comparison clips one end in one select, and `t > 0` is False for NaN,
    so NaN becomes 0 on the way. Adding 2**23 then rounds to nearest even and
    leaves the integer in the low bits, read with a bitcast and a truncation.
    On XLA CPU this loop ran about twice as fast as jnp.round + jnp.clip + an
    isnan select + the saturating float->uint8 convert (which adds its own range
    checks), with identical codes: the bounds are integers, so clipping before
    or after rounding gives the same result.
    """
    bound = jnp.float32(top)
    t = jnp.where(t > 0, t, jnp.float32(0))
    t = jnp.where(t < bound, t, bound)
    pattern = jax.lax.bitcast_convert_type(t + jnp.float32(_MAGIC), jnp.uint32)
    return pattern.astype(jnp.uint8)


def row_scales(x, *, bits: int, variadic: bool):
    """[r, c] float32 -> (lo, unit, 1 / unit or 0), each float32 [r, 1]."""
    lo, hi = row_min_max(x, variadic=variadic)
    # Multiply by a rounded reciprocal rather than divide by a constant: XLA rewrites
    # x / c as x * (1 / c) in some fusions and not others, which would change the last bit.
    unit = (hi - lo) * jnp.float32(1.0 / numerics.levels(bits))
    # 1 / unit, or 0 where unit is 0 or NaN. Written with the division last (1/inf = 0)
    # so XLA keeps it in its own small fusion: the element-wise loop then loads one
    # scale per row instead of recomputing unit and the select for every vector.
    inv_unit = 1.0 / jnp.where(unit > 0, unit, jnp.float32(jnp.inf))
    return lo, unit, inv_unit


def element_codes(x, lo, inv_unit, seeds, index, *, bits: int):
    """Element-wise codes of float32 x given scales broadcastable to x.

    `index` (uint32, x's shape) is each element's flat index for stochastic
    rounding, None for nearest. `seeds`: a uint32[1, 2] array or ref, or the
    pair of scalars already loaded (a kernel reading one row of a seed table).
    """
    t = (x - lo) * inv_unit
    if index is not None:
        seed0, seed1 = seeds if isinstance(seeds, tuple) else (seeds[0, 0], seeds[0, 1])
        t = jnp.floor(numerics.rounded(t) + numerics.hash_uniform(seed0, seed1, index))
    # Rounding error can push t just outside [0, top]: the codes clamp at both ends.
    # A NaN t (the row's scales already carry the NaN) gets code 0.
    return codes_from_levels(t, numerics.levels(bits))


def quantize_rows(x, seeds, row0, *, bits: int, stochastic: bool, variadic: bool):
    """[r, c] float -> (uint8 codes [r, c], float32 lo [r, 1], float32 unit [r, 1])."""
    x = x.astype(jnp.float32)
    lo, unit, inv_unit = row_scales(x, bits=bits, variadic=variadic)
    index = numerics.element_index(x.shape, row0, x.shape[1]) if stochastic else None
    return element_codes(x, lo, inv_unit, seeds, index, bits=bits), lo, unit


def dequantize_rows(codes, lo, unit):
    return lo + numerics.rounded(codes.astype(jnp.float32) * unit)


def accumulate_rows(acc, weight, codes, lo, unit):
    return acc + numerics.rounded(weight * dequantize_rows(codes, lo, unit))


# ----------------------------------------------------------------------------
# jnp references (the CPU implementation).
# ----------------------------------------------------------------------------


def quantize_reference(x2d, seeds, *, bits: int, stochastic: bool):
    """jnp reference of the fused quantize: see the module docstring."""
    return quantize_rows(x2d, seeds, 0, bits=bits, stochastic=stochastic, variadic=True)


def dequantize_reference(codes, lo, unit, *, dtype=jnp.float32):
    """jnp reference: lo + codes * unit, cast to `dtype`."""
    return dequantize_rows(codes, lo, unit).astype(dtype)


def dequantize_accumulate_reference(acc, weight, codes, lo, unit):
    """jnp reference: acc + weight * (lo + codes * unit), in float32."""
    return accumulate_rows(acc, jnp.asarray(weight, jnp.float32).reshape(1, 1), codes, lo, unit)


# ----------------------------------------------------------------------------
# The CPU path in the caller's layout.
#
# XLA CPU updates a buffer carried through a loop (an optimizer state in a
# `lax.scan`) in place only when the fusion that writes it reads the old value
# element for element in the same shape. Viewing a state leaf as [rows, chunk]
# breaks that, and XLA then copies the leaf every step: two model-sized copies
# per CHOCO step. These functions take per-element scales (the per-chunk scales
# spread over the caller's shape) and do the same arithmetic as the row
# functions above, so they give the same bits.
# ----------------------------------------------------------------------------


def spread(per_chunk, chunk: int, shape: tuple[int, ...]):
    """Per-chunk values -> one per element of `shape` (chunks of `chunk` row-major elements).

    Only the scales are broadcast and reshaped; the data keeps its own shape.
    """
    d = math.prod(shape)
    rows = per_chunk.size
    spread = jnp.broadcast_to(per_chunk.reshape(rows, 1), (rows, chunk)).reshape(-1)
    return spread[:d].reshape(shape)


def chunk_scales(flat, chunk: int, *, bits: int):
    """Per-chunk (lo, unit, 1 / unit or 0) of a flat float array, each float32 [rows, 1].

    The full chunks and the partial last one are reduced as two views of `flat`,
    so a ragged size costs no padded copy.
    """
    full = flat.size // chunk
    views = []
    if full:
        views.append(flat[: full * chunk].reshape(full, chunk))
    if full * chunk != flat.size:
        views.append(flat[full * chunk :].reshape(1, -1))
    parts = [row_scales(v.astype(jnp.float32), bits=bits, variadic=True) for v in views]
    if not parts:  # an empty array: no chunks
        return tuple(jnp.zeros((0, 1), jnp.float32) for _ in range(3))
    if len(parts) == 1:
        return parts[0]
    return tuple(jnp.concatenate(p, axis=0) for p in zip(*parts, strict=True))


def quantize_elementwise(x, seeds, *, chunk: int, bits: int, stochastic: bool):
    """(codes in x's shape, lo, unit) with the scales spread over x's shape.

    Stochastic rounding draws element i's bits from its flat (row-major) index,
    as the [rows, chunk] kernels do.
    """
    lo, unit, inv_unit = chunk_scales(x.reshape(-1), chunk, bits=bits)
    index = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape) if stochastic else None
    codes = element_codes(
        x.astype(jnp.float32),
        spread(lo, chunk, x.shape),
        spread(inv_unit, chunk, x.shape),
        seeds,
        index,
        bits=bits,
    )
    return codes, lo, unit
