"""The modulo encode's GPU (Triton) kernel on the flat array: any size, no padding.

A code depends only on its element and its flat index, so a grid step's tile
need not match any view of x: step s covers flat offsets [s * br * 1024,
(s + 1) * br * 1024) as a [br, 1024] tile, the elements past the array masked
off. The arithmetic is `modulo_jnp.encode_rows`, so the codes are the
reference's bit for bit. `modulo` dispatches to this kernel when a program is
lowered for a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lpdec.kernels_pallas import _blocks
from lpdec.kernels_pallas import modulo_jnp
from lpdec.kernels_pallas import platforms

# Row length of a grid step's tile.
_ROW = 1024


def lowers(size: int) -> bool:
    """Whether the kernel takes `size` elements: it needs Triton and int32 offsets."""
    return platforms.pallas_triton is not None and size < 2**31


def _encode_kernel(seeds_ref, scale_ref, x_ref, codes_ref, *, bits, stochastic, rows):
    row = pl.program_id(0) * rows + jax.lax.broadcasted_iota(jnp.int32, (rows, _ROW), 0)
    offsets = row * _ROW + jax.lax.broadcasted_iota(jnp.int32, (rows, _ROW), 1)
    valid = offsets < x_ref.shape[0]
    x = platforms.pallas_triton.load(x_ref.at[offsets], mask=valid, other=0)
    index = offsets.astype(jnp.uint32)
    codes = modulo_jnp.encode_rows(
        x, seeds_ref, scale_ref[0, 0], 0, bits=bits, stochastic=stochastic, index=index
    )
    platforms.pallas_triton.store(codes_ref.at[offsets], codes, mask=valid)


def encode(flat, seeds, scale, *, bits: int, stochastic: bool, target, block_rows=None):
    """GPU kernel: uint8 codes of a flat float array; `scale` a float32 scalar or [1, 1]."""
    d = flat.size
    br, steps = _blocks.flat_grid(target, _blocks.num_rows(d, _ROW), _ROW, block_rows)
    return target.pallas_call(
        functools.partial(_encode_kernel, bits=bits, stochastic=stochastic, rows=br),
        block_elements=br * _ROW,
        grid=(steps,),
        in_specs=[target.scalar_spec((1, 2)), target.scalar_spec((1, 1)), _blocks.whole(d)],
        out_specs=_blocks.whole(d),
        out_shape=_blocks.out_struct((d,), jnp.uint8, flat),
    )(seeds, jnp.asarray(scale, jnp.float32).reshape(1, 1), flat)
