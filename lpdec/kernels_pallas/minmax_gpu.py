"""Min-max GPU (Triton) kernels on the flat array: any chunk length, any size, no padding.

Triton blocks need power-of-two extents, and a [rows, chunk] view of a ragged
array needs a padded copy. These kernels instead take the whole flat array and
address it themselves: a grid step covers `br` chunks as a [br, next_pow2(chunk)]
tile of element offsets row * chunk + col, with the columns past the chunk and
the elements past the array masked off (loads give the min/max identity there,
stores skip them). The arithmetic is `minmax_jnp`'s row functions', so the codes
and scales are the references' bit for bit.

Here: quantize (optionally bit-packing 1, 2 and 4 bits in the same pass),
dequantize, dequantize-accumulate, error feedback fused into the quantize, and
the two ways of running a tree's leaves in one launch (each leaf as its own
input, or a packed buffer with a row table: `minmax_tree`). `minmax` and
`minmax_feedback` dispatch to them when the program is lowered for a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import bitpack_jnp
from lpdec.kernels_pallas import minmax_jnp
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms

_INT32_MAX = jnp.iinfo(jnp.int32).max
_INT32_MIN = jnp.iinfo(jnp.int32).min


def lowers(size: int) -> bool:
    """Whether the flat GPU kernels take `size` elements: they need Triton and int32 offsets."""
    return platforms.pallas_triton is not None and size < 2**31


def _gpu_tile(target, size: int, chunk: int, block_rows: int | None):
    """(chunks per grid step, grid steps, tile width) of `size` elements in chunks of
    `chunk`: a step's tile is [chunks, width], width the power of two >= chunk."""
    width = 1 << max(chunk - 1, 0).bit_length()
    br, steps = _blocks.flat_grid(target, _blocks.num_rows(size, chunk), width, block_rows)
    return br, steps, width


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
    key = minmax_jnp.order_key(x)
    lo = minmax_jnp.from_order_key(
        jnp.min(jnp.where(valid, key, _INT32_MAX), axis=1, keepdims=True)
    )
    hi = minmax_jnp.from_order_key(
        jnp.max(jnp.where(valid, key, _INT32_MIN), axis=1, keepdims=True)
    )
    # minmax_jnp.row_scales' arithmetic, on the masked min and max.
    unit = (hi - lo) * jnp.float32(1.0 / numerics.levels(bits))
    inv_unit = 1.0 / jnp.where(unit > 0, unit, jnp.float32(jnp.inf))
    index = _draw_index(offsets, origin) if stochastic else None
    codes = minmax_jnp.element_codes(x, lo, inv_unit, seeds, index, bits=bits)
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
    out = minmax_jnp.dequantize_rows(codes, lo, unit).astype(out_ref.dtype)
    platforms.pallas_triton.store(out_ref.at[offsets], out, mask=valid)


def _gpu_accumulate_kernel(
    weight_ref, acc_ref, codes_ref, lo_ref, unit_ref, out_ref, *, size, chunk, br, width
):
    rows, offsets, valid = _gpu_offsets(br, width, chunk, size)
    lo, unit = _gpu_scales(lo_ref, unit_ref, rows)
    codes = platforms.pallas_triton.load(codes_ref.at[offsets], mask=valid, other=0)
    acc = platforms.pallas_triton.load(acc_ref.at[offsets], mask=valid, other=0)
    out = minmax_jnp.accumulate_rows(acc, weight_ref[0, 0], codes, lo, unit)
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
    error = v - minmax_jnp.dequantize_rows(codes, lo, unit)
    platforms.pallas_triton.store(out_residual_ref.at[offsets], error, mask=valid)


def _gpu_call(kernel, *, size, chunk, block_rows, target, **kwargs):
    br, steps, width = _gpu_tile(target, size, chunk, block_rows)
    return target.pallas_call(
        functools.partial(kernel, size=size, chunk=chunk, br=br, width=width),
        block_elements=br * width,
        grid=(steps,),
        **kwargs,
    )


def _codes_kernel(plain, packed, *, size: int, chunk: int, bits: int, pack: bool):
    """(kernel, length of its codes output): `plain`'s uint8 code per element, or with
    `pack` `packed`'s bit-packed bytes (`packs_in_pass` must hold)."""
    if not pack:
        return plain, size
    if not packs_in_pass(bits, chunk):
        raise ValueError(f"{bits}-bit codes of {chunk}-element chunks do not pack in one pass.")
    return packed, bitpack_jnp.packed_size(size, bits)


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
    `bitpack_jnp.pack_reference` of the codes bit for bit (`packs_in_pass` must hold).
    `leaf_rows`: `flat` holds many arrays, each padded to whole chunks
    (`minmax_tree`), and this uint32[rows * TREE_ROW_FIELDS] table gives each row
    its array's (first offset, end, seed0, seed1); `seeds` is then unused. Each
    row's codes and scales are those of quantizing its array alone.
    """
    size = flat.size
    rows = _blocks.num_rows(size, chunk)
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
        seeds, seeds_spec = leaf_rows, _blocks.whole(leaf_rows.size)
    return _gpu_call(
        kernel,
        size=size,
        chunk=chunk,
        block_rows=block_rows,
        target=target,
        in_specs=[seeds_spec, _blocks.whole(size)],
        out_specs=[_blocks.whole(codes), _blocks.whole(rows), _blocks.whole(rows)],
        out_shape=[
            _blocks.out_struct((codes,), jnp.uint8, flat),
            _blocks.out_struct((rows,), jnp.float32, flat),
            _blocks.out_struct((rows,), jnp.float32, flat),
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
    rows = _blocks.num_rows(size, chunk)
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
            _blocks.whole(size),
            _blocks.whole(size),
        ],
        out_specs=[
            _blocks.whole(codes),
            _blocks.whole(rows),
            _blocks.whole(rows),
            _blocks.whole(size),
        ],
        out_shape=[
            _blocks.out_struct((codes,), jnp.uint8, update),
            _blocks.out_struct((rows,), jnp.float32, update),
            _blocks.out_struct((rows,), jnp.float32, update),
            _blocks.out_struct((size,), jnp.float32, update),
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
    zero-padded last group of `bitpack_jnp.pack_reference` does. Returns (codes per
    view, lo, unit) for a caller that also decodes.
    """
    rows, byte, byte_valid, views = geometry
    keys = [(minmax_jnp.order_key(x), valid) for x, (_, valid) in zip(xs, views, strict=True)]
    lo_key = functools.reduce(
        jnp.minimum, [jnp.min(jnp.where(v, k, _INT32_MAX), axis=1, keepdims=True) for k, v in keys]
    )
    hi_key = functools.reduce(
        jnp.maximum, [jnp.max(jnp.where(v, k, _INT32_MIN), axis=1, keepdims=True) for k, v in keys]
    )
    lo, hi = minmax_jnp.from_order_key(lo_key), minmax_jnp.from_order_key(hi_key)
    # minmax_jnp.row_scales' arithmetic, on the masked min and max (as _gpu_quantize_tile).
    unit = (hi - lo) * jnp.float32(1.0 / numerics.levels(bits))
    inv_unit = 1.0 / jnp.where(unit > 0, unit, jnp.float32(jnp.inf))
    packed = jnp.zeros(byte.shape, jnp.int32)
    codes = []
    for j, (x, (offsets, valid)) in enumerate(zip(xs, views, strict=True)):
        index = _draw_index(offsets, origin) if stochastic else None
        c = minmax_jnp.element_codes(x, lo, inv_unit, seeds, index, bits=bits)
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
        error = v - minmax_jnp.dequantize_rows(c, lo, unit)
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
        br, steps, width = _gpu_tile(target, flat.size, chunk, None)
        plans.append((start, steps, flat.size, chunk, br, width))
        start += steps
    sizes = [
        (flat.size, _blocks.num_rows(flat.size, c)) for flat, c in zip(flats, chunks, strict=True)
    ]
    out_shape = (
        [_blocks.out_struct((d,), jnp.uint8, flats[0]) for d, _ in sizes]
        + [_blocks.out_struct((r,), jnp.float32, flats[0]) for _, r in sizes]
        + [_blocks.out_struct((r,), jnp.float32, flats[0]) for _, r in sizes]
    )
    outs = target.pallas_call(
        functools.partial(_gpu_leaves_kernel, plans=tuple(plans), bits=bits, stochastic=stochastic),
        block_elements=max(br * width for *_, br, width in plans),
        grid=(start,),
        in_specs=[_blocks.whole(seeds.shape)] + [_blocks.whole(f.size) for f in flats],
        out_specs=[_blocks.whole(o.shape[0]) for o in out_shape],
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
        in_specs=[_blocks.whole(size), _blocks.whole(rows), _blocks.whole(rows)],
        out_specs=_blocks.whole(size),
        out_shape=_blocks.out_struct((size,), dtype, codes),
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
            _blocks.whole(size),
            _blocks.whole(size),
            _blocks.whole(rows),
            _blocks.whole(rows),
        ],
        out_specs=_blocks.whole(size),
        out_shape=_blocks.out_struct((size,), jnp.float32, acc),
        input_output_aliases={1: 0},
    )(weight, acc, codes, lo, unit)
