"""Per-chunk min-max quantization: fused quantize, dequantize, dequantize-and-accumulate.

Layout: the input is viewed as [rows, chunk] with one (lo, unit) pair per row.
For each row (seeds 000, 001, 004; DESIGN.md "Quantizer semantics")::

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
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _common


def _quantize_rows(x, seeds, row0, *, bits: int, stochastic: bool):
    """[r, c] float -> (uint8 codes [r, c], float32 lo [r, 1], float32 unit [r, 1])."""
    x = x.astype(jnp.float32)
    top = jnp.float32(_common.levels(bits))
    lo = jnp.min(x, axis=1, keepdims=True)
    hi = jnp.max(x, axis=1, keepdims=True)
    # Multiply by a rounded reciprocal rather than divide by a constant: XLA rewrites
    # x / c as x * (1 / c) in some fusions and not others, which would change the last bit.
    unit = (hi - lo) * jnp.float32(1.0 / _common.levels(bits))
    inv_unit = jnp.where(unit > 0, 1.0 / unit, 0.0)
    t = (x - lo) * inv_unit
    if stochastic:
        index = _common.element_index(x.shape, row0, x.shape[1])
        t = jnp.floor(_common.rounded(t) + _common.hash_uniform(seeds[0, 0], seeds[0, 1], index))
    else:
        t = jnp.round(t)
    # Clamp at both ends: rounding error can push t just outside [0, top].
    t = jnp.clip(t, 0.0, top)
    # NaN codes would be undefined after the cast; the row's scales already carry the NaN.
    t = jnp.where(jnp.isnan(t), 0.0, t)
    return t.astype(jnp.uint8), lo, unit


def _dequantize_rows(codes, lo, unit):
    return lo + _common.rounded(codes.astype(jnp.float32) * unit)


def _accumulate_rows(acc, weight, codes, lo, unit):
    return acc + _common.rounded(weight * _dequantize_rows(codes, lo, unit))


# ----------------------------------------------------------------------------
# jnp references (the CPU implementation).
# ----------------------------------------------------------------------------


def quantize_reference(x2d, seeds, *, bits: int, stochastic: bool):
    """jnp reference of the fused quantize: see the module docstring."""
    return _quantize_rows(x2d, seeds, 0, bits=bits, stochastic=stochastic)


def dequantize_reference(codes, lo, unit, *, dtype=jnp.float32):
    """jnp reference: lo + codes * unit, cast to `dtype`."""
    return _dequantize_rows(codes, lo, unit).astype(dtype)


def dequantize_accumulate_reference(acc, weight, codes, lo, unit):
    """jnp reference: acc + weight * (lo + codes * unit), in float32."""
    return _accumulate_rows(acc, jnp.asarray(weight, jnp.float32).reshape(1, 1), codes, lo, unit)


# ----------------------------------------------------------------------------
# Pallas kernels.
# ----------------------------------------------------------------------------


def _quantize_kernel(seeds_ref, x_ref, codes_ref, lo_ref, unit_ref, *, bits, stochastic, rows):
    row0 = pl.program_id(0) * rows
    codes, lo, unit = _quantize_rows(
        x_ref[...], seeds_ref[...], row0, bits=bits, stochastic=stochastic
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
        acc_ref[...], weight_ref[...], codes_ref[...], lo_ref[...], unit_ref[...]
    )


def _grid(rows: int, chunk: int, block_rows: int | None):
    br = block_rows or _common.block_rows_for(rows, chunk)
    padded = _common.num_rows(rows, br) * br
    return br, padded


def _row_spec(br, width):
    return pl.BlockSpec((br, width), lambda i: (i, 0))


def _whole_spec(shape):
    return pl.BlockSpec(shape, lambda i: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("bits", "stochastic", "block_rows", "interpret"))
def quantize_pallas(
    x2d, seeds, *, bits: int, stochastic: bool, block_rows: int | None = None, interpret=False
):
    """Pallas kernel of the fused per-chunk quantize (one read of x per block)."""
    rows, chunk = x2d.shape
    br, padded = _grid(rows, chunk, block_rows)
    x2d = _common.pad_rows(x2d, padded)
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    codes, lo, unit = pl.pallas_call(
        functools.partial(_quantize_kernel, bits=bits, stochastic=stochastic, rows=br),
        grid=(padded // br,),
        in_specs=[_whole_spec((1, 2)), _row_spec(br, chunk)],
        out_specs=[_row_spec(br, chunk), _row_spec(br, 1), _row_spec(br, 1)],
        out_shape=[
            jax.ShapeDtypeStruct((padded, chunk), jnp.uint8),
            jax.ShapeDtypeStruct((padded, 1), jnp.float32),
            jax.ShapeDtypeStruct((padded, 1), jnp.float32),
        ],
        interpret=_common.needs_interpret(interpret),
        compiler_params=_common.compiler_params(),
    )(seeds, x2d)
    return codes[:rows], lo[:rows], unit[:rows]


@functools.partial(jax.jit, static_argnames=("dtype", "block_rows", "interpret"))
def dequantize_pallas(codes, lo, unit, *, dtype=jnp.float32, block_rows=None, interpret=False):
    """Pallas kernel: lo + codes * unit per row."""
    rows, chunk = codes.shape
    br, padded = _grid(rows, chunk, block_rows)
    out = pl.pallas_call(
        _dequantize_kernel,
        grid=(padded // br,),
        in_specs=[_row_spec(br, chunk), _row_spec(br, 1), _row_spec(br, 1)],
        out_specs=_row_spec(br, chunk),
        out_shape=jax.ShapeDtypeStruct((padded, chunk), dtype),
        interpret=_common.needs_interpret(interpret),
        compiler_params=_common.compiler_params(),
    )(_common.pad_rows(codes, padded), _common.pad_rows(lo, padded), _common.pad_rows(unit, padded))
    return out[:rows]


@functools.partial(jax.jit, static_argnames=("block_rows", "interpret"))
def dequantize_accumulate_pallas(acc, weight, codes, lo, unit, *, block_rows=None, interpret=False):
    """Pallas kernel: acc + weight * (lo + codes * unit), accumulating in place."""
    rows, chunk = codes.shape
    br, padded = _grid(rows, chunk, block_rows)
    weight = jnp.asarray(weight, jnp.float32).reshape(1, 1)
    out = pl.pallas_call(
        _accumulate_kernel,
        grid=(padded // br,),
        in_specs=[
            _whole_spec((1, 1)),
            _row_spec(br, chunk),
            _row_spec(br, chunk),
            _row_spec(br, 1),
            _row_spec(br, 1),
        ],
        out_specs=_row_spec(br, chunk),
        out_shape=jax.ShapeDtypeStruct((padded, chunk), jnp.float32),
        input_output_aliases={1: 0},
        interpret=_common.needs_interpret(interpret),
        compiler_params=_common.compiler_params(),
    )(
        weight,
        _common.pad_rows(acc.astype(jnp.float32), padded),
        _common.pad_rows(codes, padded),
        _common.pad_rows(lo, padded),
        _common.pad_rows(unit, padded),
    )
    return out[:rows]


# ----------------------------------------------------------------------------
# Public ops with `implementation=` dispatch.
# ----------------------------------------------------------------------------


def quantize(
    x2d,
    seeds=None,
    *,
    bits: int,
    stochastic: bool,
    implementation: _common.Implementation = None,
    interpret: bool = False,
):
    """Fused per-row min-max quantize of a [rows, chunk] float array.

    Args:
      x2d: float array [rows, chunk] (float32, bfloat16 or float16).
      seeds: uint32[1, 2] hash seeds (`seeds_from_key`); required when `stochastic`.
      bits: code width, 1..8.
      stochastic: stochastic rounding from the counter-based hash; else nearest.
      implementation: None (Pallas on GPU/TPU, jnp on CPU), "xla" or "pallas".
      interpret: run the Pallas kernel in interpret mode.

    Returns:
      (codes uint8 [rows, chunk], lo float32 [rows, 1], unit float32 [rows, 1]).
    """
    if stochastic and seeds is None:
        raise ValueError("stochastic rounding needs seeds (see seeds_from_key).")
    if _common.use_pallas(implementation, x2d.shape[1]) and x2d.shape[0]:
        return quantize_pallas(x2d, seeds, bits=bits, stochastic=stochastic, interpret=interpret)
    return quantize_reference(x2d, seeds, bits=bits, stochastic=stochastic)


def dequantize(codes, lo, unit, *, dtype=jnp.float32, implementation=None, interpret=False):
    """lo + codes * unit per row, cast to `dtype`."""
    if _common.use_pallas(implementation, codes.shape[1]) and codes.shape[0]:
        return dequantize_pallas(codes, lo, unit, dtype=jnp.dtype(dtype), interpret=interpret)
    return dequantize_reference(codes, lo, unit, dtype=dtype)


def dequantize_accumulate(acc, weight, codes, lo, unit, *, implementation=None, interpret=False):
    """acc + weight * (lo + codes * unit) in float32: the gossip inner loop."""
    if _common.use_pallas(implementation, codes.shape[1]) and codes.shape[0]:
        return dequantize_accumulate_pallas(acc, weight, codes, lo, unit, interpret=interpret)
    return dequantize_accumulate_reference(acc, weight, codes, lo, unit)
