"""Shared pieces of the Pallas kernels: dispatch, the counter-based hash, layout helpers.

Every kernel in this package has a pure-jnp reference that is the single source
of truth and the CPU implementation. The element-wise math lives in small
functions that both the reference and the kernel body call, so the two compute
the same expression graph and agree bit for bit.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Implementation = Literal["xla", "pallas"] | None

_IMPLEMENTATIONS = (None, "xla", "pallas")


def resolve_implementation(implementation: Implementation) -> str:
    """Returns "xla" or "pallas" for an `implementation` argument.

    `None` picks Pallas on GPU and TPU and the fused jnp path on CPU, where Pallas
    only runs in (slow) interpret mode.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of None, 'xla', 'pallas'; got {implementation!r}."
        )
    if implementation is None:
        return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "xla"
    return implementation


def use_pallas(implementation: Implementation, *block_extents: int) -> bool:
    """Whether to run the Pallas kernel for blocks with these (static) extents.

    Triton needs power-of-two block extents; on GPU other shapes take the jnp path.
    """
    if resolve_implementation(implementation) != "pallas":
        return False
    return not is_gpu() or all(is_power_of_two(e) for e in block_extents)


def needs_interpret(interpret: bool) -> bool:
    """Pallas has no CPU lowering: on CPU a kernel always runs in interpret mode."""
    return interpret or jax.default_backend() == "cpu"


def compiler_params():
    """The one place that chooses the GPU lowering of lpdec's kernels.

    The kernels are written with plain `BlockSpec`s and element-wise/reduction ops,
    which the Triton lowering (jax 0.10) and Mosaic TPU both accept. jax 0.11
    deprecates Triton in favour of Mosaic GPU; switching means changing this
    function, not the kernels' call sites.
    """
    return None


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
# Layout: kernels see [rows, row_length] arrays; the wrappers pad ragged inputs.
# ----------------------------------------------------------------------------


def num_rows(num_elements: int, row_length: int) -> int:
    return -(-num_elements // row_length)


def pad_rows(x2d: jax.Array, rows: int) -> jax.Array:
    """Pads a [r, c] array to [rows, c] by repeating its last row (keeps per-row min/max)."""
    extra = rows - x2d.shape[0]
    if extra == 0:
        return x2d
    return jnp.pad(x2d, ((0, extra), (0, 0)), mode="edge")


def block_rows_for(rows: int, row_length: int, target_elements: int = 1 << 16) -> int:
    """A power-of-two number of rows per kernel block, about `target_elements` elements."""
    br = max(1, target_elements // max(row_length, 1))
    br = 1 << (br.bit_length() - 1)
    return int(min(br, 1 << max(rows - 1, 0).bit_length()))


def levels(bits: int) -> int:
    """Largest code of a `bits`-bit quantizer: 2**bits - 1."""
    return (1 << bits) - 1


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def np_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def is_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


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
    f = jnp.asarray(value, jnp.float32)
    u = jax.lax.bitcast_convert_type(f, jnp.uint32)
    u = (u + jnp.uint32(mask)) & jnp.uint32(~mask & 0xFFFFFFFF)
    return jax.lax.bitcast_convert_type(u, jnp.float32)
