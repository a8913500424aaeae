"""Block-scaled float formats (OCP Microscaling, "MX"): MXFP8 (E4M3) and MXFP4 (E2M1).

Layout: each MX block of 32 consecutive elements of the flattened input
shares one power-of-two scale 2**e, stored as an E8M0 byte e + 127. The row
kernels and references here see the input as [rows, 32], one block a row; on
GPU the kernels of `mx_gpu` address the flat array instead (no padded copy, and
E2M1 codes packed two a byte in the same pass). Each element is x / 2**e
rounded to the element format: E4M3 (4 exponent bits, 3 mantissa bits, bias 7,
largest value 448) or E2M1 (2, 1, bias 1, largest 6; its values are 0, 0.5, 1,
1.5, 2, 3, 4, 6), with subnormals, sign and magnitude in one code of 8 or 4 bits.

The shared exponent is the smallest e with max|x| <= largest * 2**e, so no
element saturates. The OCP specification (v1.0, section 6.3) takes
e = floor(log2 max|x|) - floor(log2 largest) instead, which puts the block's
largest magnitude in the element format's top binade and clamps what lands
above the largest value (up to 8 / 6 = 1.33x for E2M1). A clamped element is a
biased one, and stochastic rounding is unbiased only without clamping, so this
module takes the next exponent where the OCP rule would clamp: the two agree on
every block whose largest magnitude fits (mantissa <= the format's largest),
and cost the same bytes. e is clamped to [-126, 126] (both 2**e and 2**-e are
normal float32); a block holding NaN or Inf gets the E8M0 NaN byte 255 and
decodes to NaN, and its codes are 0.

Rounding to the element grid: with k = max(floor(log2 |v|), 1 - bias) the
spacing of v's binade is 2**(k - mbits), and t = |v| * 2**(mbits - k) is
rounded to an integer: to nearest even, or stochastically as floor(t + u) with
u from the counter-based hash of (seeds, flat index) as in min-max. Everything
is integer or power-of-two arithmetic, exact on every platform, so the jnp
references and the kernels agree bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import mx_gpu
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms

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


def _quantize_views(xs, indices, seeds, *, fmt: ElementFormat):
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


def _quantize_rows(x, seeds, row0, *, fmt: ElementFormat, stochastic: bool):
    """[r, 32] float -> (uint8 codes [r, 32], uint8 E8M0 scales [r, 1])."""
    index = numerics.element_index(x.shape, row0, x.shape[1]) if stochastic else None
    (codes,), byte = _quantize_views([x], [index], seeds, fmt=fmt)
    return codes, byte


def _scale_values(scales):
    """float32 2**(byte - 127) per E8M0 byte, NaN for the NaN byte."""
    e = scales.astype(jnp.int32) - _SCALE_BIAS
    return jnp.where(scales == NAN_SCALE, jnp.float32(jnp.nan), _pow2(jnp.clip(e, -126, 127)))


def _dequantize_rows(codes, scales, *, fmt: ElementFormat):
    return _element_values(codes, fmt) * _scale_values(scales)


def _accumulate_rows(acc, weight, codes, scales, *, fmt: ElementFormat):
    return acc + numerics.rounded(weight * _dequantize_rows(codes, scales, fmt=fmt))


# ----------------------------------------------------------------------------
# jnp references, on the [rows, 32] layout.
# ----------------------------------------------------------------------------


def quantize_reference(x2d, seeds, *, fmt: str, stochastic: bool):
    """jnp reference of the MX quantize: (codes [r, 32], E8M0 scales [r, 1])."""
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    return _quantize_rows(x2d, seeds, 0, fmt=check_format(fmt), stochastic=stochastic)


def dequantize_reference(codes, scales, *, fmt: str, dtype=jnp.float32):
    """jnp reference: element value times 2**(scale - 127), cast to `dtype`."""
    return _dequantize_rows(codes, scales, fmt=check_format(fmt)).astype(dtype)


def dequantize_accumulate_reference(acc, weight, codes, scales, *, fmt: str):
    """jnp reference: acc + weight * dequantize, in float32."""
    weight = jnp.asarray(weight, jnp.float32).reshape(1, 1)
    return _accumulate_rows(acc, weight, codes, scales, fmt=check_format(fmt))


# ----------------------------------------------------------------------------
# Pallas kernels: a block of whole MX blocks (rows) per grid step.
# ----------------------------------------------------------------------------


def _quantize_kernel(seeds_ref, x_ref, codes_ref, scales_ref, *, fmt, stochastic, rows):
    row0 = pl.program_id(0) * rows
    codes, scales = _quantize_rows(x_ref[...], seeds_ref, row0, fmt=fmt, stochastic=stochastic)
    codes_ref[...] = codes
    scales_ref[...] = scales


def _dequantize_kernel(codes_ref, scales_ref, out_ref, *, fmt):
    out_ref[...] = _dequantize_rows(codes_ref[...], scales_ref[...], fmt=fmt).astype(out_ref.dtype)


def _accumulate_kernel(weight_ref, acc_ref, codes_ref, scales_ref, out_ref, *, fmt):
    out_ref[...] = _accumulate_rows(
        acc_ref[...], weight_ref[0, 0], codes_ref[...], scales_ref[...], fmt=fmt
    )


def _row_blocks(target, rows: int, dtypes):
    """(rows per block, padded rows, the operand blocks) of a [rows, 32] kernel."""
    br = target.block_rows(rows, BLOCK, (*dtypes, jnp.uint8))
    padded = platforms.num_rows(rows, br) * br
    blocks = [((br, BLOCK), (padded, BLOCK), d) for d in dtypes]
    blocks.append(((br, 1), (padded, 1), jnp.uint8))
    return br, padded, blocks


def _row_spec(br, width):
    return pl.BlockSpec((br, width), lambda i: (i, 0))


def kernel_lowers(target, rows: int, dtype) -> bool:
    """Whether `target` runs the MX kernels on [rows, 32] blocks of `dtype` (and uint8 codes).

    Every block is [power of two, 32] or [power of two, 1], so Triton takes any
    row count; TPU takes it too (32 is the array's whole last dim).
    """
    if target is None or not rows:
        return False
    return target.lowers(*_row_blocks(target, rows, (dtype, jnp.uint8))[2])


def _pad(x2d, padded):
    return jnp.pad(x2d, ((0, padded - x2d.shape[0]), (0, 0)))


@functools.partial(jax.jit, static_argnames=("fmt", "stochastic", "interpret", "platform"))
def quantize_pallas(
    x2d,
    seeds,
    *,
    fmt: str,
    stochastic: bool,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
):
    """Pallas kernel of the MX quantize on [rows, 32] (`platform`, `interpret`: see minmax)."""
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    body = functools.partial(_quantize_call, fmt=check_format(fmt), stochastic=stochastic)
    if platform is None:
        return platforms.on_each_platform(body, x2d, seeds, interpret=interpret)
    return body(x2d, seeds, target=platforms.Target(platform, interpret))


def _quantize_call(x2d, seeds, *, fmt, stochastic, target):
    rows = x2d.shape[0]
    br, padded, _ = _row_blocks(target, rows, (x2d.dtype, jnp.uint8))
    kernel = functools.partial(_quantize_kernel, fmt=fmt, stochastic=stochastic, rows=br)
    codes, scales = target.pallas_call(
        kernel,
        block_elements=br * BLOCK,
        grid=(padded // br,),
        in_specs=[target.scalar_spec((1, 2)), _row_spec(br, BLOCK)],
        out_specs=[_row_spec(br, BLOCK), _row_spec(br, 1)],
        out_shape=[
            platforms.out_struct((padded, BLOCK), jnp.uint8, x2d),
            platforms.out_struct((padded, 1), jnp.uint8, x2d),
        ],
    )(seeds, _pad(x2d, padded))
    return codes[:rows], scales[:rows]


@functools.partial(jax.jit, static_argnames=("fmt", "dtype", "interpret", "platform"))
def dequantize_pallas(
    codes,
    scales,
    *,
    fmt: str,
    dtype=jnp.float32,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
):
    """Pallas kernel: the values of [rows, 32] codes times their rows' scales."""
    body = functools.partial(_dequantize_call, fmt=check_format(fmt), dtype=jnp.dtype(dtype))
    if platform is None:
        return platforms.on_each_platform(body, codes, scales, interpret=interpret)
    return body(codes, scales, target=platforms.Target(platform, interpret))


def _dequantize_call(codes, scales, *, fmt, dtype, target):
    rows = codes.shape[0]
    br, padded, _ = _row_blocks(target, rows, (jnp.uint8, dtype))
    out = target.pallas_call(
        functools.partial(_dequantize_kernel, fmt=fmt),
        block_elements=br * BLOCK,
        grid=(padded // br,),
        in_specs=[_row_spec(br, BLOCK), _row_spec(br, 1)],
        out_specs=_row_spec(br, BLOCK),
        out_shape=platforms.out_struct((padded, BLOCK), dtype, codes),
    )(_pad(codes, padded), _pad(scales, padded))
    return out[:rows]


@functools.partial(jax.jit, static_argnames=("fmt", "interpret", "platform"))
def dequantize_accumulate_pallas(
    acc,
    weight,
    codes,
    scales,
    *,
    fmt: str,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
):
    """Pallas kernel: acc + weight * dequantize, in place on acc ([rows, 32] float32)."""
    weight = jnp.asarray(weight, jnp.float32).reshape(1, 1)
    body = functools.partial(_accumulate_call, fmt=check_format(fmt))
    if platform is None:
        return platforms.on_each_platform(body, acc, weight, codes, scales, interpret=interpret)
    return body(acc, weight, codes, scales, target=platforms.Target(platform, interpret))


def _accumulate_call(acc, weight, codes, scales, *, fmt, target):
    rows = codes.shape[0]
    br, padded, _ = _row_blocks(target, rows, (jnp.uint8, jnp.float32))
    out = target.pallas_call(
        functools.partial(_accumulate_kernel, fmt=fmt),
        block_elements=br * BLOCK,
        grid=(padded // br,),
        in_specs=[
            target.scalar_spec((1, 1)),
            _row_spec(br, BLOCK),
            _row_spec(br, BLOCK),
            _row_spec(br, 1),
        ],
        out_specs=_row_spec(br, BLOCK),
        out_shape=platforms.out_struct((padded, BLOCK), jnp.float32, acc),
        input_output_aliases={1: 0},
    )(weight, _pad(acc.astype(jnp.float32), padded), _pad(codes, padded), _pad(scales, padded))
    return out[:rows]


# ----------------------------------------------------------------------------
# Public ops on arrays of any shape, with `implementation=` dispatch.
#
# The flattened array is cut into MX blocks of 32, the last one possibly
# shorter. The GPU takes the flat array as it is (`mx_gpu`); elsewhere the
# kernels and the jnp path see it as [rows, 32], a ragged last block
# zero-padded, which changes no block's max |x| and whose codes are dropped.
# The packed ops carry the codes as `bitpack` bytes (two E2M1 codes a byte):
# the GPU packs and unpacks them in its one pass, elsewhere `bitpack` does.
# ----------------------------------------------------------------------------


def _as_blocks(x):
    flat = x.reshape(-1)
    rows = platforms.num_rows(flat.size, BLOCK)
    return jnp.pad(flat, (0, rows * BLOCK - flat.size)).reshape(rows, BLOCK)


def _from_blocks(x2d, shape):
    return x2d.reshape(-1)[: math.prod(shape)].reshape(shape)


def _quantize_on(x, seeds, *, fmt: ElementFormat, stochastic: bool, target):
    if mx_gpu.lowers(target, x.size):
        codes, scales = mx_gpu.quantize(
            x.reshape(-1), seeds, fmt=fmt.name, stochastic=stochastic, target=target
        )
        return codes.reshape(x.shape), scales
    x2d = _as_blocks(x)
    if not kernel_lowers(target, x2d.shape[0], x.dtype):
        codes, scales = _quantize_rows(x2d, seeds, 0, fmt=fmt, stochastic=stochastic)
    else:
        codes, scales = quantize_pallas(
            x2d,
            seeds,
            fmt=fmt.name,
            stochastic=stochastic,
            interpret=target.interpret,
            platform=target.platform,
        )
    return _from_blocks(codes, x.shape), scales.reshape(-1)


def _quantize_packed_on(x, seeds, *, fmt: ElementFormat, stochastic: bool, target):
    if mx_gpu.lowers(target, x.size):
        return mx_gpu.quantize(
            x.reshape(-1), seeds, fmt=fmt.name, stochastic=stochastic, target=target, pack=True
        )
    codes, scales = _quantize_on(x, seeds, fmt=fmt, stochastic=stochastic, target=target)
    return bitpack._pack_bits_on(codes.reshape(-1), bits=fmt.bits, target=target), scales


def _dequantize_on(codes, scales, *, fmt: ElementFormat, dtype, target):
    if mx_gpu.lowers(target, codes.size):
        out = mx_gpu.dequantize(
            codes.reshape(-1),
            scales.reshape(-1),
            fmt=fmt.name,
            size=codes.size,
            dtype=dtype,
            target=target,
        )
        return out.reshape(codes.shape)
    c2d, s2d = _as_blocks(codes), scales.reshape(-1, 1)
    if not kernel_lowers(target, c2d.shape[0], dtype):
        out = _dequantize_rows(c2d, s2d, fmt=fmt).astype(dtype)
    else:
        out = dequantize_pallas(
            c2d,
            s2d,
            fmt=fmt.name,
            dtype=dtype,
            interpret=target.interpret,
            platform=target.platform,
        )
    return _from_blocks(out, codes.shape)


def _check_packed(packed, shape, fmt: ElementFormat):
    expected = bitpack.packed_size(math.prod(shape), fmt.bits)
    if packed.shape != (expected,):
        raise ValueError(
            f"packed {fmt.name} codes of {math.prod(shape)} elements have shape ({expected},); "
            f"got {packed.shape}."
        )


def _dequantize_packed_on(packed, scales, *, fmt: ElementFormat, shape, dtype, target):
    _check_packed(packed, shape, fmt)
    size = math.prod(shape)
    if mx_gpu.lowers(target, size):
        out = mx_gpu.dequantize(
            packed,
            scales.reshape(-1),
            fmt=fmt.name,
            size=size,
            dtype=dtype,
            target=target,
            packed=True,
        )
        return out.reshape(shape)
    codes = bitpack._unpack_bits_on(packed, bits=fmt.bits, num_elements=size, target=target)
    return _dequantize_on(codes.reshape(shape), scales, fmt=fmt, dtype=dtype, target=target)


def _dequantize_accumulate_on(acc, weight, codes, scales, *, fmt: ElementFormat, target):
    if mx_gpu.lowers(target, codes.size):
        out = mx_gpu.dequantize_accumulate(
            acc.astype(jnp.float32).reshape(-1),
            weight,
            codes.reshape(-1),
            scales.reshape(-1),
            fmt=fmt.name,
            target=target,
        )
        return out.reshape(codes.shape)
    a2d, c2d, s2d = _as_blocks(acc.astype(jnp.float32)), _as_blocks(codes), scales.reshape(-1, 1)
    if not kernel_lowers(target, c2d.shape[0], jnp.float32):
        out = _accumulate_rows(a2d, weight.reshape(1, 1), c2d, s2d, fmt=fmt)
    else:
        out = dequantize_accumulate_pallas(
            a2d,
            weight,
            c2d,
            s2d,
            fmt=fmt.name,
            interpret=target.interpret,
            platform=target.platform,
        )
    return _from_blocks(out, codes.shape)


def _dequantize_accumulate_packed_on(acc, weight, packed, scales, *, fmt: ElementFormat, target):
    _check_packed(packed, acc.shape, fmt)
    if mx_gpu.lowers(target, acc.size):
        out = mx_gpu.dequantize_accumulate(
            acc.astype(jnp.float32).reshape(-1),
            weight,
            packed,
            scales.reshape(-1),
            fmt=fmt.name,
            target=target,
            packed=True,
        )
        return out.reshape(acc.shape)
    codes = bitpack._unpack_bits_on(packed, bits=fmt.bits, num_elements=acc.size, target=target)
    return _dequantize_accumulate_on(
        acc, weight, codes.reshape(acc.shape), scales, fmt=fmt, target=target
    )


def _seeds(seeds, stochastic: bool):
    if stochastic and seeds is None:
        raise ValueError("stochastic rounding needs seeds (see seeds_from_key).")
    return jnp.zeros((1, 2), jnp.uint32) if seeds is None else seeds


def quantize(x, seeds=None, *, fmt: str, stochastic: bool, implementation=None, interpret=False):
    """MX quantize of a float array of any shape, in blocks of 32 flattened elements.

    Args:
      x: float array (float32, bfloat16 or float16).
      seeds: uint32[1, 2] hash seeds (`seeds_from_key`); required when `stochastic`.
      fmt: "fp8" (E4M3) or "fp4" (E2M1).
      stochastic: stochastic rounding to the element grid; else nearest even.
      implementation, interpret: as in `minmax.quantize`.

    Returns:
      (uint8 codes in x's shape, one per element; uint8 E8M0 scales [ceil(size / 32)]).
    """
    body = functools.partial(_quantize_on, fmt=check_format(fmt), stochastic=stochastic)
    return platforms.dispatch(
        implementation, body, x, _seeds(seeds, stochastic), interpret=interpret
    )


def quantize_packed(
    x, seeds=None, *, fmt: str, stochastic: bool, implementation=None, interpret=False
):
    """`quantize` with the flattened codes as `bitpack.pack_bits` bytes, bit for bit.

    On GPU one kernel reads x once and writes the bytes (E2M1: two codes a byte)
    and the scales; elsewhere the codes are packed after the quantize.

    Returns:
      (uint8 codes [ceil(size * bits / 8)], uint8 E8M0 scales [ceil(size / 32)]).
    """
    body = functools.partial(_quantize_packed_on, fmt=check_format(fmt), stochastic=stochastic)
    return platforms.dispatch(
        implementation, body, x, _seeds(seeds, stochastic), interpret=interpret
    )


def dequantize(codes, scales, *, fmt: str, dtype=jnp.float32, implementation=None, interpret=False):
    """Values of MX codes (any shape) times their blocks' scales, cast to `dtype`."""
    body = functools.partial(_dequantize_on, fmt=check_format(fmt), dtype=jnp.dtype(dtype))
    return platforms.dispatch(implementation, body, codes, scales, interpret=interpret)


def dequantize_packed(
    packed, scales, *, fmt: str, shape, dtype=jnp.float32, implementation=None, interpret=False
):
    """`dequantize` of `quantize_packed`'s bytes, in `shape` (on GPU one kernel reads the bytes)."""
    body = functools.partial(
        _dequantize_packed_on, fmt=check_format(fmt), shape=tuple(shape), dtype=jnp.dtype(dtype)
    )
    return platforms.dispatch(implementation, body, packed, scales, interpret=interpret)


def dequantize_accumulate(
    acc, weight, codes, scales, *, fmt: str, implementation=None, interpret=False
):
    """acc + weight * dequantize(codes, scales) in float32, in the codes' shape."""
    weight = jnp.asarray(weight, jnp.float32)
    body = functools.partial(_dequantize_accumulate_on, fmt=check_format(fmt))
    return platforms.dispatch(implementation, body, acc, weight, codes, scales, interpret=interpret)


def dequantize_accumulate_packed(
    acc, weight, packed, scales, *, fmt: str, implementation=None, interpret=False
):
    """`dequantize_accumulate` of `quantize_packed`'s bytes of acc.size codes, in acc's shape."""
    weight = jnp.asarray(weight, jnp.float32)
    body = functools.partial(_dequantize_accumulate_packed_on, fmt=check_format(fmt))
    return platforms.dispatch(
        implementation, body, acc, weight, packed, scales, interpret=interpret
    )
