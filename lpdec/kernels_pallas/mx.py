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

The modules: this one holds the public ops, each choosing per lowering platform
(the GPU's kernels where `mx_gpu.lowers`, else the row kernels or jnp), and the
[rows, 32] row kernels (TPU, and any platform interpreted); `mx_gpu` the GPU's
flat kernels; `mx_jnp` the formats, the shared arithmetic and the references.

Package-internal (not in `__all__`; for the tests): `quantize_on`,
`quantize_packed_on`, `dequantize_on`, `dequantize_packed_on`,
`dequantize_accumulate_on` and `dequantize_accumulate_packed_on`, each op for
one `platforms.Target` (None: the jnp path), which the public ops run under
`platforms.dispatch`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import mx_gpu
from lpdec.kernels_pallas import mx_jnp
from lpdec.kernels_pallas import platforms
from lpdec.kernels_pallas.mx_jnp import BLOCK
from lpdec.kernels_pallas.mx_jnp import FORMATS
from lpdec.kernels_pallas.mx_jnp import NAN_SCALE
from lpdec.kernels_pallas.mx_jnp import ElementFormat
from lpdec.kernels_pallas.mx_jnp import check_format
from lpdec.kernels_pallas.mx_jnp import dequantize_accumulate_reference
from lpdec.kernels_pallas.mx_jnp import dequantize_reference
from lpdec.kernels_pallas.mx_jnp import quantize_reference

__all__ = [
    "BLOCK",
    "FORMATS",
    "NAN_SCALE",
    "ElementFormat",
    "check_format",
    "dequantize",
    "dequantize_accumulate",
    "dequantize_accumulate_packed",
    "dequantize_accumulate_pallas",
    "dequantize_accumulate_reference",
    "dequantize_packed",
    "dequantize_pallas",
    "dequantize_reference",
    "kernel_lowers",
    "quantize",
    "quantize_packed",
    "quantize_pallas",
    "quantize_reference",
]

# ----------------------------------------------------------------------------
# Pallas kernels: a block of whole MX blocks (rows) per grid step.
# ----------------------------------------------------------------------------


def _quantize_kernel(seeds_ref, x_ref, codes_ref, scales_ref, *, fmt, stochastic):
    row0 = pl.program_id(0) * x_ref.shape[0]
    codes, scales = mx_jnp.quantize_rows(
        x_ref[...], seeds_ref, row0, fmt=fmt, stochastic=stochastic
    )
    codes_ref[...] = codes
    scales_ref[...] = scales


def _dequantize_kernel(codes_ref, scales_ref, out_ref, *, fmt):
    out_ref[...] = mx_jnp.dequantize_rows(codes_ref[...], scales_ref[...], fmt=fmt).astype(
        out_ref.dtype
    )


def _accumulate_kernel(weight_ref, acc_ref, codes_ref, scales_ref, out_ref, *, fmt):
    out_ref[...] = mx_jnp.accumulate_rows(
        acc_ref[...], weight_ref[0, 0], codes_ref[...], scales_ref[...], fmt=fmt
    )


def kernel_lowers(target, rows: int, dtype) -> bool:
    """Whether `target` runs the MX kernels on [rows, 32] blocks of `dtype` (and uint8 codes).

    Every block is [power of two, 32] or [power of two, 1], so Triton takes any
    row count; TPU takes it too (32 is the array's whole last dim).
    """
    operands = [(BLOCK, dtype), (BLOCK, jnp.uint8), (1, jnp.uint8)]
    return _blocks.row_lowers(target, rows, operands)


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
    return tuple(
        _blocks.row_call(
            functools.partial(_quantize_kernel, fmt=fmt, stochastic=stochastic),
            target,
            scalars=[seeds],
            inputs=[x2d],
            outputs=[(BLOCK, jnp.uint8), (1, jnp.uint8)],
        )
    )


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
    (out,) = _blocks.row_call(
        functools.partial(_dequantize_kernel, fmt=fmt),
        target,
        inputs=[codes, scales],
        outputs=[(BLOCK, dtype)],
    )
    return out


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
    (out,) = _blocks.row_call(
        functools.partial(_accumulate_kernel, fmt=fmt),
        target,
        scalars=[weight],
        inputs=[acc.astype(jnp.float32), codes, scales],
        outputs=[(BLOCK, jnp.float32)],
        input_output_aliases={1: 0},
    )
    return out


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
    rows = _blocks.num_rows(flat.size, BLOCK)
    return jnp.pad(flat, (0, rows * BLOCK - flat.size)).reshape(rows, BLOCK)


def _from_blocks(x2d, shape):
    return x2d.reshape(-1)[: math.prod(shape)].reshape(shape)


def quantize_on(x, seeds, *, fmt: ElementFormat, stochastic: bool, target):
    if mx_gpu.lowers(target, x.size):
        codes, scales = mx_gpu.quantize(
            x.reshape(-1), seeds, fmt=fmt.name, stochastic=stochastic, target=target
        )
        return codes.reshape(x.shape), scales
    x2d = _as_blocks(x)
    if not kernel_lowers(target, x2d.shape[0], x.dtype):
        codes, scales = mx_jnp.quantize_rows(x2d, seeds, 0, fmt=fmt, stochastic=stochastic)
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


def quantize_packed_on(x, seeds, *, fmt: ElementFormat, stochastic: bool, target):
    if mx_gpu.lowers(target, x.size):
        return mx_gpu.quantize(
            x.reshape(-1), seeds, fmt=fmt.name, stochastic=stochastic, target=target, pack=True
        )
    codes, scales = quantize_on(x, seeds, fmt=fmt, stochastic=stochastic, target=target)
    return bitpack.pack_bits_on(codes.reshape(-1), bits=fmt.bits, target=target), scales


def dequantize_on(codes, scales, *, fmt: ElementFormat, dtype, target):
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
        out = mx_jnp.dequantize_rows(c2d, s2d, fmt=fmt).astype(dtype)
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


def dequantize_packed_on(packed, scales, *, fmt: ElementFormat, shape, dtype, target):
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
    codes = bitpack.unpack_bits_on(packed, bits=fmt.bits, num_elements=size, target=target)
    return dequantize_on(codes.reshape(shape), scales, fmt=fmt, dtype=dtype, target=target)


def dequantize_accumulate_on(acc, weight, codes, scales, *, fmt: ElementFormat, target):
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
        out = mx_jnp.accumulate_rows(a2d, weight.reshape(1, 1), c2d, s2d, fmt=fmt)
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


def dequantize_accumulate_packed_on(acc, weight, packed, scales, *, fmt: ElementFormat, target):
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
    codes = bitpack.unpack_bits_on(packed, bits=fmt.bits, num_elements=acc.size, target=target)
    return dequantize_accumulate_on(
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
    body = functools.partial(quantize_on, fmt=check_format(fmt), stochastic=stochastic)
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
    body = functools.partial(quantize_packed_on, fmt=check_format(fmt), stochastic=stochastic)
    return platforms.dispatch(
        implementation, body, x, _seeds(seeds, stochastic), interpret=interpret
    )


def dequantize(codes, scales, *, fmt: str, dtype=jnp.float32, implementation=None, interpret=False):
    """Values of MX codes (any shape) times their blocks' scales, cast to `dtype`."""
    body = functools.partial(dequantize_on, fmt=check_format(fmt), dtype=jnp.dtype(dtype))
    return platforms.dispatch(implementation, body, codes, scales, interpret=interpret)


def dequantize_packed(
    packed, scales, *, fmt: str, shape, dtype=jnp.float32, implementation=None, interpret=False
):
    """`dequantize` of `quantize_packed`'s bytes, in `shape` (on GPU one kernel reads the bytes)."""
    body = functools.partial(
        dequantize_packed_on, fmt=check_format(fmt), shape=tuple(shape), dtype=jnp.dtype(dtype)
    )
    return platforms.dispatch(implementation, body, packed, scales, interpret=interpret)


def dequantize_accumulate(
    acc, weight, codes, scales, *, fmt: str, implementation=None, interpret=False
):
    """acc + weight * dequantize(codes, scales) in float32, in the codes' shape."""
    weight = jnp.asarray(weight, jnp.float32)
    body = functools.partial(dequantize_accumulate_on, fmt=check_format(fmt))
    return platforms.dispatch(implementation, body, acc, weight, codes, scales, interpret=interpret)


def dequantize_accumulate_packed(
    acc, weight, packed, scales, *, fmt: str, implementation=None, interpret=False
):
    """`dequantize_accumulate` of `quantize_packed`'s bytes of acc.size codes, in acc's shape."""
    weight = jnp.asarray(weight, jnp.float32)
    body = functools.partial(dequantize_accumulate_packed_on, fmt=check_format(fmt))
    return platforms.dispatch(
        implementation, body, acc, weight, packed, scales, interpret=interpret
    )
