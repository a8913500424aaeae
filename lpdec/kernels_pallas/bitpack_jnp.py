"""Bit packing in jnp: the group arithmetic every path shares, the references, the CPU path.

The row kernels of `bitpack`, the flat GPU kernels of `bitpack_gpu` and the
references call these functions on their loaded values, so they agree bit for
bit. See `bitpack`'s module docstring for the bit stream.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lpdec.kernels_pallas import _blocks

#: Codes per group: 8 codes of b bits fill exactly b bytes.
GROUP = 8


def packed_size(num_elements: int, bits: int) -> int:
    """Bytes of `num_elements` codes of `bits` bits: ceil(num_elements * bits / 8)."""
    return -(-num_elements * bits // 8)


def _or_disjoint(piece: jax.Array) -> jax.Array:
    """uint8 bitwise or over the last axis of uint32 pieces < 256 with disjoint bits.

    Disjoint bits make the or a sum. It is summed as int32: Mosaic (TPU) has no
    reductions over unsigned integers.
    """
    return jnp.sum(piece.astype(jnp.int32), axis=-1, dtype=jnp.int32).astype(jnp.uint8)


def pack_groups(codes: jax.Array, bits: int, width: int | None = None) -> jax.Array:
    """[G, 8] codes -> [G, bits] bytes. Shared by the reference and the kernels.

    `width` > bits (the GPU kernel's power-of-two tile) adds bytes that stay 0.
    """
    c = (codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1))[:, None, :]
    shape = (1, width or bits, GROUP)
    j = jax.lax.broadcasted_iota(jnp.int32, shape, 1)  # output byte
    k = jax.lax.broadcasted_iota(jnp.int32, shape, 2)  # input code
    # Code k's bit t is stream bit k*b + t, i.e. bit (s + t) of byte j.
    s = k * bits - 8 * j
    valid = (s > -bits) & (s < 8)
    shl = jnp.clip(s, 0, 31).astype(jnp.uint32)
    shr = jnp.clip(-s, 0, 31).astype(jnp.uint32)
    piece = jnp.where(valid, ((c >> shr) << shl) & jnp.uint32(0xFF), jnp.uint32(0))
    return _or_disjoint(piece)


def unpack_groups(packed: jax.Array, bits: int) -> jax.Array:
    """[G, bits] bytes -> [G, 8] codes. Shared by the reference and the kernels.

    Bytes past the first `bits` of a row (the GPU kernel's tile) must be 0.
    """
    p = packed.astype(jnp.uint32)[:, None, :]
    shape = (1, GROUP, packed.shape[-1])
    k = jax.lax.broadcasted_iota(jnp.int32, shape, 1)  # output code
    j = jax.lax.broadcasted_iota(jnp.int32, shape, 2)  # input byte
    # Byte j's bit t is stream bit 8j + t, i.e. bit (s + t) of code k.
    s = 8 * j - k * bits
    valid = (s > -8) & (s < bits)
    shl = jnp.clip(s, 0, 31).astype(jnp.uint32)
    shr = jnp.clip(-s, 0, 31).astype(jnp.uint32)
    mask = jnp.uint32((1 << bits) - 1)
    piece = jnp.where(valid, ((p >> shr) << shl) & mask, jnp.uint32(0))
    return _or_disjoint(piece)


def pack_reference(codes: jax.Array, *, bits: int) -> jax.Array:
    """jnp reference: [G, 8] uint8 codes -> [G, bits] uint8 bytes."""
    return pack_groups(codes, bits)


def unpack_reference(packed: jax.Array, *, bits: int) -> jax.Array:
    """jnp reference: [G, bits] uint8 bytes -> [G, 8] uint8 codes."""
    return unpack_groups(packed, bits)


# ----------------------------------------------------------------------------
# The flat stream as groups: what the row kernels and the CPU path run on.
# ----------------------------------------------------------------------------


def code_groups(codes: jax.Array) -> jax.Array:
    """uint8[d] codes as [ceil(d / 8), 8] groups, the last one zero-padded."""
    d = codes.shape[0]
    groups = _blocks.num_rows(d, GROUP)
    return jnp.pad(codes.astype(jnp.uint8), (0, groups * GROUP - d)).reshape(groups, GROUP)


def byte_groups(packed: jax.Array, *, bits: int, num_elements: int) -> jax.Array:
    """The bytes of `num_elements` codes as [ceil(num_elements / 8), bits] groups."""
    groups = _blocks.num_rows(num_elements, GROUP)
    return jnp.pad(packed, (0, groups * bits - packed.shape[0])).reshape(groups, bits)
