"""Min-max encode of a model's leaves in one GPU launch: each leaf as its own input, or packed.

`quantize_leaves` (at the end of this module) runs many arrays in one GPU launch that takes each as
its own input, one branch per array; on an H100 that launch was slower than
one launch per leaf, and took minutes to compile for hundreds of leaves
(BENCHMARKS.md, GPU section). Concatenating the leaves and encoding the flat
array once was 7x faster, but its chunks straddle leaves, so its bytes are not
the leaves' payloads. The packed layout here keeps the payloads and the single
flat launch::

    buffer = [leaf 0, padded to whole chunks | leaf 1, padded | ...]

Every leaf starts on a chunk boundary, so no chunk holds two leaves. One
`minmax_gpu.gpu_quantize` runs over the buffer with a row table (`leaf_rows`)
giving each chunk its leaf's first offset, end and hash seeds: a row stops at
its leaf's end (the padding is never read into a min or max) and draws
stochastic rounding's bits from (its leaf's seeds, the element's index within
its leaf), as encoding the leaf alone does. Each leaf's payload is then a
slice of the outputs: its chunks' scales, and its codes, which start on a
byte boundary when the chunk's codes fill whole bytes (always for the widths
that pack in the kernel's pass). Leaves of other dtypes go in a buffer of their
own (one launch per dtype), so a bfloat16 model is read at 2 bytes per element.

A leaf smaller than `chunk` is one chunk of its own size (`lpdec.minmax`'s
layout) and takes a whole row of the buffer: the padding is at most one chunk
per leaf (0.5M elements for 243 leaves at 2048; about 0.2% of a 300M-parameter
model).

Only the GPU runs this layout; on CPU and TPU `quantize_tree_packed` encodes
leaf by leaf (`minmax.quantize_packed`), which is also its reference. Whether
it replaces `quantize_leaves` as the GPU default for `encode_tree` waits for
the next GPU measurement (`bench/gpu_kernels.py`, trees).

Package-internal (not in `__all__`; for the tests): `quantize_leaves_on` and
`quantize_tree_packed_on`, the ops for one `platforms.Target` (None: the jnp
path), which the public ops run under `platforms.dispatch`, and
`packed_buffers`, how the packed layout groups the arrays into buffers.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import minmax
from lpdec.kernels_pallas import minmax_gpu
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms

__all__ = ["leaf_chunk", "quantize_leaves", "quantize_tree_packed"]


def leaf_chunk(size: int, chunk: int) -> int:
    """The chunk of an array of `size` elements: `chunk`, or the whole array if smaller."""
    return max(1, min(chunk, size))


def _row_table(sizes, first_rows, rows, seeds, chunk: int):
    """uint32[total rows * TREE_ROW_FIELDS]: each row's (leaf start, leaf end, seed0, seed1).

    Built from one small row per leaf, broadcast over its rows (no constant of
    the buffer's row count in the program).
    """
    starts = np.asarray(first_rows, np.uint32) * np.uint32(chunk)
    bounds = jnp.asarray(np.stack([starts, starts + np.asarray(sizes, np.uint32)], axis=1))
    per_leaf = jnp.concatenate([bounds, seeds.astype(jnp.uint32)], axis=1)
    table = jnp.concatenate(
        [jnp.broadcast_to(per_leaf[i], (r, minmax_gpu.TREE_ROW_FIELDS)) for i, r in enumerate(rows)]
    )
    return table.reshape(-1)


def _gpu_quantize_packed_tree(xs, seeds, *, chunk: int, bits: int, stochastic: bool, target):
    """The GPU's packed-tree encode of non-empty arrays of one dtype: see the module docstring.

    Returns [(packed codes, lo [rows, 1], unit [rows, 1]) per array].
    """
    sizes = [x.size for x in xs]
    rows = [_blocks.num_rows(d, chunk) for d in sizes]
    first_rows = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(int)
    buffer = jnp.concatenate(
        [
            jnp.pad(x.reshape(-1), (0, r * chunk - d))
            for x, r, d in zip(xs, rows, sizes, strict=True)
        ]
    )
    pack = minmax_gpu.packs_in_pass(bits, chunk)
    codes, lo, unit = minmax_gpu.gpu_quantize(
        buffer,
        None,
        chunk=chunk,
        bits=bits,
        stochastic=stochastic,
        target=target,
        pack=pack,
        leaf_rows=_row_table(sizes, first_rows, rows, seeds, chunk),
    )
    out = []
    for d, r, first in zip(sizes, rows, first_rows, strict=True):
        start = int(first) * chunk
        if pack:  # a chunk's codes fill whole bytes, so the leaf's bytes start on one
            byte = start * bits // 8
            leaf_codes = codes[byte : byte + bitpack.packed_size(d, bits)]
        else:
            leaf_codes = bitpack.pack_bits_on(codes[start : start + d], bits=bits, target=target)
        out.append((leaf_codes, lo[first : first + r, None], unit[first : first + r, None]))
    return out


def packed_buffers(xs, chunk: int, target) -> list[list[int]]:
    """The arrays' indices, grouped into packed buffers: one dtype each, and each
    buffer small enough for the kernel (`minmax.quantize_lowers`: int32 offsets).

    Empty arrays, and every array off the GPU, go in none (they are encoded alone).
    """
    if target is None or target.platform != "gpu":
        return []
    buffers: list[Any] = []
    open_buffer: dict[Any, Any] = {}  # dtype -> (indices, rows) of the buffer being filled
    for i, x in enumerate(xs):
        rows = _blocks.num_rows(x.size, chunk)
        if not x.size or not minmax.quantize_lowers(target, rows, chunk, x.dtype):
            continue
        index, filled = open_buffer.get(jnp.dtype(x.dtype), (None, 0))
        if index is None or not minmax.quantize_lowers(target, filled + rows, chunk, x.dtype):
            index, filled = [], 0
            buffers.append(index)
        index.append(i)
        open_buffer[jnp.dtype(x.dtype)] = (index, filled + rows)
    return buffers


def quantize_tree_packed_on(xs, seeds, *, chunk: int, bits: int, stochastic: bool, target):
    """The encode `target` runs: packed buffers on GPU (`packed_buffers`), else array by array."""
    out: list[Any] = [None] * len(xs)
    for index in packed_buffers(xs, chunk, target):
        results = _gpu_quantize_packed_tree(
            [xs[i] for i in index],
            seeds[np.asarray(index)],
            chunk=chunk,
            bits=bits,
            stochastic=stochastic,
            target=target,
        )
        for i, result in zip(index, results, strict=True):
            out[i] = result
    for i, x in enumerate(xs):
        if out[i] is None:
            out[i] = minmax.quantize_packed_on(
                x,
                seeds[i : i + 1],
                chunk=leaf_chunk(x.size, chunk),
                bits=bits,
                stochastic=stochastic,
                target=target,
            )
    return out


def quantize_tree_packed(
    xs,
    seeds,
    *,
    bits: int,
    stochastic: bool,
    chunk: int,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
):
    """`quantize_packed` of many arrays (a model's leaves), bit for bit; on GPU one flat launch.

    On GPU the arrays are copied into one buffer, each padded to whole chunks, and
    one kernel quantizes (and, for 1, 2 and 4 bits, packs) it with each chunk
    drawing from its own array's seeds and element indices (module docstring);
    each array's payload is then cut out. Other widths pack each array's codes
    afterwards. CPU and TPU run `quantize_packed` per array. Compared with
    `quantize_leaves` (one launch taking every array as its own input), which is
    faster on a GPU is not yet measured: the next GPU run of
    `bench/gpu_kernels.py --parts trees` times both, and decides `encode_tree`'s
    default (`lpdec.minmax(..., tree_layout=)`).

    Args:
      xs: float arrays (float32, bfloat16 or float16) of any shapes.
      seeds: uint32[len(xs), 2]: row i is array i's hash seeds (zeros for nearest).
      bits: code width, 1..8.
      stochastic: stochastic rounding from the counter-based hash; else nearest.
      chunk: elements per (lo, unit) pair; an array of fewer elements is one chunk
        of its own size, as `lpdec.minmax(chunk_size=chunk)` lays out a leaf.
      implementation: None (the packed buffer on GPU, per array elsewhere), "xla"
        or "pallas", chosen per lowering platform (`platforms.dispatch`).
      interpret: run the Pallas kernels in interpret mode.

    Returns:
      [(packed uint8 [ceil(size * bits / 8)], lo float32 [rows, 1], unit float32
      [rows, 1]) per array], each as `quantize_packed` returns it for
      `chunk=leaf_chunk(size, chunk)`, bit for bit.
    """
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be an integer >= 1; got {chunk!r}.")
    body = functools.partial(
        quantize_tree_packed_on,
        chunk=chunk,
        bits=numerics.check_bits(bits),
        stochastic=stochastic,
    )
    return platforms.dispatch(implementation, body, list(xs), seeds, interpret=interpret)


def quantize_leaves_on(xs, seeds, *, chunks, bits: int, stochastic: bool, target):
    """`minmax.quantize_on` of each array; on GPU the arrays the kernel takes share one launch."""
    out: list[Any] = [None] * len(xs)
    batched = []
    for i, (x, chunk) in enumerate(zip(xs, chunks, strict=True)):
        rows, chunk = minmax.chunking(x.size, chunk, x.shape)
        if minmax.gpu_quantizes(target, rows, chunk, x.dtype):
            batched.append((i, chunk))
        else:
            out[i] = minmax.quantize_on(
                x, seeds[i : i + 1], chunk=chunk, bits=bits, stochastic=stochastic, target=target
            )
    if batched:
        index = [i for i, _ in batched]
        results = minmax_gpu.gpu_quantize_leaves(
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
        quantize_leaves_on,
        chunks=tuple(chunks),
        bits=numerics.check_bits(bits),
        stochastic=stochastic,
    )
    return platforms.dispatch(implementation, body, list(xs), seeds, interpret=interpret)
