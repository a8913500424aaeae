"""Min-max with error feedback in one pass: v = update + decay * residual, its codes and v - decode.

DiLoCo's exchange and the compressed mean (`lpdec.algorithms.compressed_mean`)
encode with error feedback on every exchange. On GPU one kernel
(`minmax_gpu.gpu_quantize_feedback`) reads the update and the residual once and
writes the codes (packed in the same pass for 1, 2 and 4 bits) and the new
residual; elsewhere the same bits come from `minmax.quantize` and `minmax.dequantize`.

Package-internal (not in `__all__`; for the tests): `quantize_feedback_on` and
`quantize_feedback_packed_on`, the ops for one `platforms.Target` (None: the
jnp path), which the public ops run under `platforms.dispatch`.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import minmax
from lpdec.kernels_pallas import minmax_gpu
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms

__all__ = ["quantize_feedback", "quantize_feedback_packed"]


def quantize_feedback_on(update, residual, decay, seeds, *, chunk, bits, stochastic, target):
    """The error-feedback quantize `target` runs: the fused GPU kernel, or quantize + residual."""
    rows, chunk = minmax.chunking(update.size, chunk, update.shape)
    if minmax.gpu_quantizes(target, rows, chunk, jnp.float32):
        codes, lo, unit, error = minmax_gpu.gpu_quantize_feedback(
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
    codes, lo, unit = minmax.quantize_on(
        v, seeds, chunk=chunk, bits=bits, stochastic=stochastic, target=target
    )
    decoded = minmax.dequantize_on(codes, lo, unit, chunk=chunk, dtype=jnp.float32, target=target)
    return codes, lo, unit, v - decoded


def quantize_feedback_packed_on(update, residual, decay, seeds, *, chunk, bits, stochastic, target):
    """`quantize_feedback_on` with the codes packed: one GPU pass where
    `minmax_gpu.packs_in_pass`."""
    rows, chunk = minmax.chunking(update.size, chunk, update.shape)
    if minmax.gpu_quantizes(target, rows, chunk, jnp.float32) and minmax_gpu.packs_in_pass(
        bits, chunk
    ):
        packed, lo, unit, error = minmax_gpu.gpu_quantize_feedback(
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
    codes, lo, unit, error = quantize_feedback_on(
        update, residual, decay, seeds, chunk=chunk, bits=bits, stochastic=stochastic, target=target
    )
    packed = bitpack.pack_bits_on(codes.reshape(-1), bits=bits, target=target)
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
        quantize_feedback_packed_on,
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
        quantize_feedback_on, chunk=chunk, bits=numerics.check_bits(bits), stochastic=stochastic
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
