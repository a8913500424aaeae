"""Exact bit packing of b-bit codes (1 <= b <= 8) into uint8 bytes.

The codes form one little-endian bit stream: code `i` occupies stream bits
[i*b, (i+1)*b), and byte `m` holds stream bits [8m, 8m+8). Eight codes fill
exactly `b` bytes, so the kernels work on groups: a [G, 8] block of codes maps
to a [G, b] block of bytes. Because the stream is contiguous, truncating the
bytes of the last (zero-padded) group to ceil(d*b/8) keeps every real bit: a
payload of d codes is exactly ceil(d*b/8) bytes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _common

_GROUP = 8


def packed_size(num_elements: int, bits: int) -> int:
    """Bytes of `num_elements` codes of `bits` bits: ceil(num_elements * bits / 8)."""
    return -(-num_elements * bits // 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8; got {bits!r}.")


def _pack_groups(codes: jax.Array, bits: int) -> jax.Array:
    """[G, 8] codes -> [G, bits] bytes. Shared by the reference and the kernel."""
    c = (codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1))[:, None, :]
    shape = (1, bits, _GROUP)
    j = jax.lax.broadcasted_iota(jnp.int32, shape, 1)  # output byte
    k = jax.lax.broadcasted_iota(jnp.int32, shape, 2)  # input code
    # Code k's bit t is stream bit k*b + t, i.e. bit (s + t) of byte j.
    s = k * bits - 8 * j
    valid = (s > -bits) & (s < 8)
    shl = jnp.clip(s, 0, 31).astype(jnp.uint32)
    shr = jnp.clip(-s, 0, 31).astype(jnp.uint32)
    piece = jnp.where(valid, ((c >> shr) << shl) & jnp.uint32(0xFF), jnp.uint32(0))
    # Pieces occupy disjoint bits of a byte, so their sum is their bitwise or.
    return jnp.sum(piece, axis=2, dtype=jnp.uint32).astype(jnp.uint8)


def _unpack_groups(packed: jax.Array, bits: int) -> jax.Array:
    """[G, bits] bytes -> [G, 8] codes. Shared by the reference and the kernel."""
    p = packed.astype(jnp.uint32)[:, None, :]
    shape = (1, _GROUP, bits)
    k = jax.lax.broadcasted_iota(jnp.int32, shape, 1)  # output code
    j = jax.lax.broadcasted_iota(jnp.int32, shape, 2)  # input byte
    # Byte j's bit t is stream bit 8j + t, i.e. bit (s + t) of code k.
    s = 8 * j - k * bits
    valid = (s > -8) & (s < bits)
    shl = jnp.clip(s, 0, 31).astype(jnp.uint32)
    shr = jnp.clip(-s, 0, 31).astype(jnp.uint32)
    mask = jnp.uint32((1 << bits) - 1)
    piece = jnp.where(valid, ((p >> shr) << shl) & mask, jnp.uint32(0))
    return jnp.sum(piece, axis=2, dtype=jnp.uint32).astype(jnp.uint8)


def pack_reference(codes: jax.Array, *, bits: int) -> jax.Array:
    """jnp reference: [G, 8] uint8 codes -> [G, bits] uint8 bytes."""
    return _pack_groups(codes, bits)


def unpack_reference(packed: jax.Array, *, bits: int) -> jax.Array:
    """jnp reference: [G, bits] uint8 bytes -> [G, 8] uint8 codes."""
    return _unpack_groups(packed, bits)


def _pack_kernel(codes_ref, out_ref, *, bits):
    out_ref[...] = _pack_groups(codes_ref[...], bits)


def _unpack_kernel(packed_ref, out_ref, *, bits):
    out_ref[...] = _unpack_groups(packed_ref[...], bits)


@functools.partial(jax.jit, static_argnames=("bits", "block_groups", "interpret"))
def pack_pallas(
    codes: jax.Array, *, bits: int, block_groups: int = 4096, interpret: bool = False
) -> jax.Array:
    """Pallas kernel: [G, 8] uint8 codes -> [G, bits] uint8 bytes."""
    groups = codes.shape[0]
    bg = min(block_groups, _common.block_rows_for(groups, 1, block_groups))
    padded = _common.num_rows(groups, bg) * bg
    codes = jnp.pad(codes, ((0, padded - groups), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_pack_kernel, bits=bits),
        grid=(padded // bg,),
        in_specs=[pl.BlockSpec((bg, _GROUP), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((bg, bits), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, bits), jnp.uint8),
        interpret=_common.needs_interpret(interpret),
        compiler_params=_common.compiler_params(),
    )(codes)
    return out[:groups]


@functools.partial(jax.jit, static_argnames=("bits", "block_groups", "interpret"))
def unpack_pallas(
    packed: jax.Array, *, bits: int, block_groups: int = 4096, interpret: bool = False
) -> jax.Array:
    """Pallas kernel: [G, bits] uint8 bytes -> [G, 8] uint8 codes."""
    groups = packed.shape[0]
    bg = min(block_groups, _common.block_rows_for(groups, 1, block_groups))
    padded = _common.num_rows(groups, bg) * bg
    packed = jnp.pad(packed, ((0, padded - groups), (0, 0)))
    out = pl.pallas_call(
        functools.partial(_unpack_kernel, bits=bits),
        grid=(padded // bg,),
        in_specs=[pl.BlockSpec((bg, bits), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((bg, _GROUP), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((padded, _GROUP), jnp.uint8),
        interpret=_common.needs_interpret(interpret),
        compiler_params=_common.compiler_params(),
    )(packed)
    return out[:groups]


def pack_bits(
    codes: jax.Array,
    *,
    bits: int,
    implementation: _common.Implementation = None,
    interpret: bool = False,
) -> jax.Array:
    """Packs a flat uint8 array of `bits`-bit codes into ceil(d * bits / 8) bytes.

    Args:
      codes: uint8[d], each value < 2**bits (higher bits are ignored).
      bits: code width, 1..8.
      implementation: None (Pallas on GPU/TPU, jnp on CPU), "xla" or "pallas".
      interpret: run the Pallas kernel in interpret mode (tests on CPU).

    Returns:
      uint8[ceil(d * bits / 8)].
    """
    _check_bits(bits)
    if codes.ndim != 1:
        raise ValueError(f"codes must be 1-D; got shape {codes.shape}.")
    d = codes.shape[0]
    if bits == 8:
        return codes.astype(jnp.uint8)
    groups = _common.num_rows(d, _GROUP)
    grouped = jnp.pad(codes.astype(jnp.uint8), (0, groups * _GROUP - d)).reshape(groups, _GROUP)
    if _common.use_pallas(implementation, bits) and groups:
        out = pack_pallas(grouped, bits=bits, interpret=interpret)
    else:
        out = pack_reference(grouped, bits=bits)
    return out.reshape(-1)[: packed_size(d, bits)]


def unpack_bits(
    packed: jax.Array,
    *,
    bits: int,
    num_elements: int,
    implementation: _common.Implementation = None,
    interpret: bool = False,
) -> jax.Array:
    """Inverse of `pack_bits`: uint8[ceil(d * bits / 8)] -> uint8[d] codes."""
    _check_bits(bits)
    expected = packed_size(num_elements, bits)
    if packed.shape != (expected,):
        raise ValueError(
            f"packed must have shape ({expected},) for {num_elements} codes of {bits} bits; "
            f"got {packed.shape}."
        )
    if bits == 8:
        return packed
    groups = _common.num_rows(num_elements, _GROUP)
    grouped = jnp.pad(packed, (0, groups * bits - expected)).reshape(groups, bits)
    if _common.use_pallas(implementation, bits) and groups:
        out = unpack_pallas(grouped, bits=bits, interpret=interpret)
    else:
        out = unpack_reference(grouped, bits=bits)
    return out.reshape(-1)[:num_elements]
