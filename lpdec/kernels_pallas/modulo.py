"""Moniqua's modulo encode (seed 003, Algorithm 1 line 3): q = Q((x / B) mod 1).

The unit circle [0, 1) carries 2**bits equally spaced points k / 2**bits, so a
code is ``round(2**bits * ((x / B) mod 1)) mod 2**bits`` (nearest) or the same
with ``floor(. + u)`` (stochastic rounding, u from the counter-based hash). The
wrap-around matters: 1 - 2**-(bits+1) rounds to the point 0, which keeps the
nearest-rounding error on the circle at 2**-(bits+1) even for 1 bit.

The kernel takes ``scale = 2**bits / B`` as a runtime float32 scalar, so a
schedule for theta (hence B) needs no recompilation. Non-finite inputs encode
to code 0; the compressor flags them separately.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _common


def _encode_rows(x, seeds, scale, row0, *, bits: int, stochastic: bool):
    """[r, c] float -> uint8 codes [r, c]. Shared by the reference and the kernel."""
    points = float(1 << bits)
    # s is x / B measured in circle steps; m = s mod 2**bits lies in [0, 2**bits].
    s = _common.rounded(x.astype(jnp.float32) * scale)
    m = s - jnp.float32(points) * jnp.floor(s * jnp.float32(1.0 / points))
    if stochastic:
        index = _common.element_index(x.shape, row0, x.shape[1])
        r = jnp.floor(m + _common.hash_uniform(seeds[0, 0], seeds[0, 1], index))
    else:
        r = jnp.round(m)
    r = jnp.where(jnp.isfinite(r), r, 0.0)
    # r is in [0, 2**bits]; the mask maps the point 2**bits back to 0 (the circle wraps).
    return (r.astype(jnp.int32) & ((1 << bits) - 1)).astype(jnp.uint8)


def encode_reference(x2d, seeds, scale, *, bits: int, stochastic: bool):
    """jnp reference of the modulo encode; `scale` = 2**bits / B (float32 scalar)."""
    scale = jnp.asarray(scale, jnp.float32).reshape(1, 1)
    return _encode_rows(x2d, seeds, scale, 0, bits=bits, stochastic=stochastic)


def _encode_kernel(seeds_ref, scale_ref, x_ref, codes_ref, *, bits, stochastic, rows):
    row0 = pl.program_id(0) * rows
    codes_ref[...] = _encode_rows(
        x_ref[...], seeds_ref[...], scale_ref[...], row0, bits=bits, stochastic=stochastic
    )


@functools.partial(jax.jit, static_argnames=("bits", "stochastic", "block_rows", "interpret"))
def encode_pallas(
    x2d,
    seeds,
    scale,
    *,
    bits: int,
    stochastic: bool,
    block_rows: int | None = None,
    interpret=False,
):
    """Pallas kernel of the modulo encode."""
    rows, width = x2d.shape
    br = block_rows or _common.block_rows_for(rows, width)
    padded = _common.num_rows(rows, br) * br
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    scale = jnp.asarray(scale, jnp.float32).reshape(1, 1)
    codes = pl.pallas_call(
        functools.partial(_encode_kernel, bits=bits, stochastic=stochastic, rows=br),
        grid=(padded // br,),
        in_specs=[
            pl.BlockSpec((1, 2), lambda i: (0, 0)),
            pl.BlockSpec((1, 1), lambda i: (0, 0)),
            pl.BlockSpec((br, width), lambda i: (i, 0)),
        ],
        out_specs=pl.BlockSpec((br, width), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, width), jnp.uint8),
        interpret=_common.needs_interpret(interpret),
        compiler_params=_common.compiler_params(),
    )(seeds, scale, _common.pad_rows(x2d, padded))
    return codes[:rows]


def encode(
    x2d,
    seeds,
    scale,
    *,
    bits: int,
    stochastic: bool,
    implementation: _common.Implementation = None,
    interpret: bool = False,
):
    """Modulo encode of a [rows, width] float array into uint8 codes in [0, 2**bits).

    Args:
      x2d: float array [rows, width].
      seeds: uint32[1, 2] hash seeds; required when `stochastic`.
      scale: float32 scalar 2**bits / B, with B Moniqua's modulo range B_theta.
      bits: code width, 1..8.
      stochastic: stochastic rounding; else nearest.
      implementation: None (Pallas on GPU/TPU, jnp on CPU), "xla" or "pallas".
      interpret: run the Pallas kernel in interpret mode.
    """
    if stochastic and seeds is None:
        raise ValueError("stochastic rounding needs seeds (see seeds_from_key).")
    if _common.use_pallas(implementation, x2d.shape[1]) and x2d.shape[0]:
        return encode_pallas(
            x2d, seeds, scale, bits=bits, stochastic=stochastic, interpret=interpret
        )
    return encode_reference(x2d, seeds, scale, bits=bits, stochastic=stochastic)
