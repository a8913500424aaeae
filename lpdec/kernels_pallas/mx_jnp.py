"""MX formats in jnp: the element formats, the block math every path shares, the references.

The row kernels of `mx`, the flat GPU kernels of `mx_gpu` and the references
call these functions on their loaded values, so they agree bit for bit. See
`mx`'s module docstring for the formats and the rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lpdec.kernels_pallas import numerics

#: Elements per shared scale (the MX block size).
BLOCK = 32
#: E8M0 byte of a block holding NaN or Inf.
NAN_SCALE = 255
_SCALE_BIAS = 127
_MIN_EXP, _MAX_EXP = -126, 126


@dataclasses.dataclass(frozen=True)
class ElementFormat:
    """A sign-exponent-mantissa float format of at most 8 bits (no infinities)."""

    name: str
    ebits: int
    mbits: int
    bias: int
    largest: float

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    @property
    def emax(self) -> int:
        """floor(log2(largest)): the exponent of the top binade."""
        return int(self.largest).bit_length() - 1

    @property
    def largest_mantissa(self) -> int:
        """The float32 mantissa field of `largest` (its significand's fraction bits)."""
        return round((self.largest / 2**self.emax - 1) * 2**23)


FORMATS = {
    # E4M3 keeps S.1111.111 for NaN, so its top binade ends at 1.75 * 2**8 = 448.
    "fp8": ElementFormat("fp8", ebits=4, mbits=3, bias=7, largest=448.0),
    "fp4": ElementFormat("fp4", ebits=2, mbits=1, bias=1, largest=6.0),
}


def check_format(fmt) -> ElementFormat:
    """The `ElementFormat` named `fmt` ("fp8": E4M3, "fp4": E2M1), else ValueError."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be 'fp8' (E4M3) or 'fp4' (E2M1); got {fmt!r}.")
    return FORMATS[fmt]


def _pow2(k):
    """2.0**k as float32 for integer k in [-126, 127], built from its bits (exact)."""
    return jax.lax.bitcast_convert_type((k + 127).astype(jnp.int32) << 23, jnp.float32)


def _magnitude_bits(x):
    """|x|'s float32 bit pattern as int32: its order is |x|'s, NaN above inf."""
    return jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)


def _block_exponents(amax_bits, fmt: ElementFormat):
    """(shared exponent e int32, E8M0 byte uint8) from each block's max |x| bits.

    e = floor(log2 amax) - emax, plus one where amax's significand exceeds the
    largest value's (module docstring); all in integers.
    """
    exponent = (amax_bits >> 23) - jnp.int32(127)
    above = (amax_bits & jnp.int32(0x7FFFFF)) > jnp.int32(fmt.largest_mantissa)
    e = exponent - jnp.int32(fmt.emax) + above.astype(jnp.int32)
    e = jnp.clip(e, _MIN_EXP, _MAX_EXP)
    finite = amax_bits < jnp.int32(0x7F800000)
    byte = jnp.where(finite, e + _SCALE_BIAS, NAN_SCALE).astype(jnp.uint8)
    return e, byte


def _element_codes(v, u, fmt: ElementFormat):
    """Codes of float32 v (|v| <= largest) in `fmt`; u: uniform offsets for stochastic, or None."""
    mag = jnp.abs(v)
    exponent = (_magnitude_bits(mag) >> 23) - jnp.int32(127)
    k = jnp.maximum(exponent, jnp.int32(1 - fmt.bias))
    t = mag * _pow2(jnp.int32(fmt.mbits) - k)  # exact: a power-of-two scaling
    if u is None:
        # t < 2**(mbits + 1) <= 16: adding 2**23 rounds it to nearest even.
        level = jax.lax.bitcast_convert_type(t + jnp.float32(2.0**23), jnp.int32) & 0x7FFFFF
    else:
        level = jnp.floor(t + u).astype(jnp.int32)
    # Rounding up to 2**(mbits + 1) moves to the next binade: 2**mbits there.
    carry = level >= (1 << (fmt.mbits + 1))
    k = jnp.where(carry, k + 1, k)
    level = jnp.where(carry, level >> 1, level)
    normal = level >= (1 << fmt.mbits)
    field = jnp.where(normal, k + jnp.int32(fmt.bias), 0)
    mantissa = jnp.where(normal, level - (1 << fmt.mbits), level)
    # |v| <= largest, so the top code (NaN in E4M3) is never reached; clip anyway.
    top = ((1 << fmt.ebits) - 1) << fmt.mbits | ((1 << fmt.mbits) - 1)
    if fmt.name == "fp8":
        top -= 1
    magnitude_code = jnp.minimum((field << fmt.mbits) | mantissa, jnp.int32(top))
    sign = (v < 0).astype(jnp.int32) << (fmt.ebits + fmt.mbits)
    return (sign | magnitude_code).astype(jnp.uint8)


def _element_values(codes, fmt: ElementFormat):
    """float32 values of `fmt` codes (before the shared scale); exact."""
    c = codes.astype(jnp.int32)
    field = (c >> fmt.mbits) & ((1 << fmt.ebits) - 1)
    mantissa = c & ((1 << fmt.mbits) - 1)
    significand = jnp.where(field > 0, mantissa + (1 << fmt.mbits), mantissa)
    value = significand.astype(jnp.float32) * _pow2(
        jnp.maximum(field, 1) - jnp.int32(fmt.bias + fmt.mbits)
    )
    # The sign goes in as the float's sign bit, not as -value: Triton lowers negation
    # as 0 - x, which turns the code for -0 into +0 (seen compiled on an H100).
    sign = (c >> (fmt.ebits + fmt.mbits)) << 31
    return jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(value, jnp.int32) | sign, jnp.float32
    )


def quantize_views(xs, indices, seeds, *, fmt: ElementFormat):
    """Quantizes one MX block per row, given as views that together hold its 32 elements.

    Args:
      xs: float arrays [r, w], view j holding some of each row's elements (one
        [r, 32] view; or the GPU kernel's strided views, one per code of a byte).
      indices: each view's flat uint32 element indices, from which stochastic
        rounding draws; None per view: round to nearest.
      seeds: uint32 [1, 2] hash seeds (an array or a ref).

    Returns:
      (uint8 codes per view, uint8 E8M0 scales [r, 1]); a NaN/Inf block's codes are 0.
    """
    xs = [x.astype(jnp.float32) for x in xs]
    amax = functools.reduce(
        jnp.maximum, [jnp.max(_magnitude_bits(x), axis=1, keepdims=True) for x in xs]
    )
    e, byte = _block_exponents(amax, fmt)
    scale = _pow2(-e)
    codes = []
    for x, index in zip(xs, indices, strict=True):
        v = x * scale  # exact unless v is a float32 subnormal
        u = None if index is None else numerics.hash_uniform(seeds[0, 0], seeds[0, 1], index)
        codes.append(jnp.where(byte == NAN_SCALE, jnp.uint8(0), _element_codes(v, u, fmt)))
    return codes, byte


def quantize_rows(x, seeds, row0, *, fmt: ElementFormat, stochastic: bool):
    """[r, 32] float -> (uint8 codes [r, 32], uint8 E8M0 scales [r, 1])."""
    index = numerics.element_index(x.shape, row0, x.shape[1]) if stochastic else None
    (codes,), byte = quantize_views([x], [index], seeds, fmt=fmt)
    return codes, byte


def _scale_values(scales):
    """float32 2**(byte - 127) per E8M0 byte, NaN for the NaN byte."""
    e = scales.astype(jnp.int32) - _SCALE_BIAS
    return jnp.where(scales == NAN_SCALE, jnp.float32(jnp.nan), _pow2(jnp.clip(e, -126, 127)))


def dequantize_rows(codes, scales, *, fmt: ElementFormat):
    return _element_values(codes, fmt) * _scale_values(scales)


def accumulate_rows(acc, weight, codes, scales, *, fmt: ElementFormat):
    return acc + numerics.rounded(weight * dequantize_rows(codes, scales, fmt=fmt))


# ----------------------------------------------------------------------------
# jnp references, on the [rows, 32] layout.
# ----------------------------------------------------------------------------


def quantize_reference(x2d, seeds, *, fmt: str, stochastic: bool):
    """jnp reference of the MX quantize: (codes [r, 32], E8M0 scales [r, 1])."""
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    return quantize_rows(x2d, seeds, 0, fmt=check_format(fmt), stochastic=stochastic)


def dequantize_reference(codes, scales, *, fmt: str, dtype=jnp.float32):
    """jnp reference: element value times 2**(scale - 127), cast to `dtype`."""
    return dequantize_rows(codes, scales, fmt=check_format(fmt)).astype(dtype)


def dequantize_accumulate_reference(acc, weight, codes, scales, *, fmt: str):
    """jnp reference: acc + weight * dequantize, in float32."""
    weight = jnp.asarray(weight, jnp.float32).reshape(1, 1)
    return accumulate_rows(acc, weight, codes, scales, fmt=check_format(fmt))
