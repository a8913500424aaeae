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

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import numerics
from lpdec.kernels_pallas import platforms

_GROUP = 8


def packed_size(num_elements: int, bits: int) -> int:
    """Bytes of `num_elements` codes of `bits` bits: ceil(num_elements * bits / 8)."""
    return -(-num_elements * bits // 8)


def _or_disjoint(piece: jax.Array) -> jax.Array:
    """uint8 bitwise or over the last axis of uint32 pieces < 256 with disjoint bits.

    Disjoint bits make the or a sum. It is summed as int32: Mosaic (TPU) has no
    reductions over unsigned integers.
    """
    return jnp.sum(piece.astype(jnp.int32), axis=-1, dtype=jnp.int32).astype(jnp.uint8)


def _pack_groups(codes: jax.Array, bits: int, width: int | None = None) -> jax.Array:
    """[G, 8] codes -> [G, bits] bytes. Shared by the reference and the kernels.

    `width` > bits (the GPU kernel's power-of-two tile) adds bytes that stay 0.
    """
    c = (codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1))[:, None, :]
    shape = (1, width or bits, _GROUP)
    j = jax.lax.broadcasted_iota(jnp.int32, shape, 1)  # output byte
    k = jax.lax.broadcasted_iota(jnp.int32, shape, 2)  # input code
    # Code k's bit t is stream bit k*b + t, i.e. bit (s + t) of byte j.
    s = k * bits - 8 * j
    valid = (s > -bits) & (s < 8)
    shl = jnp.clip(s, 0, 31).astype(jnp.uint32)
    shr = jnp.clip(-s, 0, 31).astype(jnp.uint32)
    piece = jnp.where(valid, ((c >> shr) << shl) & jnp.uint32(0xFF), jnp.uint32(0))
    return _or_disjoint(piece)


def _unpack_groups(packed: jax.Array, bits: int) -> jax.Array:
    """[G, bits] bytes -> [G, 8] codes. Shared by the reference and the kernels.

    Bytes past the first `bits` of a row (the GPU kernel's tile) must be 0.
    """
    p = packed.astype(jnp.uint32)[:, None, :]
    shape = (1, _GROUP, packed.shape[-1])
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
    return _pack_groups(codes, bits)


def unpack_reference(packed: jax.Array, *, bits: int) -> jax.Array:
    """jnp reference: [G, bits] uint8 bytes -> [G, 8] uint8 codes."""
    return _unpack_groups(packed, bits)


def _pack_kernel(codes_ref, out_ref, *, bits):
    out_ref[...] = _pack_groups(codes_ref[...], bits)


def _unpack_kernel(packed_ref, out_ref, *, bits):
    out_ref[...] = _unpack_groups(packed_ref[...], bits)


# A group moves 8 codes in and `bits` bytes out (or back): a block's size counts 16
# elements a group.
_GROUP_ELEMENTS = 2 * _GROUP


def pack_lowers(target, groups: int, bits: int) -> bool:
    """Whether `target` runs the pack/unpack kernels on `groups` groups of `bits`-bit codes.

    False for the jnp path (`target` None), for no groups, and where the platform's
    compiler rejects the blocks. The GPU kernels address the flat arrays
    themselves (`_gpu_pack`): every width, any size below 2**31 codes.
    """
    if target is None or not groups:
        return False
    if target.platform == "gpu":
        return platforms.pallas_triton is not None and groups * _GROUP < 2**31
    operands = [(_GROUP, jnp.uint8), (bits, jnp.uint8)]
    return _blocks.row_lowers(target, groups, operands, row_length=_GROUP_ELEMENTS)


# ----------------------------------------------------------------------------
# GPU (Triton) kernels on the flat arrays. A grid step takes `bg` groups: codes
# at offsets 8g + k, bytes at bits * g + j for j below the power-of-two tile
# width; loads and stores past the arrays (and past `bits` bytes of a group) are
# masked, so every width compiles and nothing is padded (minmax's GPU kernels
# do the same for chunks).
# ----------------------------------------------------------------------------


def _gpu_group_offsets(bg: int, width: int, stride: int, limit: int):
    group = pl.program_id(0) * bg + jax.lax.broadcasted_iota(jnp.int32, (bg, width), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (bg, width), 1)
    offsets = group * stride + col
    return offsets, (col < stride) & (offsets < limit)


def _gpu_pack_kernel(codes_ref, out_ref, *, bits, bg, width):
    code_offsets, code_valid = _gpu_group_offsets(bg, _GROUP, _GROUP, codes_ref.shape[0])
    codes = platforms.pallas_triton.load(codes_ref.at[code_offsets], mask=code_valid, other=0)
    packed = _pack_groups(codes, bits, width)
    offsets, valid = _gpu_group_offsets(bg, width, bits, out_ref.shape[0])
    platforms.pallas_triton.store(out_ref.at[offsets], packed, mask=valid)


def _gpu_unpack_kernel(packed_ref, out_ref, *, bits, bg, width):
    offsets, valid = _gpu_group_offsets(bg, width, bits, packed_ref.shape[0])
    packed = platforms.pallas_triton.load(packed_ref.at[offsets], mask=valid, other=0)
    codes = _unpack_groups(packed, bits)
    code_offsets, code_valid = _gpu_group_offsets(bg, _GROUP, _GROUP, out_ref.shape[0])
    platforms.pallas_triton.store(out_ref.at[code_offsets], codes, mask=code_valid)


def _gpu_call(kernel, flat, *, out_size: int, groups: int, bits: int, target, block_groups=None):
    width = 1 << (bits - 1).bit_length()
    bg, steps = _blocks.flat_grid(target, groups, _GROUP_ELEMENTS, block_groups)
    return target.pallas_call(
        functools.partial(kernel, bits=bits, bg=bg, width=width),
        block_elements=bg * _GROUP_ELEMENTS,
        grid=(steps,),
        in_specs=[_blocks.whole(flat.size)],
        out_specs=_blocks.whole(out_size),
        out_shape=_blocks.out_struct((out_size,), jnp.uint8, flat),
    )(flat)


def _gpu_pack(codes, *, bits: int, target, block_groups=None):
    """GPU kernel: uint8[d] codes -> uint8[ceil(d * bits / 8)] bytes."""
    d = codes.size
    return _gpu_call(
        _gpu_pack_kernel,
        codes.reshape(-1).astype(jnp.uint8),
        out_size=packed_size(d, bits),
        groups=_blocks.num_rows(d, _GROUP),
        bits=bits,
        target=target,
        block_groups=block_groups,
    )


def _gpu_unpack(packed, *, bits: int, num_elements: int, target, block_groups=None):
    """GPU kernel: uint8[ceil(d * bits / 8)] bytes -> uint8[d] codes."""
    return _gpu_call(
        _gpu_unpack_kernel,
        packed.reshape(-1),
        out_size=num_elements,
        groups=_blocks.num_rows(num_elements, _GROUP),
        bits=bits,
        target=target,
        block_groups=block_groups,
    )


def _group_call(kernel, grouped, *, width_out, bits, block_groups, target):
    groups = grouped.shape[0]
    if target.platform == "gpu":  # [G, 8] <-> [G, bits] as the flat arrays they are
        if kernel is _pack_kernel:
            out = _gpu_pack(grouped, bits=bits, target=target, block_groups=block_groups)
        else:
            out = _gpu_unpack(
                grouped,
                bits=bits,
                num_elements=groups * _GROUP,
                target=target,
                block_groups=block_groups,
            )
        return out.reshape(groups, width_out)
    (out,) = _blocks.row_call(
        functools.partial(kernel, bits=bits),
        target,
        inputs=[grouped],
        outputs=[(width_out, jnp.uint8)],
        block_rows=block_groups,
        row_length=_GROUP_ELEMENTS,
    )
    return out


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
    body = functools.partial(
        _group_call,
        _pack_kernel,
        width_out=bits,
        bits=bits,
        block_groups=block_groups,
    )
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
    body = functools.partial(
        _group_call,
        _unpack_kernel,
        width_out=_GROUP,
        bits=bits,
        block_groups=block_groups,
    )
    if platform is None:
        return platforms.on_each_platform(body, packed, interpret=interpret)
    return body(packed, target=platforms.Target(platform, interpret))


def _pack_bits_on(codes: jax.Array, *, bits: int, target) -> jax.Array:
    """The `pack_bits` that `target` runs: its kernel, or the jnp reference (`pack_lowers`)."""
    if codes.ndim != 1:
        raise ValueError(f"codes must be 1-D; got shape {codes.shape}.")
    d = codes.shape[0]
    if bits == 8:
        return codes.astype(jnp.uint8)
    groups = _blocks.num_rows(d, _GROUP)
    if target is not None and target.platform == "gpu" and pack_lowers(target, groups, bits):
        return _gpu_pack(codes, bits=bits, target=target)
    grouped = jnp.pad(codes.astype(jnp.uint8), (0, groups * _GROUP - d)).reshape(groups, _GROUP)
    if pack_lowers(target, groups, bits):
        out = pack_pallas(grouped, bits=bits, interpret=target.interpret, platform=target.platform)
    else:
        out = pack_reference(grouped, bits=bits)
    return out.reshape(-1)[: packed_size(d, bits)]


def _unpack_bits_on(packed: jax.Array, *, bits: int, num_elements: int, target) -> jax.Array:
    """The `unpack_bits` that `target` runs: its kernel, or the jnp reference."""
    expected = packed_size(num_elements, bits)
    if packed.shape != (expected,):
        raise ValueError(
            f"packed must have shape ({expected},) for {num_elements} codes of {bits} bits; "
            f"got {packed.shape}."
        )
    if bits == 8:
        return packed
    groups = _blocks.num_rows(num_elements, _GROUP)
    if target is not None and target.platform == "gpu" and pack_lowers(target, groups, bits):
        return _gpu_unpack(packed, bits=bits, num_elements=num_elements, target=target)
    grouped = jnp.pad(packed, (0, groups * bits - expected)).reshape(groups, bits)
    if pack_lowers(target, groups, bits):
        out = unpack_pallas(
            grouped, bits=bits, interpret=target.interpret, platform=target.platform
        )
    else:
        out = unpack_reference(grouped, bits=bits)
    return out.reshape(-1)[:num_elements]


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
    body = functools.partial(_pack_bits_on, bits=numerics.check_bits(bits))
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
        _unpack_bits_on, bits=numerics.check_bits(bits), num_elements=num_elements
    )
    return platforms.dispatch(implementation, body, packed, interpret=interpret)
