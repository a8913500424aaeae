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

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms

# Adding 2**23 to a float32 in [0, 2**23) rounds it to an integer (ties to even)
# held in the low mantissa bits: the sum's spacing is exactly 1.
_MAGIC = 2.0**23
# Row length of the kernel's view of x; modulo codes have no per-row scales, so any works.
_ROW = 1024


def _encode_rows(x, seeds, scale, row0, *, bits: int, stochastic: bool, index=None):
    """[r, c] float -> uint8 codes [r, c]. Shared by the reference and the kernels.

    `seeds` is a uint32[1, 2] array or ref and `scale` a float32 scalar or [1, 1]
    array: the kernel reads both from refs as scalars (Triton cannot slice arrays).
    `index`: each element's flat index (default: that of a [r, c] block at `row0`).
    """
    points = float(1 << bits)
    mask = (1 << bits) - 1
    # s is x / B measured in circle steps; m = s mod 2**bits lies in [0, 2**bits].
    s = numerics.rounded(x.astype(jnp.float32) * scale)
    m = s - jnp.float32(points) * jnp.floor(s * jnp.float32(1.0 / points))
    if stochastic:
        if index is None:
            index = numerics.element_index(x.shape, row0, x.shape[1])
        r = jnp.floor(m + numerics.hash_uniform(seeds[0, 0], seeds[0, 1], index))
        r = jnp.where(jnp.isfinite(r), r, 0.0)
        # r is in [0, 2**bits]; the mask maps the point 2**bits back to 0 (the circle wraps).
        return (r.astype(jnp.int32) & mask).astype(jnp.uint8)
    # Round half to even like jnp.round, which Triton does not lower: adding 2**23 to
    # m in [0, 2**bits] leaves round(m) in the low mantissa bits, read with a bitcast.
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    pattern = jax.lax.bitcast_convert_type(m + jnp.float32(_MAGIC), jnp.int32)
    return (pattern & mask).astype(jnp.uint8)


def encode_reference(x2d, seeds, scale, *, bits: int, stochastic: bool):
    """jnp reference of the modulo encode; `scale` = 2**bits / B (float32 scalar)."""
    scale = jnp.asarray(scale, jnp.float32).reshape(1, 1)
    return _encode_rows(x2d, seeds, scale, 0, bits=bits, stochastic=stochastic)


def _encode_kernel(seeds_ref, scale_ref, x_ref, codes_ref, *, bits, stochastic):
    row0 = pl.program_id(0) * x_ref.shape[0]
    codes_ref[...] = _encode_rows(
        x_ref[...], seeds_ref, scale_ref[0, 0], row0, bits=bits, stochastic=stochastic
    )


def encode_lowers(target, rows: int, width: int, dtype) -> bool:
    """Whether `target` runs the encode kernel on a [rows, width] `dtype` array.

    False for the jnp path (`target` None), for no rows, and where the platform's
    compiler rejects the blocks. The GPU kernel addresses the flat array itself
    (`_gpu_encode`): any width and size below 2**31 elements.
    """
    if target is None or not rows:
        return False
    if target.platform == "gpu":
        return platforms.pallas_triton is not None and rows * width < 2**31
    return _blocks.row_lowers(target, rows, [(width, dtype), (width, jnp.uint8)])


def _gpu_encode_kernel(seeds_ref, scale_ref, x_ref, codes_ref, *, bits, stochastic, rows):
    # Flat offsets of a [rows, _ROW] tile; a code depends only on its element and
    # its flat index, so the tile need not match any view of x. Past the end: masked.
    row = pl.program_id(0) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, _ROW), 0)
    offsets = row * _ROW + jax.lax.broadcasted_iota(jnp.int32, (rows, _ROW), 1)
    valid = offsets < x_ref.shape[0]
    x = platforms.pallas_triton.load(x_ref.at[offsets], mask=valid, other=0)
    index = offsets.astype(jnp.uint32)
    codes = _encode_rows(
        x, seeds_ref, scale_ref[0, 0], 0, bits=bits, stochastic=stochastic, index=index
    )
    platforms.pallas_triton.store(codes_ref.at[offsets], codes, mask=valid)


def _gpu_encode(flat, seeds, scale, *, bits: int, stochastic: bool, target, block_rows=None):
    """GPU kernel: uint8 codes of a flat float array, no padding (see encode_lowers)."""
    d = flat.size
    br, steps = _blocks.flat_grid(target, _blocks.num_rows(d, _ROW), _ROW, block_rows)
    return target.pallas_call(
        functools.partial(_gpu_encode_kernel, bits=bits, stochastic=stochastic, rows=br),
        block_elements=br * _ROW,
        grid=(steps,),
        in_specs=[target.scalar_spec((1, 2)), target.scalar_spec((1, 1)), _blocks.whole(d)],
        out_specs=_blocks.whole(d),
        out_shape=_blocks.out_struct((d,), jnp.uint8, flat),
    )(seeds, scale.reshape(1, 1), flat)


@functools.partial(
    jax.jit, static_argnames=("bits", "stochastic", "block_rows", "interpret", "platform")
)
def encode_pallas(
    x2d,
    seeds,
    scale,
    *,
    bits: int,
    stochastic: bool,
    block_rows: int | None = None,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
):
    """Pallas kernel of the modulo encode.

    `platform` ("cpu", "gpu", "tpu") builds the kernel that platform compiles
    (`platforms.Target`); None takes the lowering platform's, interpreted on CPU.
    `interpret` interprets it.
    """
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    scale = jnp.asarray(scale, jnp.float32).reshape(1, 1)
    body = functools.partial(_encode_call, bits=bits, stochastic=stochastic, block_rows=block_rows)
    if platform is None:
        return platforms.on_each_platform(body, x2d, seeds, scale, interpret=interpret)
    return body(x2d, seeds, scale, target=platforms.Target(platform, interpret))


def _encode_call(x2d, seeds, scale, *, bits, stochastic, block_rows, target):
    rows, width = x2d.shape
    if target.platform == "gpu":
        codes = _gpu_encode(
            x2d.reshape(-1),
            seeds,
            scale,
            bits=bits,
            stochastic=stochastic,
            target=target,
            block_rows=block_rows,
        )
        return codes.reshape(rows, width)
    (codes,) = _blocks.row_call(
        functools.partial(_encode_kernel, bits=bits, stochastic=stochastic),
        target,
        scalars=[seeds, scale],
        inputs=[x2d],
        outputs=[(width, jnp.uint8)],
        block_rows=block_rows,
    )
    return codes


def _encode_on(x, seeds, scale, *, bits: int, stochastic: bool, target):
    """The encode `target` runs on x viewed as rows of `_ROW`: its kernel, or the jnp reference."""
    d = x.size
    width = max(1, min(_ROW, d))
    rows = _blocks.num_rows(d, width)
    flat = x.reshape(-1)
    if (
        target is not None
        and target.platform == "gpu"
        and encode_lowers(target, rows, width, x.dtype)
    ):
        codes = _gpu_encode(flat, seeds, scale, bits=bits, stochastic=stochastic, target=target)
        return codes.reshape(x.shape)
    if rows * width != d:
        flat = jnp.pad(flat, (0, rows * width - d))
    x2d = flat.reshape(rows, width)
    if encode_lowers(target, rows, width, x.dtype):
        codes = encode_pallas(
            x2d,
            seeds,
            scale,
            bits=bits,
            stochastic=stochastic,
            interpret=target.interpret,
            platform=target.platform,
        )
    else:
        codes = encode_reference(x2d, seeds, scale, bits=bits, stochastic=stochastic)
    return codes.reshape(-1)[:d].reshape(x.shape)


def encode(
    x,
    seeds,
    scale,
    *,
    bits: int,
    stochastic: bool,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
):
    """Modulo encode of a float array of any shape into uint8 codes in [0, 2**bits).

    A code depends only on its element and its flat (row-major) index, so the
    kernel's [rows, width] view of x (rows of `_ROW` elements) does not change it.

    Args:
      x: float array of any shape.
      seeds: uint32[1, 2] hash seeds; required when `stochastic`.
      scale: float32 scalar 2**bits / B, with B Moniqua's modulo range B_theta.
      bits: code width, 1..8.
      stochastic: stochastic rounding; else nearest.
      implementation: None (Pallas on GPU/TPU, jnp on CPU), "xla" or "pallas",
        chosen per lowering platform (`platforms.dispatch`).
      interpret: run the Pallas kernel in interpret mode.

    Returns:
      uint8 codes in x's shape.
    """
    if stochastic and seeds is None:
        raise ValueError("stochastic rounding needs seeds (see seeds_from_key).")
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    scale = jnp.asarray(scale, jnp.float32)
    body = functools.partial(_encode_on, bits=numerics.check_bits(bits), stochastic=stochastic)
    return platforms.dispatch(implementation, body, x, seeds, scale, interpret=interpret)
