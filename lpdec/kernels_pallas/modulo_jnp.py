"""Modulo encode in jnp: the arithmetic every path shares and the reference (the CPU path).

The row kernel of `modulo`, the flat GPU kernel of `modulo_gpu` and the
reference call `encode_rows` on their loaded values, so they agree bit for bit.
See `modulo`'s module docstring for the encode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lpdec.kernels_pallas import numerics

# Adding 2**23 to a float32 in [0, 2**23) rounds it to an integer (ties to even)
# held in the low mantissa bits: the sum's spacing is exactly 1.
_MAGIC = 2.0**23


def encode_rows(x, seeds, scale, row0, *, bits: int, stochastic: bool, index=None):
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
    return encode_rows(x2d, seeds, scale, 0, bits=bits, stochastic=stochastic)
