"""How the kernels lay their operands out in blocks: row counts, padding, BlockSpecs.

Package-internal: every name here serves the kernels of `lpdec.kernels_pallas`;
code outside the package uses the ops `lpdec.kernels_pallas` exports.

Every kernel takes one of two layouts. A row kernel (TPU's, and any platform's
interpreted) sees [rows, width] arrays, a block of whole rows per grid step,
with the rows padded to whole blocks and sliced back after. A GPU kernel takes
each flat array whole (`whole`) and addresses a tile of it per grid step
(`flat_grid` sizes the steps), so nothing is padded.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# (block_shape, array_shape, dtype) of one operand of a pallas_call.
Block = tuple[tuple[int, ...], tuple[int, ...], Any]


def num_rows(num_elements: int, row_length: int) -> int:
    """Rows of `row_length` that hold `num_elements`: ceil(num_elements / row_length)."""
    return -(-num_elements // row_length)


def pad_rows(x2d: jax.Array, rows: int) -> jax.Array:
    """A [r, c] array padded with zero rows to [rows, c].

    A row kernel computes each row from that row alone, so what the padding
    holds reaches no row that is kept.
    """
    extra = rows - x2d.shape[0]
    if extra == 0:
        return x2d
    return jnp.pad(x2d, ((0, extra), (0, 0)))


def block_rows_for(rows: int, row_length: int, target_elements: int = 1 << 16) -> int:
    """A power-of-two number of rows per kernel block, about `target_elements` elements."""
    br = max(1, target_elements // max(row_length, 1))
    br = 1 << (br.bit_length() - 1)
    return int(min(br, 1 << max(rows - 1, 0).bit_length()))


@dataclasses.dataclass(frozen=True)
class RowGrid:
    """A row kernel's grid: `block_rows` rows of every [rows, width] operand a step.

    Attributes:
      rows: the operands' rows.
      block_rows: rows per grid step.
      row_length: the elements a row counts for the block size (the compiler
        parameters read `block_rows * row_length`).
      operands: (width, dtype) of each row operand, inputs and outputs.
    """

    rows: int
    block_rows: int
    row_length: int
    operands: tuple[tuple[int, Any], ...]

    @property
    def padded(self) -> int:
        """Rows rounded up to whole blocks: what the kernel runs on."""
        return num_rows(self.rows, self.block_rows) * self.block_rows

    @property
    def steps(self) -> int:
        return self.padded // self.block_rows

    @property
    def blocks(self) -> list[Block]:
        """Each operand's (block, array, dtype), for `platforms.Target.lowers`."""
        return [((self.block_rows, w), (self.padded, w), d) for w, d in self.operands]


def row_grid(target, rows: int, operands, *, block_rows=None, row_length=None) -> RowGrid:
    """The grid of a row kernel on `target` over [rows, width] operands.

    `operands`: (width, dtype) of each row operand, inputs and outputs. `block_rows`
    None: `target.block_rows` for rows of `row_length` elements (default: the
    widest operand's) holding every operand's dtype.
    """
    operands = tuple((int(w), jnp.dtype(d)) for w, d in operands)
    row_length = row_length or max(w for w, _ in operands)
    dtypes = tuple(d for _, d in operands)
    br = block_rows or target.block_rows(rows, row_length, dtypes)
    return RowGrid(rows, br, row_length, operands)


def row_lowers(target, rows: int, operands, *, block_rows=None, row_length=None) -> bool:
    """Whether `target` compiles a row kernel over these operands (see `row_grid`).

    False for the jnp path (`target` None) and for no rows.
    """
    if target is None or not rows:
        return False
    grid = row_grid(target, rows, operands, block_rows=block_rows, row_length=row_length)
    return target.lowers(*grid.blocks)


def row_call(
    kernel,
    target,
    *,
    inputs,
    outputs,
    scalars=(),
    block_rows: int | None = None,
    row_length: int | None = None,
    input_output_aliases=None,
) -> list[jax.Array]:
    """`kernel` on `target` over [rows, width] arrays, a block of whole rows a grid step.

    The one `pallas_call` of every row kernel: min-max's and MX's quantize,
    dequantize and dequantize-accumulate (data [rows, width] beside one scale
    per row, [rows, 1]), modulo's encode and the bit packing. The inputs are
    padded to whole blocks (`pad_rows`) and the outputs sliced back.

    Args:
      kernel: the body: a ref per scalar, per input, then per output. A block's
        refs hold its rows: grid step i starts at row i * ref.shape[0].
      target: the `platforms.Target` to build for.
      inputs: [rows, width] arrays (the same rows).
      outputs: (width, dtype) of each [rows, width] output.
      scalars: small arrays every grid step reads whole, passed before the inputs
        (hash seeds, a weight): `target.scalar_spec`.
      block_rows, row_length: as `row_grid`'s.
      input_output_aliases: as `pl.pallas_call`'s, counting the scalars first.

    Returns:
      the outputs, a list.
    """
    rows = inputs[0].shape[0]
    operands = [*((x.shape[1], x.dtype) for x in inputs), *outputs]
    grid = row_grid(target, rows, operands, block_rows=block_rows, row_length=row_length)
    br = grid.block_rows
    outs = target.pallas_call(
        kernel,
        block_elements=br * grid.row_length,
        grid=(grid.steps,),
        in_specs=[
            *(target.scalar_spec(s.shape) for s in scalars),
            *(row_spec(br, x.shape[1]) for x in inputs),
        ],
        out_specs=[row_spec(br, w) for w, _ in outputs],
        out_shape=[out_struct((grid.padded, w), d, inputs[0]) for w, d in outputs],
        input_output_aliases=input_output_aliases or {},
    )(*scalars, *(pad_rows(x, grid.padded) for x in inputs))
    return [out[:rows] for out in outs]


def flat_grid(target, rows: int, row_length: int, block_rows: int | None = None):
    """(rows per grid step, grid steps) of a flat kernel over `rows` rows of `row_length`.

    `block_rows` None: about `target.block_elements` elements a step.
    """
    br = block_rows or block_rows_for(rows, row_length, target.block_elements)
    return br, num_rows(rows, br)


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def np_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def out_struct(shape: tuple[int, ...], dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel output's shape and dtype, varying over the mesh axes that `like` varies over.

    Under `jax.shard_map(check_vma=True)` a `pallas_call` must be told how each
    output varies; the kernels' outputs are per node, like their data input.
    """
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def row_spec(block_rows: int, width: int) -> pl.BlockSpec:
    """BlockSpec of a [rows, width] array whose grid step i takes rows from i * block_rows."""
    return pl.BlockSpec((block_rows, width), lambda i: (i, 0))


def whole(shape: int | tuple[int, ...]) -> pl.BlockSpec:
    """BlockSpec of an array every grid step sees whole (a flat kernel addresses it itself)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
