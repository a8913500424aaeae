"""Moniqua's modulo encode (seed 003, Algorithm 1 line 3): q = Q((x / B) mod 1).

The unit circle [0, 1) carries 2**bits equally spaced points k / 2**bits, so a
code is ``round(2**bits * ((x / B) mod 1)) mod 2**bits`` (nearest) or the same
with ``floor(. + u)`` (stochastic rounding, u from the counter-based hash). The
wrap-around matters: 1 - 2**-(bits+1) rounds to the point 0, which keeps the
nearest-rounding error on the circle at 2**-(bits+1) even for 1 bit.

The kernel takes ``scale = 2**bits / B`` as a runtime float32 scalar, so a
schedule for theta (hence B) needs no recompilation. Non-finite inputs encode
to code 0; the compressor flags them separately.

The modules: this one holds the public op (`encode`), choosing per lowering
platform, and the row kernel (TPU, and any platform interpreted); `modulo_gpu`
the GPU's flat kernel; `modulo_jnp` the shared arithmetic and the reference,
which is the CPU path. Package-internal (not in `__all__`): `encode_on`, the op
for one `platforms.Target` (None: the jnp path), which `encode` runs under
`platforms.dispatch`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import modulo_gpu
from lpdec.kernels_pallas import modulo_jnp
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms
from lpdec.kernels_pallas.modulo_jnp import encode_reference

__all__ = [
    "encode",
    "encode_lowers",
    "encode_pallas",
    "encode_reference",
]

# Row length of the kernel's view of x; modulo codes have no per-row scales, so any works.
_ROW = 1024


def _encode_kernel(seeds_ref, scale_ref, x_ref, codes_ref, *, bits, stochastic):
    row0 = pl.program_id(0) * x_ref.shape[0]
    codes_ref[...] = modulo_jnp.encode_rows(
        x_ref[...], seeds_ref, scale_ref[0, 0], row0, bits=bits, stochastic=stochastic
    )


def encode_lowers(target, rows: int, width: int, dtype) -> bool:
    """Whether `target` runs the encode kernel on a [rows, width] `dtype` array.

    False for the jnp path (`target` None), for no rows, and where the platform's
    compiler rejects the blocks. The GPU kernel addresses the flat array itself
    (`modulo_gpu`): any width and size below 2**31 elements.
    """
    if target is None or not rows:
        return False
    if target.platform == "gpu":
        return modulo_gpu.lowers(rows * width)
    return _blocks.row_lowers(target, rows, [(width, dtype), (width, jnp.uint8)])


def _as_rows(x, rows: int, width: int):
    """x flattened and zero-padded to [rows, width]."""
    flat = x.reshape(-1)
    if rows * width != flat.size:
        flat = jnp.pad(flat, (0, rows * width - flat.size))
    return flat.reshape(rows, width)


def _encode_with(
    x, seeds, scale, *, rows: int, width: int, bits: int, stochastic: bool, target, block_rows=None
):
    """x's codes by `target`'s kernel: the GPU's on the flat array as it is, else the row
    kernel on x as `rows` rows of `width`."""
    if target.platform == "gpu":  # no padded copy
        codes = modulo_gpu.encode(
            x.reshape(-1),
            seeds,
            scale,
            bits=bits,
            stochastic=stochastic,
            target=target,
            block_rows=block_rows,
        )
        return codes.reshape(x.shape)
    (codes,) = _blocks.row_call(
        functools.partial(_encode_kernel, bits=bits, stochastic=stochastic),
        target,
        scalars=[seeds, jnp.asarray(scale, jnp.float32).reshape(1, 1)],
        inputs=[_as_rows(x, rows, width)],
        outputs=[(width, jnp.uint8)],
        block_rows=block_rows,
    )
    return codes.reshape(-1)[: x.size].reshape(x.shape)


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
    body = functools.partial(
        _encode_with,
        rows=x2d.shape[0],
        width=x2d.shape[1],
        bits=bits,
        stochastic=stochastic,
        block_rows=block_rows,
    )
    if platform is None:
        return platforms.on_each_platform(body, x2d, seeds, scale, interpret=interpret)
    return body(x2d, seeds, scale, target=platforms.Target(platform, interpret))


def encode_on(x, seeds, scale, *, bits: int, stochastic: bool, target):
    """The encode `target` runs on x viewed as rows of `_ROW`: its kernel, or the jnp reference."""
    width = max(1, min(_ROW, x.size))
    rows = _blocks.num_rows(x.size, width)
    if encode_lowers(target, rows, width, x.dtype):
        return _encode_with(
            x, seeds, scale, rows=rows, width=width, bits=bits, stochastic=stochastic, target=target
        )
    x2d = _as_rows(x, rows, width)
    codes = encode_reference(x2d, seeds, scale, bits=bits, stochastic=stochastic)
    return codes.reshape(-1)[: x.size].reshape(x.shape)


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
    body = functools.partial(encode_on, bits=numerics.check_bits(bits), stochastic=stochastic)
    return platforms.dispatch(implementation, body, x, seeds, scale, interpret=interpret)
