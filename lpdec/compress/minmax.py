"""Per-chunk min-max quantization (seeds 000, 001, 004), bit-packed for any 1..8 bits."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lpdec.compress import base
from lpdec.kernels_pallas import _common
from lpdec.kernels_pallas import bitpack
from lpdec.kernels_pallas import minmax as kernels

DEFAULT_CHUNK_SIZE = 2048


def default_chunk_size(bits: int) -> int:
    """Elements per (lo, unit) pair when `chunk_size` is not given: 2048 * (8 // bits).

    A chunk's codes then take 2048 bytes at 1, 2, 4 and 8 bits (1536 at 3 bits,
    1280-1792 at 5-7), so the 8 bytes of scales add at most 0.63% to the codes at
    every width (a fixed 2048-element chunk adds 3.1% at 1 bit). The size stays a
    power of two, which the GPU kernels need. A longer chunk has a wider range,
    so its unit (and the rounding error, at most unit / 2) grows with the chunk's
    spread: for Gaussian data the expected range grows by about 11% from 2048 to
    16384 elements.
    """
    base.check_bits(bits)
    return DEFAULT_CHUNK_SIZE * (8 // bits)


@base.payload_dataclass(data=("codes", "lo", "unit"))
class MinMaxPayload:
    """Wire format of `minmax`: packed codes plus one (lo, unit) float32 pair per chunk.

    Attributes:
      codes: uint8[ceil(d * bits / 8)], the bit-packed codes.
      lo: float32[num_chunks], each chunk's minimum.
      unit: float32[num_chunks], each chunk's step (hi - lo) / (2**bits - 1).
      shape, dtype: static; the encoded array's shape and dtype.
    """

    codes: jax.Array
    lo: jax.Array
    unit: jax.Array
    shape: tuple[int, ...]
    dtype: jnp.dtype


def _spread(per_chunk: jax.Array, chunk: int, shape: tuple[int, ...]) -> jax.Array:
    """Per-chunk values -> one per element of `shape` (chunks of `chunk` row-major elements).

    Only the scales are broadcast and reshaped; the data keeps its own shape, which
    lets XLA CPU update loop-carried state in place (see kernels_pallas/minmax.py).
    """
    d = math.prod(shape)
    rows = per_chunk.size
    spread = jnp.broadcast_to(per_chunk.reshape(rows, 1), (rows, chunk)).reshape(-1)
    return spread[:d].reshape(shape)


@dataclasses.dataclass(frozen=True)
class MinMax(base.Compressor):
    """Min-max quantizer with per-chunk scales; see `minmax`."""

    bits: int = 8
    rounding: str = "nearest"
    chunk_size: int | None = None
    implementation: str | None = None

    def __post_init__(self):
        base.check_bits(self.bits)
        base.check_rounding(self.rounding)
        if self.chunk_size is None:
            object.__setattr__(self, "chunk_size", default_chunk_size(self.bits))
        if (
            isinstance(self.chunk_size, bool)
            or not isinstance(self.chunk_size, int)
            or self.chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be an integer >= 1; got {self.chunk_size!r}.")
        base.check_implementation(self.implementation)

    @property
    def needs_key(self) -> bool:
        return self.rounding == "stochastic"

    def _layout(self, num_elements: int) -> tuple[int, int]:
        """(rows, chunk): a leaf smaller than chunk_size is one chunk of its own size."""
        chunk = max(1, min(self.chunk_size, num_elements))
        return _common.num_rows(num_elements, chunk), chunk

    def num_chunks(self, num_elements: int) -> int:
        return self._layout(num_elements)[0]

    def encode(self, x: jax.Array, key: jax.Array | None = None) -> MinMaxPayload:
        """Quantizes `x` chunk by chunk: codes, lo and unit per chunk (module docstring)."""
        x = base.check_float_input(x, "minmax")
        seeds = jnp.zeros((1, 2), jnp.uint32)
        if self.needs_key:
            seeds = _common.seeds_from_key(base.check_key(key, "minmax(rounding='stochastic')"))
        packed, lo, unit = _common.dispatch(self.implementation, self._encode, x, seeds)
        return MinMaxPayload(packed, lo.reshape(-1), unit.reshape(-1), tuple(x.shape), x.dtype)

    def _encode(self, x: jax.Array, seeds: jax.Array, *, target):
        """(packed codes, lo, unit) as `target` computes them (`_common.dispatch`).

        The kernel views x as [rows, chunk]; the jnp path keeps x's shape (see
        `_spread`). Both give the same bits.
        """
        d = x.size
        rows, chunk = self._layout(d)
        if kernels.quantize_lowers(target, rows, chunk, x.dtype):
            flat = x.reshape(-1)
            if rows * chunk != d:
                # Repeat the last element: the partial chunk's min and max are unchanged.
                flat = jnp.pad(flat, (0, rows * chunk - d), mode="edge")
            codes, lo, unit = kernels.quantize_pallas(
                flat.reshape(rows, chunk),
                seeds,
                bits=self.bits,
                stochastic=self.needs_key,
                interpret=target.interpret,
                platform=target.platform,
            )
            codes = codes.reshape(-1)[:d]
        else:
            lo, unit, inv_unit = self._row_scales(x.reshape(-1), chunk)
            codes = kernels.quantize_elementwise(
                x,
                _spread(lo, chunk, x.shape),
                _spread(inv_unit, chunk, x.shape),
                seeds,
                bits=self.bits,
                stochastic=self.needs_key,
            ).reshape(-1)
        return bitpack.pack_bits_on(codes, bits=self.bits, target=target), lo, unit

    def _row_scales(self, flat: jax.Array, chunk: int):
        """Per-chunk (lo, unit, 1 / unit) of a flat array, each [rows, 1].

        The full chunks and the partial last one are reduced as two views of
        `flat`, so a ragged size costs no padded copy.
        """
        full = flat.size // chunk
        parts = []
        if full:
            parts.append(
                kernels.row_scales(flat[: full * chunk].reshape(full, chunk), bits=self.bits)
            )
        if full * chunk != flat.size:
            parts.append(kernels.row_scales(flat[full * chunk :].reshape(1, -1), bits=self.bits))
        if not parts:  # an empty leaf: no chunks
            return tuple(jnp.zeros((0, 1), jnp.float32) for _ in range(3))
        if len(parts) == 1:
            return parts[0]
        return tuple(jnp.concatenate(p, axis=0) for p in zip(*parts, strict=True))

    def _codes(self, payload: MinMaxPayload, target) -> jax.Array:
        d = math.prod(payload.shape)
        return bitpack.unpack_bits_on(payload.codes, bits=self.bits, num_elements=d, target=target)

    def _codes_2d(self, payload: MinMaxPayload, target):
        d = math.prod(payload.shape)
        rows, chunk = self._layout(d)
        codes = self._codes(payload, target)
        if rows * chunk != d:
            codes = jnp.pad(codes, (0, rows * chunk - d))
        return (
            codes.reshape(rows, chunk),
            payload.lo.reshape(rows, 1),
            payload.unit.reshape(rows, 1),
            d,
        )

    def _kernel_decodes(self, target, num_elements: int, dtype) -> bool:
        rows, chunk = self._layout(num_elements)
        return kernels.dequantize_lowers(target, rows, chunk, dtype)

    def decode(self, payload: MinMaxPayload, *, reference=None, key=None) -> jax.Array:
        """lo + code * unit per chunk, in the encoded shape and dtype."""
        del reference, key
        return _common.dispatch(self.implementation, self._decode, payload)

    def _decode(self, payload: MinMaxPayload, *, target) -> jax.Array:
        shape = payload.shape
        chunk = self._layout(math.prod(shape))[1]
        if not self._kernel_decodes(target, math.prod(shape), payload.dtype):
            return kernels.dequantize_elementwise(
                self._codes(payload, target).reshape(shape),
                _spread(payload.lo, chunk, shape),
                _spread(payload.unit, chunk, shape),
                dtype=payload.dtype,
            )
        codes, lo, unit, d = self._codes_2d(payload, target)
        x = kernels.dequantize_pallas(
            codes,
            lo,
            unit,
            dtype=jnp.dtype(payload.dtype),
            interpret=target.interpret,
            platform=target.platform,
        )
        return x.reshape(-1)[:d].reshape(shape)

    def decode_accumulate(
        self, payload: MinMaxPayload, acc: jax.Array, weight, *, reference=None, key=None
    ) -> jax.Array:
        """acc + weight * decode(payload) in float32, fused (no decoded copy is materialised)."""
        del reference, key
        weight = jnp.asarray(weight, jnp.float32)
        return _common.dispatch(self.implementation, self._decode_accumulate, payload, acc, weight)

    def _decode_accumulate(self, payload: MinMaxPayload, acc, weight, *, target) -> jax.Array:
        shape = acc.shape
        chunk = self._layout(math.prod(shape))[1]
        if not self._kernel_decodes(target, math.prod(shape), jnp.float32):
            return kernels.dequantize_accumulate_elementwise(
                acc.astype(jnp.float32),
                weight,
                self._codes(payload, target).reshape(shape),
                _spread(payload.lo, chunk, shape),
                _spread(payload.unit, chunk, shape),
            )
        codes, lo, unit, d = self._codes_2d(payload, target)
        rows, chunk = codes.shape
        flat = acc.astype(jnp.float32).reshape(-1)
        if rows * chunk != d:
            flat = jnp.pad(flat, (0, rows * chunk - d))
        out = kernels.dequantize_accumulate_pallas(
            flat.reshape(rows, chunk),
            weight,
            codes,
            lo,
            unit,
            interpret=target.interpret,
            platform=target.platform,
        )
        return out.reshape(-1)[:d].reshape(shape)

    def wire_bytes(self, num_elements: int, dtype=jnp.float32) -> int:
        """ceil(d * bits / 8) code bytes + 8 bytes (lo, unit) per chunk; independent of dtype."""
        del dtype
        return bitpack.packed_size(num_elements, self.bits) + 8 * self.num_chunks(num_elements)

    def is_finite(self, payload: MinMaxPayload) -> jax.Array:
        """False if any chunk held NaN/Inf (its lo or unit is then non-finite)."""
        return jnp.all(jnp.isfinite(payload.lo)) & jnp.all(jnp.isfinite(payload.unit))


def minmax(
    bits: int = 8,
    rounding: str = "nearest",
    chunk_size: int | None = None,
    *,
    implementation: str | None = None,
) -> MinMax:
    """Min-max quantizer with per-chunk scales, bit-packed codes.

    For each chunk of `chunk_size` consecutive elements (the flattened array; the
    last chunk may be shorter):

    .. math::

      lo = \\min x,\\quad u = (\\max x - lo) / (2^b - 1),\\quad
      c = \\mathrm{clip}(\\mathrm{round}((x - lo)/u), 0, 2^b - 1),\\quad
      \\hat x = lo + c\\,u

    with `round` to nearest, or stochastic (floor plus a Bernoulli of the
    fraction, bits from a counter-based hash of (key, element index)). A constant
    chunk (u = 0) decodes exactly. A chunk holding NaN/Inf gets a non-finite lo
    or u: it decodes to non-finite values and `is_finite(payload)` is False.

    Args:
      bits: code width b, 1..8; codes are bit-packed: ceil(d*b/8) bytes.
      rounding: "nearest" (error <= u/2) or "stochastic" (unbiased; needs a key).
      chunk_size: elements per (lo, u) pair; each pair costs 8 bytes on the wire.
        None (default): `default_chunk_size(bits)` = 2048 * (8 // bits), so the
        scales add at most 0.63% to the packed codes at every bit width.
      implementation: None (Pallas on GPU/TPU, fused jnp on CPU), "xla", "pallas".

    Returns:
      A `MinMax` compressor.

    Example:
      >>> comp = minmax(bits=4, rounding="stochastic")
      >>> payload = comp.encode(jnp.linspace(-1.0, 1.0, 1000), jax.random.key(0))
      >>> comp.decode(payload).shape
      (1000,)

    References:
      Bagua low-precision decentralized SGD, https://arxiv.org/abs/1803.06443
    """
    return MinMax(
        bits=bits, rounding=rounding, chunk_size=chunk_size, implementation=implementation
    )
