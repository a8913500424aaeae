"""Bit packing's GPU (Triton) kernels on the flat arrays: every width, any size, no padding.

Triton blocks need power-of-two extents, which a [groups, bits] block of bytes
has only for 1, 2, 4 and 8 bits. These kernels take the flat arrays whole and
address them themselves: a grid step takes `bg` groups, codes at offsets
8g + k and bytes at bits * g + j for j below the power-of-two tile width;
loads and stores past the arrays (and past `bits` bytes of a group) are
masked, so every width compiles and nothing is padded (`minmax_gpu` does the
same for chunks). The arithmetic is `bitpack_jnp`'s, so the bytes are the
references' bit for bit. `bitpack` dispatches to these kernels when a program
is lowered for a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import bitpack_jnp
from lpdec.kernels_pallas import platforms
from lpdec.kernels_pallas.bitpack_jnp import GROUP


def lowers(num_codes: int) -> bool:
    """Whether the kernels take `num_codes` codes: they need Triton and int32 offsets."""
    return platforms.pallas_triton is not None and num_codes < 2**31


def _group_offsets(bg: int, width: int, stride: int, limit: int):
    group = pl.program_id(0) * bg + jax.lax.broadcasted_iota(jnp.int32, (bg, width), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (bg, width), 1)
    offsets = group * stride + col
    return offsets, (col < stride) & (offsets < limit)


def _pack_kernel(codes_ref, out_ref, *, bits, bg, width):
    code_offsets, code_valid = _group_offsets(bg, GROUP, GROUP, codes_ref.shape[0])
    codes = platforms.pallas_triton.load(codes_ref.at[code_offsets], mask=code_valid, other=0)
    packed = bitpack_jnp.pack_groups(codes, bits, width)
    offsets, valid = _group_offsets(bg, width, bits, out_ref.shape[0])
    platforms.pallas_triton.store(out_ref.at[offsets], packed, mask=valid)


def _unpack_kernel(packed_ref, out_ref, *, bits, bg, width):
    offsets, valid = _group_offsets(bg, width, bits, packed_ref.shape[0])
    packed = platforms.pallas_triton.load(packed_ref.at[offsets], mask=valid, other=0)
    codes = bitpack_jnp.unpack_groups(packed, bits)
    code_offsets, code_valid = _group_offsets(bg, GROUP, GROUP, out_ref.shape[0])
    platforms.pallas_triton.store(out_ref.at[code_offsets], codes, mask=code_valid)


# A group moves 8 codes in and `bits` bytes out (or back): a grid step's size
# counts 16 elements a group.
_GROUP_ELEMENTS = 2 * GROUP


def _call(kernel, flat, *, out_size: int, groups: int, bits: int, target, block_groups=None):
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


def pack(codes, *, bits: int, target, block_groups=None):
    """GPU kernel: uint8[d] codes -> uint8[ceil(d * bits / 8)] bytes."""
    d = codes.size
    return _call(
        _pack_kernel,
        codes.reshape(-1).astype(jnp.uint8),
        out_size=bitpack_jnp.packed_size(d, bits),
        groups=_blocks.num_rows(d, GROUP),
        bits=bits,
        target=target,
        block_groups=block_groups,
    )


def unpack(packed, *, bits: int, num_elements: int, target, block_groups=None):
    """GPU kernel: uint8[ceil(d * bits / 8)] bytes -> uint8[d] codes."""
    return _call(
        _unpack_kernel,
        packed.reshape(-1),
        out_size=num_elements,
        groups=_blocks.num_rows(num_elements, GROUP),
        bits=bits,
        target=target,
        block_groups=block_groups,
    )
