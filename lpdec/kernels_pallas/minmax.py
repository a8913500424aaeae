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
`minmax_jnp` (`quantize_rows`, `dequantize_rows`), called by the references and
by every kernel, so they agree bit for bit.

The modules: this one holds the public ops on one array (`quantize`,
`quantize_packed`, `dequantize`, `dequantize_accumulate`), each choosing per
lowering platform, and the row kernels (TPU, and any platform interpreted);
`minmax_gpu` the GPU's flat Triton kernels; `minmax_mosaic` the Mosaic GPU row
quantize and dequantize (a GPU without Pallas Triton); `minmax_feedback` the
error-feedback quantize; `minmax_tree` a model's leaves in one launch;
`minmax_jnp` the shared arithmetic, the references and the CPU path.

Package-internal (not in `__all__`; for `minmax_feedback`, `minmax_tree` and the
tests): `quantize_on`, `quantize_packed_on`, `dequantize_on` and
`dequantize_accumulate_on`, each op for one `platforms.Target` (None: the jnp
path), which the public ops run under `platforms.dispatch`; `chunking`,
`as_rows` and `from_rows`, an array's layout in chunks.

On CPU there is no kernel: XLA runs the same math as two passes over x, one
reduction producing each row's (min, max), then one element-wise loop producing
the codes; both are written for that (`minmax_jnp.row_min_max`,
`minmax_jnp.codes_from_levels`). The public ops take that path there in the
caller's layout (`minmax_jnp` says why).

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

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import minmax_gpu
from lpdec.kernels_pallas import minmax_jnp
from lpdec.kernels_pallas import minmax_mosaic
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms
from lpdec.kernels_pallas.minmax_jnp import dequantize_accumulate_reference
from lpdec.kernels_pallas.minmax_jnp import dequantize_reference
from lpdec.kernels_pallas.minmax_jnp import quantize_reference

__all__ = [
    "dequantize",
    "dequantize_accumulate",
    "dequantize_accumulate_pallas",
    "dequantize_accumulate_reference",
    "dequantize_lowers",
    "dequantize_pallas",
    "dequantize_reference",
    "gpu_quantizes",
    "mosaic_quantizes",
    "quantize",
    "quantize_lowers",
    "quantize_packed",
    "quantize_pallas",
    "quantize_reference",
]

# ----------------------------------------------------------------------------
# The row kernels: a block of whole chunks (rows) per grid step.
# ----------------------------------------------------------------------------


def _quantize_kernel(seeds_ref, x_ref, codes_ref, lo_ref, unit_ref, *, bits, stochastic, variadic):
    row0 = pl.program_id(0) * x_ref.shape[0]
    # The seeds are passed as the ref: `minmax_jnp.element_codes` reads seeds[0, 0] and
    # seeds[0, 1] as scalar loads (Triton cannot slice a loaded array).
    codes, lo, unit = minmax_jnp.quantize_rows(
        x_ref[...], seeds_ref, row0, bits=bits, stochastic=stochastic, variadic=variadic
    )
    codes_ref[...] = codes
    lo_ref[...] = lo
    unit_ref[...] = unit


def _dequantize_kernel(codes_ref, lo_ref, unit_ref, out_ref):
    out_ref[...] = minmax_jnp.dequantize_rows(codes_ref[...], lo_ref[...], unit_ref[...]).astype(
        out_ref.dtype
    )


def _accumulate_kernel(weight_ref, acc_ref, codes_ref, lo_ref, unit_ref, out_ref):
    out_ref[...] = minmax_jnp.accumulate_rows(
        acc_ref[...], weight_ref[0, 0], codes_ref[...], lo_ref[...], unit_ref[...]
    )


# ----------------------------------------------------------------------------
# The layout. The ops quantize an array of any shape in chunks of `chunk`
# consecutive (row-major) elements, the last one possibly shorter: the row
# kernels see the chunks as the rows of a padded [rows, chunk] view, the GPU's
# kernels the flat array as it is, the jnp path the caller's shape (see the CPU
# path above). All give the bits of the references.
# ----------------------------------------------------------------------------


def chunking(size: int, chunk: int | None, shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, chunk) of `size` elements; chunk None: the last axis of `shape` is a chunk."""
    if chunk is None:
        chunk = shape[-1] if shape else 1
    chunk = max(1, chunk)
    return _blocks.num_rows(size, chunk), chunk


def as_rows(x, rows: int, chunk: int, mode: str):
    """x flattened and padded (numpy pad `mode`) to [rows, chunk]."""
    flat = x.reshape(-1)
    if rows * chunk != flat.size:
        flat = jnp.pad(flat, (0, rows * chunk - flat.size), mode=mode)
    return flat.reshape(rows, chunk)


def from_rows(x2d, shape: tuple[int, ...]):
    return x2d.reshape(-1)[: math.prod(shape)].reshape(shape)


# ----------------------------------------------------------------------------
# Which kernel runs where.
# ----------------------------------------------------------------------------


def _kernel_lowers(target, rows: int, chunk: int, dtypes) -> bool:
    """Whether `target` runs a kernel on [rows, chunk] operands of `dtypes`.

    False for the jnp path (`target` None), for no rows, and where the platform's
    compiler rejects the blocks. The GPU kernels address the flat array
    themselves (`minmax_gpu`): any chunk and size below 2**31 elements. The row
    kernels' blocks hold the operands and the [rows, 1] float32 scales.
    """
    if target is None or not rows:
        return False
    if target.platform == "gpu":
        return minmax_gpu.lowers(rows * chunk)
    return _blocks.row_lowers(target, rows, [*((chunk, d) for d in dtypes), (1, jnp.float32)])


def quantize_lowers(target, rows: int, chunk: int, dtype) -> bool:
    """Whether `target` runs the quantize kernel on a [rows, chunk] `dtype` array."""
    return _kernel_lowers(target, rows, chunk, (dtype, jnp.uint8))


def dequantize_lowers(target, rows: int, chunk: int, dtype) -> bool:
    """Whether `target` runs the dequantize (-accumulate) kernel writing `dtype`."""
    return _kernel_lowers(target, rows, chunk, (jnp.uint8, dtype))


def gpu_quantizes(target, rows: int, chunk: int, dtype) -> bool:
    """Whether `target` is a GPU that runs the flat quantize kernels (`minmax_gpu`) here."""
    return (
        target is not None
        and target.platform == "gpu"
        and quantize_lowers(target, rows, chunk, dtype)
    )


# The chunks Mosaic GPU's row quantize takes without a padded copy (whole warpgroups)
# and with at most 32 values per lane in registers; measured at 2048 (BENCHMARKS.md).
_MOSAIC_CHUNKS = range(minmax_mosaic.LANES, 4096 + 1, minmax_mosaic.LANES)


def mosaic_quantizes(target, rows: int, chunk: int, dtype) -> bool:
    """Whether the GPU quantize runs Mosaic GPU's row kernel: only on a jax without
    Pallas Triton, for chunks of `_MOSAIC_CHUNKS` and float32 or bfloat16 input.

    On an H100 (jax 0.11.2) that kernel quantized [rows, 2048] float32 at 94-99 % of
    copy bandwidth from 64M elements, as fast as Triton's and 1.7x XLA's fusion of
    the jnp path (BENCHMARKS.md, GPU section); XLA dequantizes as fast as either, so
    dequantize keeps the jnp path there.
    """
    return (
        target is not None
        and target.platform == "gpu"
        and platforms.pallas_triton is None
        and minmax_mosaic.available()
        and (not target.interpret or minmax_mosaic.interpret_available())
        and 0 < rows * chunk < 2**31
        and chunk in _MOSAIC_CHUNKS
        and jnp.dtype(dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    )


# ----------------------------------------------------------------------------
# The kernel a target runs: where the GPU's flat kernels and the row kernels part,
# for the `*_pallas` entries and the public ops alike.
# ----------------------------------------------------------------------------


def _quantize_with(
    x, seeds, *, rows: int, chunk: int, bits: int, stochastic: bool, target, block_rows=None
):
    """(codes in x's shape, lo [rows, 1], unit [rows, 1]) of x's `rows` chunks by `target`'s
    kernel."""
    if target.platform == "gpu":  # the flat array as it is: no padded copy
        codes, lo, unit = minmax_gpu.gpu_quantize(
            x.reshape(-1),
            seeds,
            chunk=chunk,
            bits=bits,
            stochastic=stochastic,
            target=target,
            block_rows=block_rows,
        )
        return codes.reshape(x.shape), lo[:, None], unit[:, None]
    # The CPU kernel reduces like the reference (one variadic reduce); Triton and
    # Mosaic know only reduce_min/reduce_max (same values, see minmax_jnp.row_min_max).
    kernel = functools.partial(
        _quantize_kernel, bits=bits, stochastic=stochastic, variadic=target.platform == "cpu"
    )
    # Repeat the last element: a partial chunk's min and max are unchanged.
    codes, lo, unit = _blocks.row_call(
        kernel,
        target,
        scalars=[seeds],
        inputs=[as_rows(x, rows, chunk, "edge")],
        outputs=[(chunk, jnp.uint8), (1, jnp.float32), (1, jnp.float32)],
        block_rows=block_rows,
    )
    return from_rows(codes, x.shape), lo, unit


def _dequantize_with(codes, lo, unit, *, rows: int, chunk: int, dtype, target, block_rows=None):
    """lo + codes * unit in the codes' shape by `target`'s kernel."""
    if target.platform == "gpu":
        out = minmax_gpu.gpu_dequantize(
            codes.reshape(-1),
            lo.reshape(-1),
            unit.reshape(-1),
            chunk=chunk,
            dtype=dtype,
            target=target,
            block_rows=block_rows,
        )
        return out.reshape(codes.shape)
    (out,) = _blocks.row_call(
        _dequantize_kernel,
        target,
        inputs=[
            as_rows(codes, rows, chunk, "constant"),
            lo.reshape(rows, 1),
            unit.reshape(rows, 1),
        ],
        outputs=[(chunk, dtype)],
        block_rows=block_rows,
    )
    return from_rows(out, codes.shape)


def _accumulate_with(
    acc, weight, codes, lo, unit, *, rows: int, chunk: int, target, block_rows=None
):
    """acc + weight * (lo + codes * unit), float32 in the codes' shape, by `target`'s kernel."""
    acc = acc.astype(jnp.float32)
    weight = jnp.asarray(weight, jnp.float32).reshape(1, 1)
    if target.platform == "gpu":
        out = minmax_gpu.gpu_dequantize_accumulate(
            acc.reshape(-1),
            weight,
            codes.reshape(-1),
            lo.reshape(-1),
            unit.reshape(-1),
            chunk=chunk,
            target=target,
            block_rows=block_rows,
        )
        return out.reshape(codes.shape)
    (out,) = _blocks.row_call(
        _accumulate_kernel,
        target,
        scalars=[weight],
        inputs=[
            as_rows(acc, rows, chunk, "constant"),
            as_rows(codes, rows, chunk, "constant"),
            lo.reshape(rows, 1),
            unit.reshape(rows, 1),
        ],
        outputs=[(chunk, jnp.float32)],
        block_rows=block_rows,
        input_output_aliases={1: 0},
    )
    return from_rows(out, codes.shape)


# ----------------------------------------------------------------------------
# The kernels on the [rows, chunk] layout, for tests and benchmarks.
# ----------------------------------------------------------------------------


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
        _quantize_with,
        rows=x2d.shape[0],
        chunk=x2d.shape[1],
        bits=bits,
        stochastic=stochastic,
        block_rows=block_rows,
    )
    if platform is None:
        return platforms.on_each_platform(body, x2d, seeds, interpret=interpret)
    return body(x2d, seeds, target=platforms.Target(platform, interpret))


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
    body = functools.partial(
        _dequantize_with,
        rows=codes.shape[0],
        chunk=codes.shape[1],
        dtype=jnp.dtype(dtype),
        block_rows=block_rows,
    )
    if platform is None:
        return platforms.on_each_platform(body, codes, lo, unit, interpret=interpret)
    return body(codes, lo, unit, target=platforms.Target(platform, interpret))


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
    body = functools.partial(
        _accumulate_with, rows=codes.shape[0], chunk=codes.shape[1], block_rows=block_rows
    )
    if platform is None:
        return platforms.on_each_platform(body, acc, weight, codes, lo, unit, interpret=interpret)
    return body(acc, weight, codes, lo, unit, target=platforms.Target(platform, interpret))


# ----------------------------------------------------------------------------
# Public ops with `implementation=` dispatch (`platforms.dispatch`).
# ----------------------------------------------------------------------------


def quantize_on(x, seeds, *, chunk, bits: int, stochastic: bool, target):
    """The quantize `target` runs: its kernel, or the jnp path (see quantize_lowers)."""
    rows, chunk = chunking(x.size, chunk, x.shape)
    if mosaic_quantizes(target, rows, chunk, x.dtype):
        # Rows as the row kernels take them: a partial last chunk repeats its last element.
        codes, lo, unit = minmax_mosaic.quantize(
            as_rows(x, rows, chunk, "edge"),
            seeds,
            bits=bits,
            stochastic=stochastic,
            interpret=target.interpret,
        )
        return from_rows(codes, x.shape), lo, unit
    if not quantize_lowers(target, rows, chunk, x.dtype):
        return minmax_jnp.quantize_elementwise(
            x, seeds, chunk=chunk, bits=bits, stochastic=stochastic
        )
    return _quantize_with(
        x, seeds, rows=rows, chunk=chunk, bits=bits, stochastic=stochastic, target=target
    )


def dequantize_on(codes, lo, unit, *, chunk, dtype, target):
    """The dequantize `target` runs: its kernel, or the jnp path."""
    rows, chunk = chunking(codes.size, chunk, codes.shape)
    if not dequantize_lowers(target, rows, chunk, dtype):
        return dequantize_reference(
            codes,
            minmax_jnp.spread(lo, chunk, codes.shape),
            minmax_jnp.spread(unit, chunk, codes.shape),
            dtype=dtype,
        )
    return _dequantize_with(codes, lo, unit, rows=rows, chunk=chunk, dtype=dtype, target=target)


def dequantize_accumulate_on(acc, weight, codes, lo, unit, *, chunk, target):
    """The dequantize-accumulate `target` runs: its kernel, or the jnp path."""
    rows, chunk = chunking(codes.size, chunk, codes.shape)
    if not dequantize_lowers(target, rows, chunk, jnp.float32):
        return minmax_jnp.accumulate_rows(
            acc.astype(jnp.float32),
            weight,
            codes,
            minmax_jnp.spread(lo, chunk, codes.shape),
            minmax_jnp.spread(unit, chunk, codes.shape),
        )
    return _accumulate_with(acc, weight, codes, lo, unit, rows=rows, chunk=chunk, target=target)


def quantize_packed_on(x, seeds, *, chunk, bits: int, stochastic: bool, target):
    """The quantize-and-pack `target` runs: one GPU pass where `minmax_gpu.packs_in_pass`, else
    `quantize_on` and then `bitpack`'s packing."""
    rows, chunk = chunking(x.size, chunk, x.shape)
    if gpu_quantizes(target, rows, chunk, x.dtype) and minmax_gpu.packs_in_pass(bits, chunk):
        packed, lo, unit = minmax_gpu.gpu_quantize(
            x.reshape(-1),
            seeds,
            chunk=chunk,
            bits=bits,
            stochastic=stochastic,
            target=target,
            pack=True,
        )
        return packed, lo[:, None], unit[:, None]
    codes, lo, unit = quantize_on(
        x, seeds, chunk=chunk, bits=bits, stochastic=stochastic, target=target
    )
    return bitpack.pack_bits_on(codes.reshape(-1), bits=bits, target=target), lo, unit


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
        quantize_on, chunk=chunk, bits=numerics.check_bits(bits), stochastic=stochastic
    )
    return platforms.dispatch(implementation, body, x, seeds, interpret=interpret)


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
        quantize_packed_on, chunk=chunk, bits=numerics.check_bits(bits), stochastic=stochastic
    )
    return platforms.dispatch(implementation, body, x, seeds, interpret=interpret)


def dequantize(
    codes, lo, unit, *, chunk=None, dtype=jnp.float32, implementation=None, interpret=False
):
    """lo + codes * unit per chunk, cast to `dtype`, in the codes' shape.

    `lo` and `unit` hold one value per chunk (any shape); `chunk` as in `quantize`.
    """
    body = functools.partial(dequantize_on, chunk=chunk, dtype=jnp.dtype(dtype))
    return platforms.dispatch(implementation, body, codes, lo, unit, interpret=interpret)


def dequantize_accumulate(
    acc, weight, codes, lo, unit, *, chunk=None, implementation=None, interpret=False
):
    """acc + weight * (lo + codes * unit) in float32, in the codes' shape: the gossip inner loop.

    `acc` has the codes' shape; `lo`, `unit` and `chunk` as in `dequantize`.
    """
    weight = jnp.asarray(weight, jnp.float32)
    body = functools.partial(dequantize_accumulate_on, chunk=chunk)
    return platforms.dispatch(
        implementation, body, acc, weight, codes, lo, unit, interpret=interpret
    )
