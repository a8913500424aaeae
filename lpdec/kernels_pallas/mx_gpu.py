"""GPU (Triton) MX kernels on the flat array: any size, nothing padded, FP4 packed in the pass.

The row kernels of `mx` see a [rows, 32] view of the array, which for a size
that is not a whole number of grid steps (128 blocks of 32) costs a padded copy
in and a sliced copy out, and their FP4 codes take one byte each, packed two to
a byte by a second launch. These kernels take the flat arrays whole and address
them themselves: grid step s covers MX blocks [s * br, (s + 1) * br), its
elements at flat offsets block * 32 + column, loads and stores past the array
masked off (a masked load gives 0, which changes no block's max |x|, as the
zero padding of the row path does not either).

A byte holds `per` codes: 1 (one code per byte, as `mx.quantize` returns them;
E4M3 always) or 2 (E2M1 packed, `bitpack`'s little-endian stream: element j of
byte b is element 2b + j, at bits [4j, 4j + 4)). The tile is then [br, 32 / per]
bytes, and element j of every byte is loaded (or stored) as its own strided
view; the quantize ORs the views' codes into the bytes, the decodes shift them
out. The arithmetic is `mx_jnp`'s (`quantize_views`,
`dequantize_rows`, `accumulate_rows`), so the bytes are those of the
references bit for bit, and stochastic rounding draws from each element's flat
index as the row path does. `mx` dispatches to these kernels when a program is
lowered for a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import mx_jnp
from lpdec.kernels_pallas import platforms

# Flat offsets are int32: a grid step's tile reaches at most one step past the array.
_MAX_SIZE = 2**31 - platforms.Target("gpu").block_elements


def lowers(target, size: int) -> bool:
    """Whether `target` runs these kernels on `size` elements: a GPU target with
    Pallas Triton, and 0 < size below int32 offsets' reach."""
    return (
        target is not None
        and target.platform == "gpu"
        and platforms.pallas_triton is not None
        and 0 < size < _MAX_SIZE
    )


def codes_per_byte(fmt: mx_jnp.ElementFormat, pack: bool) -> int:
    """Codes per byte: 8 // bits when packing (2 for E2M1, 1 for E4M3), else 1."""
    return 8 // fmt.bits if pack else 1


def _tile(br: int, size: int, per: int):
    """The grid step's (blocks [br], byte offsets [br, w], bytes valid [br, w], views).

    w = 32 // per bytes per block; view j is (flat offsets, valid) of every byte's
    element j, [br, w] each.
    """
    step = pl.program_id(0)
    width = mx_jnp.BLOCK // per
    block = step * br + jax.lax.broadcasted_iota(jnp.int32, (br, width), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (br, width), 1)
    first = block * mx_jnp.BLOCK + col * per  # each byte's first element
    views = [(first + j, first + j < size) for j in range(per)]
    blocks = step * br + jax.lax.broadcasted_iota(jnp.int32, (br,), 0)
    return blocks, block * width + col, first < size, views


def _load(ref, offsets, valid):
    return platforms.pallas_triton.load(ref.at[offsets], mask=valid, other=0)


def _store(ref, offsets, value, valid):
    platforms.pallas_triton.store(ref.at[offsets], value, mask=valid)


def _quantize_kernel(seeds_ref, x_ref, codes_ref, scales_ref, *, size, br, per, fmt, stochastic):
    blocks, byte, byte_valid, views = _tile(br, size, per)
    xs = [_load(x_ref, offsets, valid) for offsets, valid in views]
    indices = [offsets.astype(jnp.uint32) if stochastic else None for offsets, _ in views]
    codes, scales = mx_jnp.quantize_views(xs, indices, seeds_ref, fmt=fmt)
    if per == 1:
        packed = codes[0]
    else:  # past the array a byte's high codes are 0, as bitpack's zero-padded stream
        packed = functools.reduce(
            jnp.bitwise_or,
            [
                jnp.where(valid, c.astype(jnp.int32), 0) << (fmt.bits * j)
                for j, (c, (_, valid)) in enumerate(zip(codes, views, strict=True))
            ],
        ).astype(jnp.uint8)
    _store(codes_ref, byte, packed, byte_valid)
    _store(scales_ref, blocks, scales[:, 0], blocks < scales_ref.shape[0])


def _tile_codes(codes_ref, scales_ref, *, size, br, per, fmt):
    """(views, codes per view [br, w] int32, scales [br, 1]) of a decode's grid step."""
    blocks, byte, byte_valid, views = _tile(br, size, per)
    scales = _load(scales_ref, blocks, blocks < scales_ref.shape[0])[:, None]
    packed = _load(codes_ref, byte, byte_valid).astype(jnp.int32)
    mask = (1 << fmt.bits) - 1
    return views, [(packed >> (fmt.bits * j)) & mask for j in range(per)], scales


def _dequantize_kernel(codes_ref, scales_ref, out_ref, *, size, br, per, fmt):
    views, codes, scales = _tile_codes(codes_ref, scales_ref, size=size, br=br, per=per, fmt=fmt)
    for (offsets, valid), c in zip(views, codes, strict=True):
        out = mx_jnp.dequantize_rows(c, scales, fmt=fmt).astype(out_ref.dtype)
        _store(out_ref, offsets, out, valid)


def _accumulate_kernel(weight_ref, acc_ref, codes_ref, scales_ref, out_ref, *, size, br, per, fmt):
    views, codes, scales = _tile_codes(codes_ref, scales_ref, size=size, br=br, per=per, fmt=fmt)
    for (offsets, valid), c in zip(views, codes, strict=True):
        acc = _load(acc_ref, offsets, valid)  # each element is read, then written, by one view
        out = mx_jnp.accumulate_rows(acc, weight_ref[0, 0], c, scales, fmt=fmt)
        _store(out_ref, offsets, out, valid)


def _call(kernel, *, size: int, per: int, fmt, target, block_rows, **kwargs):
    """`target.pallas_call` of `kernel` over `size` elements' MX blocks, `br` per grid step."""
    blocks = _blocks.num_rows(size, mx_jnp.BLOCK)
    br, steps = _blocks.flat_grid(target, blocks, mx_jnp.BLOCK, block_rows)
    return target.pallas_call(
        functools.partial(kernel, size=size, br=br, per=per, fmt=fmt),
        block_elements=br * mx_jnp.BLOCK,
        grid=(steps,),
        **kwargs,
    )


def quantize(flat, seeds, *, fmt: str, stochastic: bool, target, pack=False, block_rows=None):
    """GPU kernel: (codes, uint8 E8M0 scales [ceil(size / 32)]) of a flat float array.

    codes: uint8 [size], one per element; with `pack`, [ceil(size * bits / 8)]
    bytes, `bitpack.pack_reference` of those codes bit for bit (E4M3 codes are
    their own bytes). `seeds`: uint32 [1, 2]. `block_rows`: MX blocks per grid step
    (default: about `target.block_elements` elements).
    """
    element = mx_jnp.check_format(fmt)
    size, per = flat.size, codes_per_byte(element, pack)
    return _call(
        functools.partial(_quantize_kernel, stochastic=stochastic),
        size=size,
        per=per,
        fmt=element,
        target=target,
        block_rows=block_rows,
        in_specs=[target.scalar_spec((1, 2)), _blocks.whole(size)],
        out_specs=[
            _blocks.whole(-(-size // per)),
            _blocks.whole(_blocks.num_rows(size, mx_jnp.BLOCK)),
        ],
        out_shape=[
            _blocks.out_struct((-(-size // per),), jnp.uint8, flat),
            _blocks.out_struct((_blocks.num_rows(size, mx_jnp.BLOCK),), jnp.uint8, flat),
        ],
    )(seeds, flat)


def dequantize(codes, scales, *, fmt: str, size: int, dtype, target, packed=False, block_rows=None):
    """GPU kernel: the `size` values of flat codes (bytes, with `packed`) times their
    blocks' scales, as flat `dtype`."""
    element = mx_jnp.check_format(fmt)
    per = codes_per_byte(element, packed)
    return _call(
        _dequantize_kernel,
        size=size,
        per=per,
        fmt=element,
        target=target,
        block_rows=block_rows,
        in_specs=[_blocks.whole(codes.size), _blocks.whole(scales.size)],
        out_specs=_blocks.whole(size),
        out_shape=_blocks.out_struct((size,), jnp.dtype(dtype), codes),
    )(codes, scales)


def dequantize_accumulate(
    acc, weight, codes, scales, *, fmt: str, target, packed=False, block_rows=None
):
    """GPU kernel: flat float32 acc + weight * dequantize, in place on acc."""
    element = mx_jnp.check_format(fmt)
    size, per = acc.size, codes_per_byte(element, packed)
    return _call(
        _accumulate_kernel,
        size=size,
        per=per,
        fmt=element,
        target=target,
        block_rows=block_rows,
        in_specs=[
            target.scalar_spec((1, 1)),
            _blocks.whole(size),
            _blocks.whole(codes.size),
            _blocks.whole(scales.size),
        ],
        out_specs=_blocks.whole(size),
        out_shape=_blocks.out_struct((size,), jnp.float32, acc),
        input_output_aliases={1: 0},
    )(jnp.asarray(weight, jnp.float32).reshape(1, 1), acc, codes, scales)
