"""Min-max's Mosaic GPU kernels: the per-chunk quantize and dequantize for `plgpu.kernel`.

`minmax` quantizes with the row kernel here on a jax without Pallas Triton
(`minmax.mosaic_quantizes`, the one place that chooses it); with Triton, the
kernels of `minmax_gpu` run. jax 0.11 deprecates Pallas's Triton
lowering in favour of Mosaic GPU, and from jax 0.11 `pl.pallas_call` with Mosaic
GPU compiler parameters no longer lowers (an AssertionError in pallas_call's GPU
lowering); the supported entry point is `plgpu.kernel`, used here. It lowers to
the `mosaic_gpu_v2` custom call on jax 0.10.2, 0.11.2 and 0.12.

The kernels compute exactly what `minmax.quantize_reference` and
`minmax.dequantize_reference` compute, with the same element-wise helpers
(`minmax_jnp.order_key`, `minmax_jnp.codes_from_levels`, `minmax_jnp.dequantize_rows`,
`numerics.hash_uniform`): nearest and stochastic rounding, any `bits`. Only
stochastic rounding's floor is written differently (`_floor_codes`), since
Mosaic GPU has no `floor` lowering on jax 0.10.2.

Layout: one CTA (one Pallas thread = one warpgroup of 128 CUDA lanes) per row.
The row is read straight from global memory into registers in the warpgroup-
strided layout (`plgpu.Layout.WG_STRIDED`), reduced over all its elements (the
strided layout reduces only over every axis, so a row is a 1-D value), and the
codes are stored straight back. No shared memory and no TMA: a TMA copy moves at
most 256 elements along each dimension (jax 0.10.2: "Async copies only support
copying <=256 elements along each dimension"), so a 2048-element row would take
several copies, and the hardware wants 16-byte row strides, which a 1000-byte
uint8 row does not have.

Shape constraints (what Mosaic GPU needs, not a power of two as Triton does):

* A row in registers needs the strided layout, which exists only when the row
  length is a multiple of 128 (one warpgroup); any multiple works (1152 = 9 x
  128 lowers). Other lengths do not lower: jax 0.10.2 says "memref<1000xf32>
  must have a number of elements that is a multiple of 128", jax 0.11/0.12
  "Failed to infer a possible set of layouts". `quantize`/`dequantize` below
  pad a row to the next multiple of 128 with its own last value (which keeps
  the row's min and max), or with code 0, and slice the padding off: one extra
  copy of the input when `chunk % 128 != 0`, none otherwise.
* Per-row scales are scalars: a [1] array has no register layout, so lo and
  unit are read with scalar loads, and the reductions keep a [1] dim (a reduced
  scalar bitcast back to float does not lower).
* A row is held whole in registers, `chunk / 128` values per lane (16 at the
  2048 default). A lane has at most 255 registers, so rows of tens of thousands
  of elements would spill; they would need a loop over pieces of the row (one
  pass for min/max, one for codes). Not measured: no GPU was at hand.
"""

from __future__ import annotations

import functools
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lpdec.kernels_pallas import minmax_jnp
from lpdec.kernels_pallas import numerics


class _Api(NamedTuple):
    """What this jax offers of Mosaic GPU (None/False where it lacks it)."""

    plgpu: Any  # jax.experimental.pallas.mosaic_gpu
    interpret_params: Any  # InterpretGPUParams: runs a kernel on CPU
    interpreter_casts_layouts: bool  # whether the interpreter runs `plgpu.layout_cast`


@functools.cache
def _api() -> _Api:
    """Mosaic GPU's API, imported on first use: its modules take half a second to import,
    a third of `import lpdec`, and only a GPU without Pallas Triton or its interpreter
    runs these kernels."""
    try:  # Mosaic GPU ships with jax, but keep this module importable without it.
        from jax.experimental.pallas import mosaic_gpu as plgpu  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        return _Api(None, None, False)
    # GPU interpret mode (runs a Mosaic GPU kernel on CPU, simulating its threads and
    # memories): public from jax 0.11 as plgpu.InterpretGPUParams; jax 0.10.2 ships it
    # only under jax._src.
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        try:
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params  # noqa: PLC0415
        except ImportError:  # pragma: no cover
            params = None
    # The interpreter runs `plgpu.layout_cast` from jax 0.11 (the public interpreter).
    return _Api(plgpu, params, hasattr(plgpu, "InterpretGPUParams"))


# The custom call every Mosaic GPU kernel lowers to on jax 0.10.2 - 0.12.
CUSTOM_CALL_TARGET = "mosaic_gpu_v2"
# Lanes of a warpgroup: a row's length must be a multiple of this (see above).
LANES = 128
_ROW = "row"


def available() -> bool:
    """Whether this jax has the Mosaic GPU kernel API these kernels use."""
    plgpu = _api().plgpu
    return plgpu is not None and hasattr(plgpu, "kernel")


def interpret_available() -> bool:
    """Whether this jax can interpret a Mosaic GPU kernel on CPU."""
    return available() and _api().interpret_params is not None


def padded_length(chunk: int) -> int:
    """The row length a kernel runs on: `chunk` rounded up to a multiple of 128."""
    return -(-chunk // LANES) * LANES


def lowers(chunk: int) -> bool:
    """Whether the kernels take rows of `chunk` elements without padding."""
    return available() and chunk > 0 and chunk % LANES == 0


def _interpret_params(interpret: bool):
    if not interpret:
        return None
    params = _api().interpret_params
    if params is None:
        raise NotImplementedError(f"jax {jax.__version__} has no Mosaic GPU interpret mode.")
    return params()


def _strided_vector(size: int, dtype) -> int:
    """Elements per lane vector of the strided layout a load of `size` `dtype` gets.

    Mosaic GPU picks the widest vector of at most 64 bits that divides the
    elements per lane (`WGStridedFragLayout.from_shaped_type`).
    """
    per_lane = size // LANES
    vec = max(1, 64 // (8 * jnp.dtype(dtype).itemsize))
    while per_lane % vec:
        vec //= 2
    return vec


def _floor_codes(t, top: int):
    """uint8 clip(floor(t), 0, top) with NaN -> 0: `minmax_jnp.element_codes`' stochastic codes.

    Mosaic GPU (jax 0.10.2) has no lowering for `floor`. Clipping to the integer
    bounds first (NaN fails `t > 0` and becomes 0) gives the same codes, since
    floor is monotone and fixes the bounds; on [0, top] floor is truncation, which
    the float -> integer conversion does.
    """
    bound = jnp.float32(top)
    t = jnp.where(t > 0, t, jnp.float32(0))
    t = jnp.where(t < bound, t, bound)
    return t.astype(jnp.int32).astype(jnp.uint8)


def _quantize_body(
    seeds_gmem, x_gmem, codes_gmem, lo_gmem, unit_gmem, *, bits, stochastic, length, cast_layout
):
    row = jax.lax.axis_index(_ROW)
    x = x_gmem.at[row][...].astype(jnp.float32)  # [chunk], WG_STRIDED
    # The row's min and max as order keys (minmax_jnp.row_min_max): integer min/max
    # are exact, so the reduction order cannot change a bit. The reductions keep
    # a [1] dim: a reduced scalar bitcast back to float does not lower.
    key = minmax_jnp.order_key(x)
    lo = minmax_jnp.from_order_key(jnp.min(key, keepdims=True))
    hi = minmax_jnp.from_order_key(jnp.max(key, keepdims=True))
    # minmax_jnp.row_scales, on [1] values.
    unit = (hi - lo) * jnp.float32(1.0 / numerics.levels(bits))
    inv_unit = 1.0 / jnp.where(unit > 0, unit, jnp.float32(jnp.inf))
    t = (x - lo) * inv_unit
    if stochastic:
        # Element i of row r draws from its flat index r * length + i, the
        # unpadded row length, as the reference does.
        # An iota has no layout of its own: give it x's (the strided layout a
        # load of x_gmem's dtype gets), or the lowering cannot infer one.
        # (jax 0.10.2's interpreter has no rule for the cast, an identity: it is
        # left out there.)
        cols = jax.lax.broadcasted_iota(jnp.uint32, x.shape, 0)
        if cast_layout:
            vec = _strided_vector(x.size, x_gmem.dtype)
            plgpu = _api().plgpu
            cols = plgpu.layout_cast(cols, plgpu.Layout.WG_STRIDED(x.shape, vec_size=vec))
        index = row.astype(jnp.uint32) * jnp.uint32(length) + cols
        u = numerics.hash_uniform(seeds_gmem[0, 0], seeds_gmem[0, 1], index)
        codes = _floor_codes(numerics.rounded(t) + u, numerics.levels(bits))
    else:
        codes = minmax_jnp.codes_from_levels(t, numerics.levels(bits))
    codes_gmem.at[row][...] = codes
    lo_gmem.at[row][...] = lo
    unit_gmem.at[row][...] = unit


def _dequantize_body(codes_gmem, lo_gmem, unit_gmem, out_gmem):
    row = jax.lax.axis_index(_ROW)
    # Scalar loads: a [1] array has no register layout (the strided one needs a
    # multiple of 128 elements), a scalar is splat across the warpgroup.
    lo = lo_gmem[row, 0]
    unit = unit_gmem[row, 0]
    x = minmax_jnp.dequantize_rows(codes_gmem.at[row][...], lo, unit)
    out_gmem.at[row][...] = x.astype(out_gmem.dtype)


def quantize_kernel(x2d, seeds, *, bits: int, stochastic: bool, length=None, interpret=False):
    """The Mosaic GPU quantize on [rows, chunk] with chunk a multiple of 128.

    `length` is the unpadded row length stochastic rounding indexes by (default
    chunk). Returns (uint8 codes [rows, chunk], float32 lo [rows, 1], unit [rows, 1]).
    """
    rows, chunk = x2d.shape
    if not lowers(chunk):
        raise ValueError(f"the row length must be a multiple of {LANES}; got {chunk}.")
    body = functools.partial(
        _quantize_body,
        bits=bits,
        stochastic=stochastic,
        length=length or chunk,
        cast_layout=not interpret or _api().interpreter_casts_layouts,
    )
    return _api().plgpu.kernel(
        body,
        out_type=(
            jax.ShapeDtypeStruct((rows, chunk), jnp.uint8),
            jax.ShapeDtypeStruct((rows, 1), jnp.float32),
            jax.ShapeDtypeStruct((rows, 1), jnp.float32),
        ),
        grid=(rows,),
        grid_names=(_ROW,),
        interpret=_interpret_params(interpret),
    )(seeds, x2d)


def dequantize_kernel(codes, lo, unit, *, dtype=jnp.float32, interpret=False):
    """The Mosaic GPU dequantize on [rows, chunk] codes, chunk a multiple of 128."""
    rows, chunk = codes.shape
    if not lowers(chunk):
        raise ValueError(f"the row length must be a multiple of {LANES}; got {chunk}.")
    return _api().plgpu.kernel(
        _dequantize_body,
        out_type=jax.ShapeDtypeStruct((rows, chunk), dtype),
        grid=(rows,),
        grid_names=(_ROW,),
        interpret=_interpret_params(interpret),
    )(codes, lo, unit)


@functools.partial(jax.jit, static_argnames=("bits", "stochastic", "interpret"))
def quantize(x2d, seeds=None, *, bits: int = 8, stochastic: bool = False, interpret: bool = False):
    """`minmax.quantize_reference` as a Mosaic GPU kernel, any row length.

    A row whose length is not a multiple of 128 is padded with its last value
    (min and max unchanged) and its codes sliced back.
    """
    if seeds is None:
        seeds = jnp.zeros((1, 2), jnp.uint32)
    rows, chunk = x2d.shape
    padded = padded_length(chunk)
    if padded != chunk:
        x2d = jnp.pad(x2d, ((0, 0), (0, padded - chunk)), mode="edge")
    codes, lo, unit = quantize_kernel(
        x2d, seeds, bits=bits, stochastic=stochastic, length=chunk, interpret=interpret
    )
    return codes[:, :chunk], lo, unit


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def dequantize(codes, lo, unit, *, dtype=jnp.float32, interpret: bool = False):
    """`minmax.dequantize_reference` as a Mosaic GPU kernel, any row length."""
    rows, chunk = codes.shape
    padded = padded_length(chunk)
    if padded != chunk:
        codes = jnp.pad(codes, ((0, 0), (0, padded - chunk)))
    out = dequantize_kernel(codes, lo, unit, dtype=jnp.dtype(dtype), interpret=interpret)
    return out[:, :chunk]
