"""What the kernels compute with: code widths, the counter-based hash, float rounding.

The element-wise math of every kernel and of its jnp reference calls these, so
the two compute the same expression graph and agree bit for bit; the compressors
call them too where they do that math outside a kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# ----------------------------------------------------------------------------
# Code widths.
# ----------------------------------------------------------------------------


def check_bits(bits) -> int:
    """Returns `bits` as an int if it is an integer in 1..8 (a code fits a byte), else raises."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8; got {bits!r}.")
    return int(bits)


def levels(bits: int) -> int:
    """Largest code of a `bits`-bit quantizer: 2**bits - 1."""
    return (1 << bits) - 1


# ----------------------------------------------------------------------------
# Counter-based hash for stochastic rounding.
#
# `lowbias32` is a 32-bit integer finaliser (two multiply-xorshift rounds) with
# low avalanche bias. Hashing (seed, element index) instead of drawing from a
# stateful generator means the bits depend only on the key and the element's
# position, so the jnp path, the Pallas kernel (any block size) and every
# backend draw identical bits.
# ----------------------------------------------------------------------------


def _lowbias32(h: jax.Array) -> jax.Array:
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def hash_uniform(seed0: jax.Array, seed1: jax.Array, index: jax.Array) -> jax.Array:
    """Uniform float32 in [0, 1) on a 2**-24 grid from a hash of (seeds, index).

    Args:
      seed0, seed1: uint32 scalars derived from a PRNG key.
      index: uint32 array of element indices.
    """
    h = _lowbias32(index ^ seed0)
    h = _lowbias32(h + seed1)
    return (h >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def seeds_from_key(key: jax.Array) -> jax.Array:
    """Two uint32 hash seeds from a PRNG key (raw uint32[2] or typed), shape (1, 2)."""
    return jax.random.bits(key, (1, 2), jnp.uint32)


def element_index(shape: tuple[int, int], row0, row_length: int) -> jax.Array:
    """Flat uint32 index of each element of a [rows, row_length] block whose first row is `row0`."""
    rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0) + jnp.asarray(row0, jnp.uint32)
    cols = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
    return rows * jnp.uint32(row_length) + cols


# ----------------------------------------------------------------------------
# Float rounding that does not depend on the program a value lands in.
# ----------------------------------------------------------------------------


def rounded(product: jax.Array) -> jax.Array:
    """Returns `product` rounded to its dtype before it feeds an add.

    XLA (CPU and GPU) lets LLVM contract `a * b + c` into a fused multiply-add,
    and whether it does depends on the fusion a kernel lands in: the same jnp
    expression can round once in one program and twice in another. A select on
    the product is opaque to contraction, so `rounded(a * b) + c` rounds twice
    everywhere. NaN stays NaN; the compare and select cost nothing next to the
    memory traffic.

    LLVM drops the select when it can prove the product is never NaN (an integer
    converted to float times a compile-time constant, say). Such products must be
    exact instead, which makes contraction harmless: see `round_up_significand`.
    """
    return jnp.where(jnp.isnan(product), jnp.asarray(jnp.nan, product.dtype), product)


def round_up_significand(value, bits: int = 16):
    """Smallest float32 >= `value` with at most `bits` significant bits (value > 0).

    A b-bit integer code times such a float32 is exact when b + bits <= 24, so
    the product rounds the same with or without fused multiply-adds. Accepts a
    Python number (returns a Python float) or a jax array (returns float32).
    """
    drop = 24 - bits
    mask = (1 << drop) - 1
    if isinstance(value, (int, float)):
        f = np.float32(value)
        if float(f) < value:
            f = np.nextafter(f, np.float32(np.inf))
        u = (int(np.array(f).view(np.uint32)) + mask) & ~mask & 0xFFFFFFFF
        return float(np.array(u, np.uint32).view(np.float32))
    traced = jnp.asarray(value, jnp.float32)
    word = jax.lax.bitcast_convert_type(traced, jnp.uint32)
    word = (word + jnp.uint32(mask)) & jnp.uint32(~mask & 0xFFFFFFFF)
    return jax.lax.bitcast_convert_type(word, jnp.float32)


def feedback_sum(update, residual, decay):
    """v = update + decay * residual in float32: what error feedback compresses.

    The product is `rounded`, so the sum rounds the same in every program (a
    fused multiply-add would round once).
    """
    decay = jnp.asarray(decay, jnp.float32)
    return update.astype(jnp.float32) + rounded(decay * residual.astype(jnp.float32))
