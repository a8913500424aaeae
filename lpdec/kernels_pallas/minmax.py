"""Per-chunk min-max quantization: fused quantize, dequantize, dequantize-and-accumulate.

Layout: the input is viewed as [rows, chunk] with one (lo, unit) pair per row.
For each row (seeds 000, 001, 004; docs/DESIGN.md, "Quantizer semantics")::

    lo = min(x), hi = max(x), unit = (hi - lo) / (2**bits - 1)
    code = clip(round((x - lo) / unit), 0, 2**bits - 1)        # nearest
    code = clip(floor((x - lo) / unit + u), 0, 2**bits - 1)    # stochastic, u ~ U[0, 1)
    x_hat = lo + code * unit

A row with hi == lo has unit 0 and decodes exactly to lo. A row holding NaN or
Inf gets a non-finite lo or unit, so it decodes to non-finite values and
`scales_finite` flags it; its codes are 0.

The quantize kernel reads each block of x once: min, max and codes are computed
from the same block in registers/VMEM. The element-wise math is in
`_quantize_rows` / `_dequantize_rows`, called by both the references and the
kernels, so they agree bit for bit.

On CPU there is no kernel: XLA runs the same math as two passes over x, one
reduction producing each row's (min, max), then one element-wise loop producing
the codes; both are written for that (`_row_min_max`, `_codes_from_levels`).
The public ops (`quantize`, `dequantize`, `dequantize_accumulate`) take that
path there in the caller's layout (see the section that defines it for why).

Reading x once by quantizing cache-sized blocks of chunks in a loop (reduce a
block, then write its codes into the output with a dynamic-update-slice) was
measured slower on a 2-core x86 host (8-bit, float32, 2**18-element blocks):
9.0-12 ms against 6.5-7.7 ms for the two passes at 16M elements, 55-57 ms
against 52 ms at 64M. XLA CPU runs a loop body's operations one after another
and never splits an in-place dynamic-update-slice fusion across threads, so
the codes were computed on one thread, where the two whole-array passes each
use every core.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms


def _order_key(v):
    """float32 <-> int32 whose signed order is the IEEE total order of the floats.

    Non-negative floats keep their bit pattern; negative ones get their magnitude
    bits flipped, so larger magnitudes sort lower. The map is its own inverse.
    The order is total: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN.
    """
    i = jax.lax.bitcast_convert_type(v, jnp.int32)
    return i ^ ((i >> 31) & jnp.int32(0x7FFFFFFF))


def _from_order_key(k):
    return jax.lax.bitcast_convert_type(k ^ ((k >> 31) & jnp.int32(0x7FFFFFFF)), jnp.float32)


def _min_max_pair(a, b):
    return jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])


def _row_min_max(x, *, variadic: bool):
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
    key = _order_key(x)
    if variadic:
        init = (jnp.int32(jnp.iinfo(jnp.int32).max), jnp.int32(jnp.iinfo(jnp.int32).min))
        lo, hi = jax.lax.reduce((key, key), init, _min_max_pair, (1,))
        lo, hi = lo[:, None], hi[:, None]
    else:
        lo, hi = jnp.min(key, axis=1, keepdims=True), jnp.max(key, axis=1, keepdims=True)
    return _from_order_key(lo), _from_order_key(hi)


# Adding 2**23 to a float32 in [0, 2**23) leaves the nearest integer (ties to
# even, like jnp.round) in the low mantissa bits: the sum's spacing is exactly 1.
_MAGIC = 2.0**23


def _codes_from_levels(t, top: int):
    """float32 levels t -> uint8 codes clip(round(t), 0, top), with NaN -> 0.

    Each comparison clips one end in one select, and `t > 0` is False for NaN,
    so NaN becomes 0 on the way. Adding 2**23 then rounds to nearest even and
    leaves the integer in the low bits, read with a bitcast and a truncation.
    On XLA CPU this loop ran about twice as fast as jnp.round + jnp.clip + an
    isnan select + the saturating float->uint8 convert (which adds its own range
    checks), with identical codes: the bounds are integers, so clipping before
    or after rounding gives the same result.
    """
    top = jnp.float32(top)
    t = jnp.where(t > 0, t, jnp.float32(0))
    t = jnp.where(t < top, t, top)
    pattern = jax.lax.bitcast_convert_type(t + jnp.float32(_MAGIC), jnp.uint32)
    return pattern.astype(jnp.uint8)


def _row_scales(x, *, bits: int, variadic: bool):
    """[r, c] float32 -> (lo, unit, 1 / unit or 0), each float32 [r, 1]."""
    lo, hi = _row_min_max(x, variadic=variadic)
    # Multiply by a rounded reciprocal rather than divide by a constant: XLA rewrites
    # x / c as x * (1 / c) in some fusions and not others, which would change the last bit.
    unit = (hi - lo) * jnp.float32(1.0 / numerics.levels(bits))
    # 1 / unit, or 0 where unit is 0 or NaN. Written with the division last (1/inf = 0)
    # so XLA keeps it in its own small fusion: the element-wise loop then loads one
    # scale per row instead of recomputing unit and the select for every vector.
    inv_unit = 1.0 / jnp.where(unit > 0, unit, jnp.float32(jnp.inf))
    return lo, unit, inv_unit


def _codes(x, lo, inv_unit, seeds, index, *, bits: int):
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
    return _codes_from_levels(t, numerics.levels(bits))


def _quantize_rows(x, seeds, row0, *, bits: int, stochastic: bool, variadic: bool):
    """[r, c] float -> (uint8 codes [r, c], float32 lo [r, 1], float32 unit [r, 1])."""
    x = x.astype(jnp.float32)
    lo, unit, inv_unit = _row_scales(x, bits=bits, variadic=variadic)
    index = numerics.element_index(x.shape, row0, x.shape[1]) if stochastic else None
    return _codes(x, lo, inv_unit, seeds, index, bits=bits), lo, unit


def _dequantize_rows(codes, lo, unit):
    return lo + numerics.rounded(codes.astype(jnp.float32) * unit)


def _accumulate_rows(acc, weight, codes, lo, unit):
    return acc + numerics.rounded(weight * _dequantize_rows(codes, lo, unit))


# ----------------------------------------------------------------------------
# jnp references (the CPU implementation).
# ----------------------------------------------------------------------------


def quantize_reference(x2d, seeds, *, bits: int, stochastic: bool):
    """jnp reference of the fused quantize: see the module docstring."""
    return _quantize_rows(x2d, seeds, 0, bits=bits, stochastic=stochastic, variadic=True)


def dequantize_reference(codes, lo, unit, *, dtype=jnp.float32):
    """jnp reference: lo + codes * unit, cast to `dtype`."""
    return _dequantize_rows(codes, lo, unit).astype(dtype)


def dequantize_accumulate_reference(acc, weight, codes, lo, unit):
    """jnp reference: acc + weight * (lo + codes * unit), in float32."""
    return _accumulate_rows(acc, jnp.asarray(weight, jnp.float32).reshape(1, 1), codes, lo, unit)


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


def _spread(per_chunk, chunk: int, shape: tuple[int, ...]):
    """Per-chunk values -> one per element of `shape` (chunks of `chunk` row-major elements).

    Only the scales are broadcast and reshaped; the data keeps its own shape.
    """
    d = math.prod(shape)
    rows = per_chunk.size
    spread = jnp.broadcast_to(per_chunk.reshape(rows, 1), (rows, chunk)).reshape(-1)
    return spread[:d].reshape(shape)


def _chunk_scales(flat, chunk: int, *, bits: int):
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
    parts = [_row_scales(v.astype(jnp.float32), bits=bits, variadic=True) for v in views]
    if not parts:  # an empty array: no chunks
        return tuple(jnp.zeros((0, 1), jnp.float32) for _ in range(3))
    if len(parts) == 1:
        return parts[0]
    return tuple(jnp.concatenate(p, axis=0) for p in zip(*parts, strict=True))


def _quantize_elementwise(x, seeds, *, chunk: int, bits: int, stochastic: bool):
    """(codes in x's shape, lo, unit) with the scales spread over x's shape.

    Stochastic rounding draws element i's bits from its flat (row-major) index,
    as the [rows, chunk] kernels do.
    """
    lo, unit, inv_unit = _chunk_scales(x.reshape(-1), chunk, bits=bits)
    index = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape) if stochastic else None
    codes = _codes(
        x.astype(jnp.float32),
        _spread(lo, chunk, x.shape),
        _spread(inv_unit, chunk, x.shape),
        seeds,
        index,
        bits=bits,
    )
    return codes, lo, unit


# ----------------------------------------------------------------------------
# Pallas kernels.
# ----------------------------------------------------------------------------


def _quantize_kernel(
    seeds_ref, x_ref, codes_ref, lo_ref, unit_ref, *, bits, stochastic, rows, variadic
):
    row0 = pl.program_id(0) * rows
    # The seeds are passed as the ref: `_codes` reads seeds[0, 0] and seeds[0, 1] as
    # scalar loads (Triton cannot slice a loaded array).
    codes, lo, unit = _quantize_rows(
        x_ref[...], seeds_ref, row0, bits=bits, stochastic=stochastic, variadic=variadic
    )
    codes_ref[...] = codes
    lo_ref[...] = lo
    unit_ref[...] = unit


def _dequantize_kernel(codes_ref, lo_ref, unit_ref, out_ref):
    out_ref[...] = _dequantize_rows(codes_ref[...], lo_ref[...], unit_ref[...]).astype(
        out_ref.dtype
    )


def _accumulate_kernel(weight_ref, acc_ref, codes_ref, lo_ref, unit_ref, out_ref):
    out_ref[...] = _accumulate_rows(
        acc_ref[...], weight_ref[0, 0], codes_ref[...], lo_ref[...], unit_ref[...]
    )


def _row_blocks(target, rows: int, chunk: int, dtypes, block_rows: int | None = None):
    """(rows per block, padded rows, the row blocks) of a [rows, chunk] kernel.

    Each row block is a (block, array, dtype) triple for `Target.lowers`: a
    [br, chunk] block of every dtype in `dtypes` and the [br, 1] float32 scales.
    """
    br = block_rows or target.block_rows(rows, chunk, (*dtypes, jnp.float32))
    padded = platforms.num_rows(rows, br) * br
    blocks = [((br, chunk), (padded, chunk), d) for d in dtypes]
    blocks.append(((br, 1), (padded, 1), jnp.float32))
    return br, padded, blocks


def _row_spec(br, width):
    return pl.BlockSpec((br, width), lambda i: (i, 0))


def _gpu_lowers(target, size: int) -> bool:
    """The flat GPU kernels need Triton and int32 offsets."""
    return platforms.pallas_triton is not None and size < 2**31


def quantize_lowers(target, rows: int, chunk: int, dtype) -> bool:
    """Whether `target` runs the quantize kernel on a [rows, chunk] `dtype` array.

    False for the jnp path (`target` None), for no rows, and where the platform's
    compiler rejects the blocks. The GPU kernels address the flat array
    themselves (`gpu_quantize`): any chunk and size below 2**31 elements.
    """
    if target is None or not rows:
        return False
    if target.platform == "gpu":
        return _gpu_lowers(target, rows * chunk)
    return target.lowers(*_row_blocks(target, rows, chunk, (dtype, jnp.uint8))[2])


def dequantize_lowers(target, rows: int, chunk: int, dtype) -> bool:
    """Whether `target` runs the dequantize (-accumulate) kernel writing `dtype`."""
    if target is None or not rows:
        return False
    if target.platform == "gpu":
        return _gpu_lowers(target, rows * chunk)
    return target.lowers(*_row_blocks(target, rows, chunk, (jnp.uint8, dtype))[2])


@functools.partial(
    jax.jit, static_argnames=("bits", "stochastic", "block_rows", "interpret", "platform")
)
def quantize_pallas(
    x2d,
    seeds,
    *,
    bits: int,
    stochastic: bool,
    block_rows: int | None = None,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
):
    """Pallas kernel of the fused per-chunk quantize (one read of x per block).

    `platform` ("cpu", "gpu", "tpu") builds the kernel that platform compiles
    (`platforms.Target`); None takes the lowering platform's, interpreted on CPU.
    `interpret` interprets it: tests run each platform's kernel on CPU this way.
    """
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    body = functools.partial(
        _quantize_call, bits=bits, stochastic=stochastic, block_rows=block_rows
    )
    if platform is None:
        return platforms.on_each_platform(body, x2d, seeds, interpret=interpret)
    return body(x2d, seeds, target=platforms.Target(platform, interpret))


def _quantize_call(x2d, seeds, *, bits, stochastic, block_rows, target):
    rows, chunk = x2d.shape
    if target.platform == "gpu":
        codes, lo, unit = gpu_quantize(
            x2d.reshape(-1),
            seeds,
            chunk=chunk,
            bits=bits,
            stochastic=stochastic,
            target=target,
            block_rows=block_rows,
        )
        return codes.reshape(rows, chunk), lo[:, None], unit[:, None]
    br, padded, _ = _row_blocks(target, rows, chunk, (x2d.dtype, jnp.uint8), block_rows)
    # The CPU kernel reduces like the reference (one variadic reduce); Triton and
    # Mosaic know only reduce_min/reduce_max (same values, see _row_min_max).
    kernel = functools.partial(
        _quantize_kernel,
        bits=bits,
        stochastic=stochastic,
        rows=br,
        variadic=target.platform == "cpu",
    )
    codes, lo, unit = target.pallas_call(
        kernel,
        block_elements=br * chunk,
        grid=(padded // br,),
        in_specs=[target.scalar_spec((1, 2)), _row_spec(br, chunk)],
        out_specs=[_row_spec(br, chunk), _row_spec(br, 1), _row_spec(br, 1)],
        out_shape=[
            platforms.out_struct((padded, chunk), jnp.uint8, x2d),
            platforms.out_struct((padded, 1), jnp.float32, x2d),
            platforms.out_struct((padded, 1), jnp.float32, x2d),
        ],
    )(seeds, platforms.pad_rows(x2d, padded))
    return codes[:rows], lo[:rows], unit[:rows]


@functools.partial(jax.jit, static_argnames=("dtype", "block_rows", "interpret", "platform"))
def dequantize_pallas(
    codes,
    lo,
    unit,
    *,
    dtype=jnp.float32,
    block_rows=None,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
):
    """Pallas kernel: lo + codes * unit per row (`platform`, `interpret`: see quantize_pallas)."""
    body = functools.partial(_dequantize_call, dtype=jnp.dtype(dtype), block_rows=block_rows)
    if platform is None:
        return platforms.on_each_platform(body, codes, lo, unit, interpret=interpret)
    return body(codes, lo, unit, target=platforms.Target(platform, interpret))


def _dequantize_call(codes, lo, unit, *, dtype, block_rows, target):
    rows, chunk = codes.shape
    if target.platform == "gpu":
        out = gpu_dequantize(
            codes.reshape(-1),
            lo.reshape(-1),
            unit.reshape(-1),
            chunk=chunk,
            dtype=dtype,
            target=target,
            block_rows=block_rows,
        )
        return out.reshape(rows, chunk)
    br, padded, _ = _row_blocks(target, rows, chunk, (jnp.uint8, dtype), block_rows)
    out = target.pallas_call(
        _dequantize_kernel,
        block_elements=br * chunk,
        grid=(padded // br,),
        in_specs=[_row_spec(br, chunk), _row_spec(br, 1), _row_spec(br, 1)],
        out_specs=_row_spec(br, chunk),
        out_shape=platforms.out_struct((padded, chunk), dtype, codes),
    )(
        platforms.pad_rows(codes, padded),
        platforms.pad_rows(lo, padded),
        platforms.pad_rows(unit, padded),
    )
    return out[:rows]


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret", "platform"))
def dequantize_accumulate_pallas(
    acc,
    weight,
    codes,
    lo,
    unit,
    *,
    block_rows=None,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
):
    """Pallas kernel: acc + weight * (lo + codes * unit), accumulating in place.

    `platform`, `interpret`: see quantize_pallas.
    """
    weight = jnp.asarray(weight, jnp.float32).reshape(1, 1)
    body = functools.partial(_accumulate_call, block_rows=block_rows)
    if platform is None:
        return platforms.on_each_platform(body, acc, weight, codes, lo, unit, interpret=interpret)
    return body(acc, weight, codes, lo, unit, target=platforms.Target(platform, interpret))


def _accumulate_call(acc, weight, codes, lo, unit, *, block_rows, target):
    rows, chunk = codes.shape
    if target.platform == "gpu":
        out = gpu_dequantize_accumulate(
            acc.astype(jnp.float32).reshape(-1),
            weight,
            codes.reshape(-1),
            lo.reshape(-1),
            unit.reshape(-1),
            chunk=chunk,
            target=target,
            block_rows=block_rows,
        )
        return out.reshape(rows, chunk)
    br, padded, _ = _row_blocks(target, rows, chunk, (jnp.uint8, jnp.float32), block_rows)
    out = target.pallas_call(
        _accumulate_kernel,
        block_elements=br * chunk,
        grid=(padded // br,),
        in_specs=[
            target.scalar_spec((1, 1)),
            _row_spec(br, chunk),
            _row_spec(br, chunk),
            _row_spec(br, 1),
            _row_spec(br, 1),
        ],
        out_specs=_row_spec(br, chunk),
        out_shape=platforms.out_struct((padded, chunk), jnp.float32, acc),
        input_output_aliases={1: 0},
    )(
        weight,
        platforms.pad_rows(acc.astype(jnp.float32), padded),
        platforms.pad_rows(codes, padded),
        platforms.pad_rows(lo, padded),
        platforms.pad_rows(unit, padded),
    )
    return out[:rows]


# ----------------------------------------------------------------------------
# GPU (Triton) kernels on the flat array: any chunk length, any size, no padding.
#
# Triton blocks need power-of-two extents, and a [rows, chunk] view of a
# ragged array needs a padded copy. These kernels instead take the whole flat
# array and address it themselves: a grid step covers `br` chunks as a
# [br, next_pow2(chunk)] tile of element offsets row * chunk + col, with the
# columns past the chunk and the elements past the array masked off (loads
# give the min/max identity there, stores skip them). The arithmetic is the
# row functions', so the codes and scales are the references' bit for bit.
# ----------------------------------------------------------------------------

_INT32_MAX = jnp.iinfo(jnp.int32).max
_INT32_MIN = jnp.iinfo(jnp.int32).min


def _gpu_tile(size: int, chunk: int, block_rows: int | None):
    """(rows, rows per grid step, tile width) of `size` elements in chunks of `chunk`."""
    rows = platforms.num_rows(size, chunk)
    width = 1 << max(chunk - 1, 0).bit_length()
    br = block_rows or block_rows_for_gpu(rows, width)
    return rows, br, width


def block_rows_for_gpu(rows: int, width: int) -> int:
    """Chunks per GPU grid step: a power of two near 4096 / width (at least 1)."""
    return platforms.block_rows_for(rows, width, platforms.Target("gpu").block_elements)


def _gpu_offsets(br: int, width: int, chunk: int, size, step=None):
    """The grid step's (row indices [br], flat offsets [br, width], valid [br, width]).

    `size`: the array's length, or each row's end ([br, 1], a packed tree's rows:
    `_gpu_tree_kernel`). `step`: the step within this array's grid (default: the
    program id).
    """
    step = pl.program_id(0) if step is None else step
    row = step * br + jax.lax.broadcasted_iota(jnp.int32, (br, width), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (br, width), 1)
    offsets = row * chunk + col
    rows = step * br + jax.lax.broadcasted_iota(jnp.int32, (br,), 0)
    return rows, offsets, (col < chunk) & (offsets < size)


def _gpu_quantize_kernel(
    seeds_ref,
    x_ref,
    codes_ref,
    lo_ref,
    unit_ref,
    *,
    size,
    chunk,
    br,
    width,
    bits,
    stochastic,
    step=None,
    origin=None,
):
    rows, offsets, valid = _gpu_offsets(br, width, chunk, size, step)
    x = platforms.pallas_triton.load(x_ref.at[offsets], mask=valid, other=0).astype(jnp.float32)
    _gpu_quantize_tile(
        x, rows, offsets, valid, seeds_ref, codes_ref, lo_ref, unit_ref, bits, stochastic, origin
    )


def _draw_index(offsets, origin):
    """Each element's index in its own array, from which stochastic rounding draws.

    `origin`: None (the buffer is one array), or each row's array's first offset
    ([br, 1] uint32, a packed tree's rows: `_gpu_tree_kernel`).
    """
    index = offsets.astype(jnp.uint32)
    return index if origin is None else index - origin


def _gpu_quantize_tile(
    x, rows, offsets, valid, seeds, codes_ref, lo_ref, unit_ref, bits, stochastic, origin=None
):
    """Quantizes a loaded [br, width] float32 tile; stores its codes and scales.

    Returns (codes, lo, unit) for a caller that also decodes (error feedback).
    """
    key = _order_key(x)
    lo = _from_order_key(jnp.min(jnp.where(valid, key, _INT32_MAX), axis=1, keepdims=True))
    hi = _from_order_key(jnp.max(jnp.where(valid, key, _INT32_MIN), axis=1, keepdims=True))
    # _row_scales' arithmetic, on the masked min and max.
    unit = (hi - lo) * jnp.float32(1.0 / numerics.levels(bits))
    inv_unit = 1.0 / jnp.where(unit > 0, unit, jnp.float32(jnp.inf))
    index = _draw_index(offsets, origin) if stochastic else None
    codes = _codes(x, lo, inv_unit, seeds, index, bits=bits)
    platforms.pallas_triton.store(codes_ref.at[offsets], codes, mask=valid)
    in_rows = rows < lo_ref.shape[0]
    platforms.pallas_triton.store(lo_ref.at[rows], lo[:, 0], mask=in_rows)
    platforms.pallas_triton.store(unit_ref.at[rows], unit[:, 0], mask=in_rows)
    return codes, lo, unit


def _gpu_scales(lo_ref, unit_ref, rows):
    in_rows = rows < lo_ref.shape[0]
    lo = platforms.pallas_triton.load(lo_ref.at[rows], mask=in_rows, other=0)
    unit = platforms.pallas_triton.load(unit_ref.at[rows], mask=in_rows, other=0)
    return lo[:, None], unit[:, None]


def _gpu_dequantize_kernel(codes_ref, lo_ref, unit_ref, out_ref, *, size, chunk, br, width):
    rows, offsets, valid = _gpu_offsets(br, width, chunk, size)
    lo, unit = _gpu_scales(lo_ref, unit_ref, rows)
    codes = platforms.pallas_triton.load(codes_ref.at[offsets], mask=valid, other=0)
    out = _dequantize_rows(codes, lo, unit).astype(out_ref.dtype)
    platforms.pallas_triton.store(out_ref.at[offsets], out, mask=valid)


def _gpu_accumulate_kernel(
    weight_ref, acc_ref, codes_ref, lo_ref, unit_ref, out_ref, *, size, chunk, br, width
):
    rows, offsets, valid = _gpu_offsets(br, width, chunk, size)
    lo, unit = _gpu_scales(lo_ref, unit_ref, rows)
    codes = platforms.pallas_triton.load(codes_ref.at[offsets], mask=valid, other=0)
    acc = platforms.pallas_triton.load(acc_ref.at[offsets], mask=valid, other=0)
    out = _accumulate_rows(acc, weight_ref[0, 0], codes, lo, unit)
    platforms.pallas_triton.store(out_ref.at[offsets], out, mask=valid)


def _gpu_feedback_kernel(
    seeds_ref,
    decay_ref,
    update_ref,
    residual_ref,
    codes_ref,
    lo_ref,
    unit_ref,
    out_residual_ref,
    *,
    size,
    chunk,
    br,
    width,
    bits,
    stochastic,
):
    """One pass of error feedback: v = u + decay * e -> codes, scales and v - decode."""
    rows, offsets, valid = _gpu_offsets(br, width, chunk, size)
    update = platforms.pallas_triton.load(update_ref.at[offsets], mask=valid, other=0)
    residual = platforms.pallas_triton.load(residual_ref.at[offsets], mask=valid, other=0)
    v = numerics.feedback_sum(update, residual, decay_ref[0, 0])
    codes, lo, unit = _gpu_quantize_tile(
        v, rows, offsets, valid, seeds_ref, codes_ref, lo_ref, unit_ref, bits, stochastic
    )
    error = v - _dequantize_rows(codes, lo, unit)
    platforms.pallas_triton.store(out_residual_ref.at[offsets], error, mask=valid)


def _whole(n: int):
    """BlockSpec of a flat array every grid step addresses itself."""
    return pl.BlockSpec((n,), lambda i: (0,))


def _gpu_call(kernel, *, size, chunk, block_rows, target, **kwargs):
    rows, br, width = _gpu_tile(size, chunk, block_rows)
    return target.pallas_call(
        functools.partial(kernel, size=size, chunk=chunk, br=br, width=width),
        block_elements=br * width,
        grid=(platforms.num_rows(rows, br),),
        **kwargs,
    )


def _codes_kernel(plain, packed, *, size: int, chunk: int, bits: int, pack: bool):
    """(kernel, length of its codes output): `plain`'s uint8 code per element, or with
    `pack` `packed`'s bit-packed bytes (`packs_in_pass` must hold)."""
    if not pack:
        return plain, size
    if not packs_in_pass(bits, chunk):
        raise ValueError(f"{bits}-bit codes of {chunk}-element chunks do not pack in one pass.")
    return packed, bitpack.packed_size(size, bits)


def gpu_quantize(
    flat,
    seeds,
    *,
    chunk,
    bits,
    stochastic,
    target,
    block_rows=None,
    pack=False,
    leaf_rows=None,
):
    """GPU kernel: (codes [size], lo [rows], unit [rows]) of a flat float array.

    `pack`: the codes bit-packed in the same pass, [ceil(size * bits / 8)] bytes,
    `bitpack.pack_reference` of the codes bit for bit (`packs_in_pass` must hold).
    `leaf_rows`: `flat` holds many arrays, each padded to whole chunks
    (`minmax_tree`), and this uint32[rows * TREE_ROW_FIELDS] table gives each row
    its array's (first offset, end, seed0, seed1); `seeds` is then unused. Each
    row's codes and scales are those of quantizing its array alone.
    """
    size = flat.size
    rows = platforms.num_rows(size, chunk)
    kernel, codes = _codes_kernel(
        _gpu_quantize_kernel,
        _gpu_packed_quantize_kernel,
        size=size,
        chunk=chunk,
        bits=bits,
        pack=pack,
    )
    kernel = functools.partial(kernel, bits=bits, stochastic=stochastic)
    seeds_spec = target.scalar_spec((1, 2))
    if leaf_rows is not None:
        kernel = functools.partial(_gpu_tree_kernel, kernel=kernel)
        seeds, seeds_spec = leaf_rows, _whole(leaf_rows.size)
    return _gpu_call(
        kernel,
        size=size,
        chunk=chunk,
        block_rows=block_rows,
        target=target,
        in_specs=[seeds_spec, _whole(size)],
        out_specs=[_whole(codes), _whole(rows), _whole(rows)],
        out_shape=[
            platforms.out_struct((codes,), jnp.uint8, flat),
            platforms.out_struct((rows,), jnp.float32, flat),
            platforms.out_struct((rows,), jnp.float32, flat),
        ],
    )(seeds, flat)


def gpu_quantize_feedback(
    update,
    residual,
    decay,
    seeds,
    *,
    chunk,
    bits,
    stochastic,
    target,
    block_rows=None,
    pack=False,
):
    """GPU kernel: (codes, lo, unit, new residual) of v = update + decay * residual, flat.

    Reads the update and the residual once and writes the codes and the new
    residual v - decode(codes) in the same pass (the residual aliases in place).
    `pack`: the codes bit-packed in that pass too (as `gpu_quantize`'s).
    """
    size = update.size
    rows = platforms.num_rows(size, chunk)
    kernel, codes = _codes_kernel(
        _gpu_feedback_kernel,
        _gpu_packed_feedback_kernel,
        size=size,
        chunk=chunk,
        bits=bits,
        pack=pack,
    )
    return _gpu_call(
        functools.partial(kernel, bits=bits, stochastic=stochastic),
        size=size,
        chunk=chunk,
        block_rows=block_rows,
        target=target,
        in_specs=[
            target.scalar_spec((1, 2)),
            target.scalar_spec((1, 1)),
            _whole(size),
            _whole(size),
        ],
        out_specs=[_whole(codes), _whole(rows), _whole(rows), _whole(size)],
        out_shape=[
            platforms.out_struct((codes,), jnp.uint8, update),
            platforms.out_struct((rows,), jnp.float32, update),
            platforms.out_struct((rows,), jnp.float32, update),
            platforms.out_struct((size,), jnp.float32, update),
        ],
        input_output_aliases={3: 3},
    )(seeds, jnp.asarray(decay, jnp.float32).reshape(1, 1), update, residual)


def packs_in_pass(bits: int, chunk: int) -> bool:
    """Whether the GPU kernel can pack `bits`-bit codes as it quantizes: every byte's
    codes come from one chunk (`bits` divides 8 and 8 // bits divides the chunk)."""
    return bits < 8 and 8 % bits == 0 and chunk % (8 // bits) == 0


def _gpu_byte_views(br: int, width: int, chunk: int, size, per: int):
    """A packed tile's geometry: [br chunks, width // per bytes] of `per` codes each.

    Returns (rows [br], byte offsets [br, bw], bytes valid [br, bw], views): view j is
    (element offsets, valid) of every byte's element j, a strided view of the chunks.
    `size`: as `_gpu_offsets`'.
    """
    step = pl.program_id(0)
    bw = width // per
    row = step * br + jax.lax.broadcasted_iota(jnp.int32, (br, bw), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (br, bw), 1)
    rows = step * br + jax.lax.broadcasted_iota(jnp.int32, (br,), 0)
    first = row * chunk + col * per  # each byte's first element
    views = [(first + j, (col * per + j < chunk) & (first + j < size)) for j in range(per)]
    return rows, row * (chunk // per) + col, (col * per < chunk) & (first < size), views


def _gpu_pack_tile(
    xs, geometry, seeds, packed_ref, lo_ref, unit_ref, bits, stochastic, origin=None
):
    """Quantizes the loaded float32 views `xs` of a packed tile; stores bytes and scales.

    Byte b of a chunk holds the codes of its elements b * per + j at bits
    [j * bits, (j + 1) * bits) (`bitpack`'s little-endian stream). min and max run
    over every view; elements past the array (or the chunk) give code 0, as the
    zero-padded last group of `bitpack.pack_reference` does. Returns (codes per
    view, lo, unit) for a caller that also decodes.
    """
    rows, byte, byte_valid, views = geometry
    keys = [(_order_key(x), valid) for x, (_, valid) in zip(xs, views, strict=True)]
    lo_key = functools.reduce(
        jnp.minimum, [jnp.min(jnp.where(v, k, _INT32_MAX), axis=1, keepdims=True) for k, v in keys]
    )
    hi_key = functools.reduce(
        jnp.maximum, [jnp.max(jnp.where(v, k, _INT32_MIN), axis=1, keepdims=True) for k, v in keys]
    )
    lo, hi = _from_order_key(lo_key), _from_order_key(hi_key)
    # _row_scales' arithmetic, on the masked min and max (as _gpu_quantize_tile).
    unit = (hi - lo) * jnp.float32(1.0 / numerics.levels(bits))
    inv_unit = 1.0 / jnp.where(unit > 0, unit, jnp.float32(jnp.inf))
    packed = jnp.zeros(byte.shape, jnp.int32)
    codes = []
    for j, (x, (offsets, valid)) in enumerate(zip(xs, views, strict=True)):
        index = _draw_index(offsets, origin) if stochastic else None
        c = _codes(x, lo, inv_unit, seeds, index, bits=bits)
        codes.append(c)
        packed = packed | (jnp.where(valid, c.astype(jnp.int32), 0) << (bits * j))
    platforms.pallas_triton.store(packed_ref.at[byte], packed.astype(jnp.uint8), mask=byte_valid)
    in_rows = rows < lo_ref.shape[0]
    platforms.pallas_triton.store(lo_ref.at[rows], lo[:, 0], mask=in_rows)
    platforms.pallas_triton.store(unit_ref.at[rows], unit[:, 0], mask=in_rows)
    return codes, lo, unit


def _gpu_packed_quantize_kernel(
    seeds_ref,
    x_ref,
    packed_ref,
    lo_ref,
    unit_ref,
    *,
    size,
    chunk,
    br,
    width,
    bits,
    stochastic,
    origin=None,
):
    """Quantize and bit-pack in one pass (`_gpu_pack_tile`)."""
    geometry = _gpu_byte_views(br, width, chunk, size, 8 // bits)
    xs = [
        platforms.pallas_triton.load(x_ref.at[o], mask=v, other=0).astype(jnp.float32)
        for o, v in geometry[3]
    ]
    _gpu_pack_tile(xs, geometry, seeds_ref, packed_ref, lo_ref, unit_ref, bits, stochastic, origin)


# A packed tree's row table (`gpu_quantize`'s `leaf_rows`): per row, its leaf's
# first offset and end in the buffer and its leaf's two hash seeds, row-major.
TREE_ROW_FIELDS = 4


def _gpu_tree_kernel(table_ref, *refs, kernel, size, br, **params):
    """`kernel` on a tree's leaves packed into one buffer of whole chunks.

    Each row reads its leaf's entry of the row table: its elements stop at the
    leaf's end, and stochastic rounding draws with the leaf's seeds from the
    element's index within the leaf, so every row gets the codes and scales of
    encoding its leaf alone.
    """
    del size  # each row's end comes from the table
    n = table_ref.shape[0] // TREE_ROW_FIELDS
    rows = pl.program_id(0) * br + jax.lax.broadcasted_iota(jnp.int32, (br,), 0)
    start, end, seed0, seed1 = (
        platforms.pallas_triton.load(
            table_ref.at[rows * TREE_ROW_FIELDS + k], mask=rows < n, other=0
        )[:, None]
        for k in range(TREE_ROW_FIELDS)
    )
    kernel((seed0, seed1), *refs, size=end.astype(jnp.int32), br=br, origin=start, **params)


def _gpu_packed_feedback_kernel(
    seeds_ref,
    decay_ref,
    update_ref,
    residual_ref,
    packed_ref,
    lo_ref,
    unit_ref,
    out_residual_ref,
    *,
    size,
    chunk,
    br,
    width,
    bits,
    stochastic,
):
    """Error feedback packed in one pass: v = u + decay * e -> bytes, scales, v - decode."""
    geometry = _gpu_byte_views(br, width, chunk, size, 8 // bits)
    vs = []
    for offsets, valid in geometry[3]:  # every load before any store (the residual aliases)
        update = platforms.pallas_triton.load(update_ref.at[offsets], mask=valid, other=0)
        residual = platforms.pallas_triton.load(residual_ref.at[offsets], mask=valid, other=0)
        vs.append(numerics.feedback_sum(update, residual, decay_ref[0, 0]))
    codes, lo, unit = _gpu_pack_tile(
        vs, geometry, seeds_ref, packed_ref, lo_ref, unit_ref, bits, stochastic
    )
    for (offsets, valid), v, c in zip(geometry[3], vs, codes, strict=True):
        error = v - _dequantize_rows(c, lo, unit)
        platforms.pallas_triton.store(out_residual_ref.at[offsets], error, mask=valid)


def _gpu_leaves_kernel(seeds_ref, *refs, plans, bits, stochastic):
    """One launch for many arrays: grid steps [start, start + steps) belong to array i."""
    n = len(plans)
    x_refs, codes_refs, lo_refs, unit_refs = (refs[k * n : (k + 1) * n] for k in range(4))
    pid = pl.program_id(0)
    for i, (start, steps, size, chunk, br, width) in enumerate(plans):

        @pl.when((pid >= start) & (pid < start + steps))
        def _(i=i, start=start, size=size, chunk=chunk, br=br, width=width):
            _gpu_quantize_kernel(
                (seeds_ref[i, 0], seeds_ref[i, 1]),
                x_refs[i],
                codes_refs[i],
                lo_refs[i],
                unit_refs[i],
                size=size,
                chunk=chunk,
                br=br,
                width=width,
                bits=bits,
                stochastic=stochastic,
                step=pid - start,
            )


def gpu_quantize_leaves(flats, seeds, *, chunks, bits, stochastic, target):
    """GPU kernel: `gpu_quantize` of many flat arrays in one launch.

    A model's parameter tree has tens to hundreds of leaves; one launch each
    costs more than the encode of the small ones. Here each array keeps its own
    grid steps, chunks and outputs (the wire format does not change), and the
    grid runs them all.

    Args:
      flats: flat float arrays.
      seeds: uint32[len(flats), 2], each array's hash seeds.
      chunks: each array's chunk length.

    Returns:
      [(codes [size], lo [rows], unit [rows]) per array].
    """
    plans, start = [], 0
    for flat, chunk in zip(flats, chunks, strict=True):
        rows, br, width = _gpu_tile(flat.size, chunk, None)
        steps = platforms.num_rows(rows, br)
        plans.append((start, steps, flat.size, chunk, br, width))
        start += steps
    sizes = [
        (flat.size, platforms.num_rows(flat.size, c)) for flat, c in zip(flats, chunks, strict=True)
    ]
    out_shape = (
        [platforms.out_struct((d,), jnp.uint8, flats[0]) for d, _ in sizes]
        + [platforms.out_struct((r,), jnp.float32, flats[0]) for _, r in sizes]
        + [platforms.out_struct((r,), jnp.float32, flats[0]) for _, r in sizes]
    )
    outs = target.pallas_call(
        functools.partial(_gpu_leaves_kernel, plans=tuple(plans), bits=bits, stochastic=stochastic),
        block_elements=max(br * width for *_, br, width in plans),
        grid=(start,),
        in_specs=[pl.BlockSpec(seeds.shape, lambda i: (0, 0))] + [_whole(f.size) for f in flats],
        out_specs=[_whole(o.shape[0]) for o in out_shape],
        out_shape=out_shape,
    )(seeds, *flats)
    n = len(flats)
    return [(outs[i], outs[n + i], outs[2 * n + i]) for i in range(n)]


def gpu_dequantize(codes, lo, unit, *, chunk, dtype, target, block_rows=None):
    """GPU kernel: lo + codes * unit of flat codes, as flat `dtype`."""
    size, rows = codes.size, lo.size
    return _gpu_call(
        _gpu_dequantize_kernel,
        size=size,
        chunk=chunk,
        block_rows=block_rows,
        target=target,
        in_specs=[_whole(size), _whole(rows), _whole(rows)],
        out_specs=_whole(size),
        out_shape=platforms.out_struct((size,), dtype, codes),
    )(codes, lo, unit)


def gpu_dequantize_accumulate(acc, weight, codes, lo, unit, *, chunk, target, block_rows=None):
    """GPU kernel: acc + weight * (lo + codes * unit), flat float32, in place on acc."""
    size, rows = codes.size, lo.size
    return _gpu_call(
        _gpu_accumulate_kernel,
        size=size,
        chunk=chunk,
        block_rows=block_rows,
        target=target,
        in_specs=[
            target.scalar_spec((1, 1)),
            _whole(size),
            _whole(size),
            _whole(rows),
            _whole(rows),
        ],
        out_specs=_whole(size),
        out_shape=platforms.out_struct((size,), jnp.float32, acc),
        input_output_aliases={1: 0},
    )(weight, acc, codes, lo, unit)


# ----------------------------------------------------------------------------
# Public ops with `implementation=` dispatch (`platforms.dispatch`).
#
# They quantize an array of any shape in chunks of `chunk` consecutive
# (row-major) elements, the last one possibly shorter: the kernels see the
# chunks as the rows of a padded [rows, chunk] view, the jnp path keeps the
# caller's shape (see the CPU path above). Both give the bits of the references.
# ----------------------------------------------------------------------------


def _layout(size: int, chunk: int | None, shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, chunk) of `size` elements; chunk None: the last axis of `shape` is a chunk."""
    if chunk is None:
        chunk = shape[-1] if shape else 1
    chunk = max(1, chunk)
    return platforms.num_rows(size, chunk), chunk


def _as_rows(x, rows: int, chunk: int, mode: str):
    """x flattened and padded (numpy pad `mode`) to [rows, chunk]."""
    flat = x.reshape(-1)
    if rows * chunk != flat.size:
        flat = jnp.pad(flat, (0, rows * chunk - flat.size), mode=mode)
    return flat.reshape(rows, chunk)


def _from_rows(x2d, shape: tuple[int, ...]):
    return x2d.reshape(-1)[: math.prod(shape)].reshape(shape)


def _quantize_on(x, seeds, *, chunk, bits: int, stochastic: bool, target):
    """The quantize `target` runs: its kernel, or the jnp path (see quantize_lowers)."""
    rows, chunk = _layout(x.size, chunk, x.shape)
    if not quantize_lowers(target, rows, chunk, x.dtype):
        return _quantize_elementwise(x, seeds, chunk=chunk, bits=bits, stochastic=stochastic)
    if target.platform == "gpu":  # the flat array as it is: no padded copy
        codes, lo, unit = gpu_quantize(
            x.reshape(-1), seeds, chunk=chunk, bits=bits, stochastic=stochastic, target=target
        )
        return codes.reshape(x.shape), lo[:, None], unit[:, None]
    # Repeat the last element: a partial chunk's min and max are unchanged.
    codes, lo, unit = quantize_pallas(
        _as_rows(x, rows, chunk, "edge"),
        seeds,
        bits=bits,
        stochastic=stochastic,
        interpret=target.interpret,
        platform=target.platform,
    )
    return _from_rows(codes, x.shape), lo, unit


def _dequantize_on(codes, lo, unit, *, chunk, dtype, target):
    """The dequantize `target` runs: its kernel, or the jnp path."""
    rows, chunk = _layout(codes.size, chunk, codes.shape)
    if not dequantize_lowers(target, rows, chunk, dtype):
        return dequantize_reference(
            codes, _spread(lo, chunk, codes.shape), _spread(unit, chunk, codes.shape), dtype=dtype
        )
    if target.platform == "gpu":
        x = gpu_dequantize(
            codes.reshape(-1),
            lo.reshape(-1),
            unit.reshape(-1),
            chunk=chunk,
            dtype=dtype,
            target=target,
        )
        return x.reshape(codes.shape)
    x = dequantize_pallas(
        _as_rows(codes, rows, chunk, "constant"),
        lo.reshape(rows, 1),
        unit.reshape(rows, 1),
        dtype=dtype,
        interpret=target.interpret,
        platform=target.platform,
    )
    return _from_rows(x, codes.shape)


def _dequantize_accumulate_on(acc, weight, codes, lo, unit, *, chunk, target):
    """The dequantize-accumulate `target` runs: its kernel, or the jnp path."""
    rows, chunk = _layout(codes.size, chunk, codes.shape)
    acc = acc.astype(jnp.float32)
    if not dequantize_lowers(target, rows, chunk, jnp.float32):
        return _accumulate_rows(
            acc, weight, codes, _spread(lo, chunk, codes.shape), _spread(unit, chunk, codes.shape)
        )
    if target.platform == "gpu":
        out = gpu_dequantize_accumulate(
            acc.reshape(-1),
            weight.reshape(1, 1),
            codes.reshape(-1),
            lo.reshape(-1),
            unit.reshape(-1),
            chunk=chunk,
            target=target,
        )
        return out.reshape(codes.shape)
    out = dequantize_accumulate_pallas(
        _as_rows(acc, rows, chunk, "constant"),
        weight,
        _as_rows(codes, rows, chunk, "constant"),
        lo.reshape(rows, 1),
        unit.reshape(rows, 1),
        interpret=target.interpret,
        platform=target.platform,
    )
    return _from_rows(out, codes.shape)


def quantize(
    x,
    seeds=None,
    *,
    bits: int,
    stochastic: bool,
    chunk: int | None = None,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
):
    """Fused per-chunk min-max quantize of a float array.

    Args:
      x: float array (float32, bfloat16 or float16) of any shape.
      seeds: uint32[1, 2] hash seeds (`seeds_from_key`); required when `stochastic`.
      bits: code width, 1..8.
      stochastic: stochastic rounding from the counter-based hash; else nearest.
      chunk: elements per (lo, unit) pair: consecutive elements of the flattened
        x, the last chunk possibly shorter. None: x's last axis (the rows of a
        [rows, chunk] array).
      implementation: None (Pallas on GPU/TPU, jnp on CPU), "xla" or "pallas",
        chosen per lowering platform (`platforms.dispatch`).
      interpret: run the Pallas kernel in interpret mode.

    Returns:
      (codes uint8 in x's shape, lo float32 [rows, 1], unit float32 [rows, 1]),
      one (lo, unit) row per chunk.
    """
    if stochastic and seeds is None:
        raise ValueError("stochastic rounding needs seeds (see seeds_from_key).")
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    body = functools.partial(
        _quantize_on, chunk=chunk, bits=numerics.check_bits(bits), stochastic=stochastic
    )
    return platforms.dispatch(implementation, body, x, seeds, interpret=interpret)


def _quantize_packed_on(x, seeds, *, chunk, bits: int, stochastic: bool, target):
    """The quantize-and-pack `target` runs: one GPU pass where `packs_in_pass`, else
    `_quantize_on` and then `bitpack`'s packing."""
    rows, chunk = _layout(x.size, chunk, x.shape)
    if (
        target is not None
        and target.platform == "gpu"
        and quantize_lowers(target, rows, chunk, x.dtype)
        and packs_in_pass(bits, chunk)
    ):
        packed, lo, unit = gpu_quantize(
            x.reshape(-1),
            seeds,
            chunk=chunk,
            bits=bits,
            stochastic=stochastic,
            target=target,
            pack=True,
        )
        return packed, lo[:, None], unit[:, None]
    codes, lo, unit = _quantize_on(
        x, seeds, chunk=chunk, bits=bits, stochastic=stochastic, target=target
    )
    return bitpack._pack_bits_on(codes.reshape(-1), bits=bits, target=target), lo, unit


def quantize_packed(
    x,
    seeds=None,
    *,
    bits: int,
    stochastic: bool,
    chunk: int | None = None,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
):
    """`quantize` followed by `bitpack.pack_bits` of the flattened codes, bit for bit.

    On GPU, for widths that divide 8 (1, 2, 4) with chunks of whole bytes, one kernel
    reads x once and writes the packed bytes (no uint8 code array in between).

    Returns:
      (packed uint8 [ceil(x.size * bits / 8)], lo float32 [rows, 1], unit float32 [rows, 1]).
    """
    if stochastic and seeds is None:
        raise ValueError("stochastic rounding needs seeds (see seeds_from_key).")
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    body = functools.partial(
        _quantize_packed_on, chunk=chunk, bits=numerics.check_bits(bits), stochastic=stochastic
    )
    return platforms.dispatch(implementation, body, x, seeds, interpret=interpret)


def dequantize(
    codes, lo, unit, *, chunk=None, dtype=jnp.float32, implementation=None, interpret=False
):
    """lo + codes * unit per chunk, cast to `dtype`, in the codes' shape.

    `lo` and `unit` hold one value per chunk (any shape); `chunk` as in `quantize`.
    """
    body = functools.partial(_dequantize_on, chunk=chunk, dtype=jnp.dtype(dtype))
    return platforms.dispatch(implementation, body, codes, lo, unit, interpret=interpret)


def dequantize_accumulate(
    acc, weight, codes, lo, unit, *, chunk=None, implementation=None, interpret=False
):
    """acc + weight * (lo + codes * unit) in float32, in the codes' shape: the gossip inner loop.

    `acc` has the codes' shape; `lo`, `unit` and `chunk` as in `dequantize`.
    """
    weight = jnp.asarray(weight, jnp.float32)
    body = functools.partial(_dequantize_accumulate_on, chunk=chunk)
    return platforms.dispatch(
        implementation, body, acc, weight, codes, lo, unit, interpret=interpret
    )


def _quantize_feedback_on(update, residual, decay, seeds, *, chunk, bits, stochastic, target):
    """The error-feedback quantize `target` runs: the fused GPU kernel, or quantize + residual."""
    rows, chunk = _layout(update.size, chunk, update.shape)
    if (
        target is not None
        and target.platform == "gpu"
        and quantize_lowers(target, rows, chunk, jnp.float32)
    ):
        codes, lo, unit, error = gpu_quantize_feedback(
            update.reshape(-1),
            residual.astype(jnp.float32).reshape(-1),
            decay,
            seeds,
            chunk=chunk,
            bits=bits,
            stochastic=stochastic,
            target=target,
        )
        return codes.reshape(update.shape), lo[:, None], unit[:, None], error.reshape(update.shape)
    v = numerics.feedback_sum(update, residual, decay)
    codes, lo, unit = _quantize_on(
        v, seeds, chunk=chunk, bits=bits, stochastic=stochastic, target=target
    )
    decoded = _dequantize_on(codes, lo, unit, chunk=chunk, dtype=jnp.float32, target=target)
    return codes, lo, unit, v - decoded


def _quantize_feedback_packed_on(
    update, residual, decay, seeds, *, chunk, bits, stochastic, target
):
    """`_quantize_feedback_on` with the codes packed: one GPU pass where `packs_in_pass`."""
    rows, chunk = _layout(update.size, chunk, update.shape)
    if (
        target is not None
        and target.platform == "gpu"
        and quantize_lowers(target, rows, chunk, jnp.float32)
        and packs_in_pass(bits, chunk)
    ):
        packed, lo, unit, error = gpu_quantize_feedback(
            update.reshape(-1),
            residual.astype(jnp.float32).reshape(-1),
            decay,
            seeds,
            chunk=chunk,
            bits=bits,
            stochastic=stochastic,
            target=target,
            pack=True,
        )
        return packed, lo[:, None], unit[:, None], error.reshape(update.shape)
    codes, lo, unit, error = _quantize_feedback_on(
        update, residual, decay, seeds, chunk=chunk, bits=bits, stochastic=stochastic, target=target
    )
    packed = bitpack._pack_bits_on(codes.reshape(-1), bits=bits, target=target)
    return packed, lo, unit, error


def quantize_feedback_packed(
    update,
    residual,
    decay=1.0,
    seeds=None,
    *,
    bits: int,
    stochastic: bool,
    chunk: int | None = None,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
):
    """`quantize_feedback` with its codes bit-packed (`bitpack.pack_bits`), bit for bit.

    On GPU, for widths that divide 8 with chunks of whole bytes, one kernel reads the
    update and the residual once and writes the packed bytes and the new residual.

    Returns:
      (packed uint8 [ceil(size * bits / 8)], lo [rows, 1], unit [rows, 1], new residual).
    """
    if stochastic and seeds is None:
        raise ValueError("stochastic rounding needs seeds (see seeds_from_key).")
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    body = functools.partial(
        _quantize_feedback_packed_on,
        chunk=chunk,
        bits=numerics.check_bits(bits),
        stochastic=stochastic,
    )
    return platforms.dispatch(
        implementation,
        body,
        update,
        residual,
        jnp.asarray(decay, jnp.float32),
        seeds,
        interpret=interpret,
    )


def quantize_feedback(
    update,
    residual,
    decay=1.0,
    seeds=None,
    *,
    bits: int,
    stochastic: bool,
    chunk: int | None = None,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
):
    """Error feedback's quantize: v = update + decay * residual, its codes, and v - decode.

    The result is `quantize(numerics.feedback_sum(update, residual, decay))` and the new
    residual v - dequantize(...) in float32, bit for bit; on GPU one kernel reads
    each input once and writes the codes and the residual in the same pass.

    Returns:
      (codes in update's shape, lo [rows, 1], unit [rows, 1], new residual float32).
    """
    if stochastic and seeds is None:
        raise ValueError("stochastic rounding needs seeds (see seeds_from_key).")
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    body = functools.partial(
        _quantize_feedback_on, chunk=chunk, bits=numerics.check_bits(bits), stochastic=stochastic
    )
    return platforms.dispatch(
        implementation,
        body,
        update,
        residual,
        jnp.asarray(decay, jnp.float32),
        seeds,
        interpret=interpret,
    )


def _quantize_leaves_on(xs, seeds, *, chunks, bits: int, stochastic: bool, target):
    """`_quantize_on` of each array; on GPU the arrays the kernel takes share one launch."""
    out = [None] * len(xs)
    batched = []
    for i, (x, chunk) in enumerate(zip(xs, chunks, strict=True)):
        rows, chunk = _layout(x.size, chunk, x.shape)
        if (
            target is not None
            and target.platform == "gpu"
            and quantize_lowers(target, rows, chunk, x.dtype)
        ):
            batched.append((i, chunk))
        else:
            out[i] = _quantize_on(
                x, seeds[i : i + 1], chunk=chunk, bits=bits, stochastic=stochastic, target=target
            )
    if batched:
        index = [i for i, _ in batched]
        results = gpu_quantize_leaves(
            [xs[i].reshape(-1) for i in index],
            seeds[jnp.asarray(index)],
            chunks=[c for _, c in batched],
            bits=bits,
            stochastic=stochastic,
            target=target,
        )
        for i, (codes, lo, unit) in zip(index, results, strict=True):
            out[i] = (codes.reshape(xs[i].shape), lo[:, None], unit[:, None])
    return out


def quantize_leaves(
    xs,
    seeds,
    *,
    bits: int,
    stochastic: bool,
    chunks,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
):
    """`quantize` of many arrays (a model's leaves), one kernel launch for all on GPU.

    Args:
      xs: float arrays of any shapes.
      seeds: uint32[len(xs), 2]: row i is array i's hash seeds (zeros for nearest).
      chunks: each array's chunk length (as `quantize`'s `chunk`).

    Returns:
      [(codes, lo, unit) per array], each as `quantize` returns it, bit for bit.
    """
    body = functools.partial(
        _quantize_leaves_on,
        chunks=tuple(chunks),
        bits=numerics.check_bits(bits),
        stochastic=stochastic,
    )
    return platforms.dispatch(implementation, body, list(xs), seeds, interpret=interpret)
