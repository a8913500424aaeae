"""Exact bit packing of b-bit codes (1 <= b <= 8) into uint8 bytes.

The codes form one little-endian bit stream: code `i` occupies stream bits
[i*b, (i+1)*b), and byte `m` holds stream bits [8m, 8m+8). Eight codes fill
exactly `b` bytes, so the kernels work on groups: a [G, 8] block of codes maps
to a [G, b] block of bytes. Because the stream is contiguous, truncating the
bytes of the last (zero-padded) group to ceil(d*b/8) keeps every real bit: a
payload of d codes is exactly ceil(d*b/8) bytes.

The modules: this one holds the public ops (`pack_bits`, `unpack_bits`), each
choosing per lowering platform, and the row kernels on [G, 8] codes and
[G, b] bytes (TPU, and any platform interpreted); `bitpack_gpu` the GPU's flat
kernels; `bitpack_jnp` the shared arithmetic, the references and the CPU path.

Package-internal (not in `__all__`; for the ops that pack their codes, `minmax`
and `mx`): `pack_bits_on` and `unpack_bits_on`, the ops for one
`platforms.Target` (None: the jnp path), which the public ops run under
`platforms.dispatch`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import bitpack_gpu
from lpdec.kernels_pallas import bitpack_jnp
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms
from lpdec.kernels_pallas.bitpack_jnp import GROUP
from lpdec.kernels_pallas.bitpack_jnp import pack_reference
from lpdec.kernels_pallas.bitpack_jnp import packed_size
from lpdec.kernels_pallas.bitpack_jnp import unpack_reference

__all__ = [
    "pack_bits",
    "pack_lowers",
    "pack_pallas",
    "pack_reference",
    "packed_size",
    "unpack_bits",
    "unpack_pallas",
    "unpack_reference",
]

# A group moves 8 codes in and `bits` bytes out (or back): a block's size counts
# 16 elements a group.
_GROUP_ELEMENTS = 2 * GROUP


def _pack_kernel(codes_ref, out_ref, *, bits):
    out_ref[...] = bitpack_jnp.pack_groups(codes_ref[...], bits)


def _unpack_kernel(packed_ref, out_ref, *, bits):
    out_ref[...] = bitpack_jnp.unpack_groups(packed_ref[...], bits)


def pack_lowers(target, groups: int, bits: int) -> bool:
    """Whether `target` runs the pack/unpack kernels on `groups` groups of `bits`-bit codes.

    False for the jnp path (`target` None), for no groups, and where the platform's
    compiler rejects the blocks. The GPU kernels address the flat arrays
    themselves (`bitpack_gpu`): every width, any size below 2**31 codes.
    """
    if target is None or not groups:
        return False
    if target.platform == "gpu":
        return bitpack_gpu.lowers(groups * GROUP)
    operands = [(GROUP, jnp.uint8), (bits, jnp.uint8)]
    return _blocks.row_lowers(target, groups, operands, row_length=_GROUP_ELEMENTS)


def _pack_with(codes, *, bits: int, target, block_groups=None):
    """uint8[d] codes -> bytes by `target`'s kernel: the GPU's on the flat arrays, else
    the row kernel on groups."""
    if target.platform == "gpu":
        return bitpack_gpu.pack(codes, bits=bits, target=target, block_groups=block_groups)
    (out,) = _blocks.row_call(
        functools.partial(_pack_kernel, bits=bits),
        target,
        inputs=[bitpack_jnp.code_groups(codes)],
        outputs=[(bits, jnp.uint8)],
        block_rows=block_groups,
        row_length=_GROUP_ELEMENTS,
    )
    return out.reshape(-1)[: packed_size(codes.shape[0], bits)]


def _unpack_with(packed, *, bits: int, num_elements: int, target, block_groups=None):
    """Bytes -> uint8[num_elements] codes by `target`'s kernel (see `_pack_with`)."""
    if target.platform == "gpu":
        return bitpack_gpu.unpack(
            packed, bits=bits, num_elements=num_elements, target=target, block_groups=block_groups
        )
    (out,) = _blocks.row_call(
        functools.partial(_unpack_kernel, bits=bits),
        target,
        inputs=[bitpack_jnp.byte_groups(packed, bits=bits, num_elements=num_elements)],
        outputs=[(GROUP, jnp.uint8)],
        block_rows=block_groups,
        row_length=_GROUP_ELEMENTS,
    )
    return out.reshape(-1)[:num_elements]


@functools.partial(jax.jit, static_argnames=("bits", "block_groups", "interpret", "platform"))
def pack_pallas(
    codes: jax.Array,
    *,
    bits: int,
    block_groups: int | None = None,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
) -> jax.Array:
    """Pallas kernel: [G, 8] uint8 codes -> [G, bits] uint8 bytes.

    `platform` ("cpu", "gpu", "tpu") builds the kernel that platform compiles
    (`platforms.Target`); None takes the lowering platform's, interpreted on CPU.
    `interpret` interprets it.
    """

    def body(codes, *, target):
        packed = _pack_with(codes.reshape(-1), bits=bits, target=target, block_groups=block_groups)
        return packed.reshape(codes.shape[0], bits)

    if platform is None:
        return platforms.on_each_platform(body, codes, interpret=interpret)
    return body(codes, target=platforms.Target(platform, interpret))


@functools.partial(jax.jit, static_argnames=("bits", "block_groups", "interpret", "platform"))
def unpack_pallas(
    packed: jax.Array,
    *,
    bits: int,
    block_groups: int | None = None,
    interpret: bool = False,
    platform: platforms.Platform | None = None,
) -> jax.Array:
    """Pallas kernel: [G, bits] uint8 bytes -> [G, 8] uint8 codes (see pack_pallas)."""

    def body(packed, *, target):
        groups = packed.shape[0]
        codes = _unpack_with(
            packed.reshape(-1),
            bits=bits,
            num_elements=groups * GROUP,
            target=target,
            block_groups=block_groups,
        )
        return codes.reshape(groups, GROUP)

    if platform is None:
        return platforms.on_each_platform(body, packed, interpret=interpret)
    return body(packed, target=platforms.Target(platform, interpret))


def pack_bits_on(codes: jax.Array, *, bits: int, target) -> jax.Array:
    """The `pack_bits` that `target` runs: its kernel, or the jnp reference (`pack_lowers`)."""
    if codes.ndim != 1:
        raise ValueError(f"codes must be 1-D; got shape {codes.shape}.")
    d = codes.shape[0]
    if bits == 8:
        return codes.astype(jnp.uint8)
    if pack_lowers(target, _blocks.num_rows(d, GROUP), bits):
        return _pack_with(codes, bits=bits, target=target)
    packed = pack_reference(bitpack_jnp.code_groups(codes), bits=bits)
    return packed.reshape(-1)[: packed_size(d, bits)]


def unpack_bits_on(packed: jax.Array, *, bits: int, num_elements: int, target) -> jax.Array:
    """The `unpack_bits` that `target` runs: its kernel, or the jnp reference."""
    expected = packed_size(num_elements, bits)
    if packed.shape != (expected,):
        raise ValueError(
            f"packed must have shape ({expected},) for {num_elements} codes of {bits} bits; "
            f"got {packed.shape}."
        )
    if bits == 8:
        return packed
    if pack_lowers(target, _blocks.num_rows(num_elements, GROUP), bits):
        return _unpack_with(packed, bits=bits, num_elements=num_elements, target=target)
    grouped = bitpack_jnp.byte_groups(packed, bits=bits, num_elements=num_elements)
    return unpack_reference(grouped, bits=bits).reshape(-1)[:num_elements]


def pack_bits(
    codes: jax.Array,
    *,
    bits: int,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
) -> jax.Array:
    """Packs a flat uint8 array of `bits`-bit codes into ceil(d * bits / 8) bytes.

    Args:
      codes: uint8[d], each value < 2**bits (higher bits are ignored).
      bits: code width, 1..8.
      implementation: None (Pallas on GPU/TPU, jnp on CPU), "xla" or "pallas",
        chosen per lowering platform (`platforms.dispatch`).
      interpret: run the Pallas kernel in interpret mode (tests on CPU).

    Returns:
      uint8[ceil(d * bits / 8)].
    """
    body = functools.partial(pack_bits_on, bits=numerics.check_bits(bits))
    return platforms.dispatch(implementation, body, codes, interpret=interpret)


def unpack_bits(
    packed: jax.Array,
    *,
    bits: int,
    num_elements: int,
    implementation: platforms.Implementation = None,
    interpret: bool = False,
) -> jax.Array:
    """Inverse of `pack_bits`: uint8[ceil(d * bits / 8)] -> uint8[d] codes."""
    body = functools.partial(
        unpack_bits_on, bits=numerics.check_bits(bits), num_elements=num_elements
    )
    return platforms.dispatch(implementation, body, packed, interpret=interpret)
