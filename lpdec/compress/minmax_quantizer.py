"""Per-chunk min-max quantization (seeds 000, 001, 004), bit-packed for any 1..8 bits."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lpdec import kernels_pallas as kernels
from lpdec.compress import base

DEFAULT_CHUNK_SIZE = 2048
TREE_LAYOUTS = ("leaves", "packed")


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
    kernels.check_bits(bits)
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


@dataclasses.dataclass(frozen=True)
class MinMax(base.Compressor):
    """Min-max quantizer with per-chunk scales; see `minmax`."""

    bits: int = 8
    rounding: str = "nearest"
    chunk_size: int | None = None
    implementation: kernels.Implementation = None
    tree_layout: str = "leaves"

    def __post_init__(self):
        kernels.check_bits(self.bits)
        base.check_rounding(self.rounding)
        if self.chunk_size is None:
            object.__setattr__(self, "chunk_size", default_chunk_size(self.bits))
        if (
            isinstance(self.chunk_size, bool)
            or not isinstance(self.chunk_size, int)
            or self.chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be an integer >= 1; got {self.chunk_size!r}.")
        kernels.check_implementation(self.implementation)
        if self.tree_layout not in TREE_LAYOUTS:
            raise ValueError(
                f"tree_layout must be one of {TREE_LAYOUTS}; got {self.tree_layout!r}."
            )

    @property
    def needs_key(self) -> bool:
        return self.rounding == "stochastic"

    @property
    def _chunk_size(self) -> int:
        """`chunk_size` as `__post_init__` set it (an int: None there means the default)."""
        assert self.chunk_size is not None
        return self.chunk_size

    def _layout(self, num_elements: int) -> tuple[int, int]:
        """(rows, chunk): a leaf smaller than chunk_size is one chunk of its own size."""
        chunk = max(1, min(self._chunk_size, num_elements))
        return -(-num_elements // chunk), chunk

    def num_chunks(self, num_elements: int) -> int:
        return self._layout(num_elements)[0]

    def encode(self, x: jax.Array, key: jax.Array | None = None) -> MinMaxPayload:
        """Quantizes `x` chunk by chunk: codes, lo and unit per chunk (module docstring)."""
        x = base.check_float_input(x, "minmax")
        seeds = None
        if self.needs_key:
            seeds = kernels.seeds_from_key(base.check_key(key, "minmax(rounding='stochastic')"))
        packed, lo, unit = kernels.minmax_quantize_packed(
            x,
            seeds,
            bits=self.bits,
            stochastic=self.needs_key,
            chunk=self._layout(x.size)[1],
            implementation=self.implementation,
        )
        return MinMaxPayload(packed, lo.reshape(-1), unit.reshape(-1), tuple(x.shape), x.dtype)

    def encode_leaves(self, leaves: list, keys: list) -> list[MinMaxPayload]:
        """`encode` of each leaf, bit for bit; on GPU one quantize launch for all of them.

        How the GPU launch takes the leaves is `tree_layout` (see `minmax`).
        """
        leaves = [base.check_float_input(x, "minmax") for x in leaves]
        if not leaves:
            return []
        seeds = jnp.zeros((len(leaves), 2), jnp.uint32)
        if self.needs_key:
            who = "minmax(rounding='stochastic')"
            seeds = jnp.concatenate(
                [kernels.seeds_from_key(base.check_key(k, who)) for k in keys], axis=0
            )
        if self.tree_layout == "packed":
            encoded = kernels.minmax_quantize_tree_packed(
                leaves,
                seeds,
                bits=self.bits,
                stochastic=self.needs_key,
                chunk=self._chunk_size,
                implementation=self.implementation,
            )
        else:
            quantized = kernels.minmax_quantize_leaves(
                leaves,
                seeds,
                bits=self.bits,
                stochastic=self.needs_key,
                chunks=[self._layout(x.size)[1] for x in leaves],
                implementation=self.implementation,
            )
            encoded = [
                (
                    kernels.pack_bits(
                        codes.reshape(-1), bits=self.bits, implementation=self.implementation
                    ),
                    lo,
                    unit,
                )
                for codes, lo, unit in quantized
            ]
        return [
            MinMaxPayload(packed, lo.reshape(-1), unit.reshape(-1), tuple(x.shape), x.dtype)
            for x, (packed, lo, unit) in zip(leaves, encoded, strict=True)
        ]

    def encode_feedback(
        self, update: jax.Array, residual: jax.Array, key: jax.Array | None = None, decay=1.0
    ) -> tuple[MinMaxPayload, jax.Array]:
        """`Compressor.encode_feedback`, bit for bit; on GPU one fused pass over both inputs."""
        update = base.check_float_input(update, "minmax")
        seeds = None
        if self.needs_key:
            seeds = kernels.seeds_from_key(base.check_key(key, "minmax(rounding='stochastic')"))
        packed, lo, unit, error = kernels.minmax_quantize_feedback_packed(
            update,
            residual,
            decay,
            seeds,
            bits=self.bits,
            stochastic=self.needs_key,
            chunk=self._layout(update.size)[1],
            implementation=self.implementation,
        )
        payload = MinMaxPayload(
            packed, lo.reshape(-1), unit.reshape(-1), tuple(update.shape), jnp.dtype(jnp.float32)
        )
        return payload, error

    def _codes(self, payload: MinMaxPayload, shape: tuple[int, ...]) -> jax.Array:
        """The payload's codes, unpacked, in `shape`."""
        codes = kernels.unpack_bits(
            payload.codes,
            bits=self.bits,
            num_elements=math.prod(payload.shape),
            implementation=self.implementation,
        )
        return codes.reshape(shape)

    def decode(self, payload: MinMaxPayload, *, reference=None, key=None) -> jax.Array:
        """lo + code * unit per chunk, in the encoded shape and dtype."""
        del reference, key
        return kernels.minmax_dequantize(
            self._codes(payload, payload.shape),
            payload.lo,
            payload.unit,
            chunk=self._layout(math.prod(payload.shape))[1],
            dtype=payload.dtype,
            implementation=self.implementation,
        )

    def decode_accumulate(
        self, payload: MinMaxPayload, acc: jax.Array, weight, *, reference=None, key=None
    ) -> jax.Array:
        """acc + weight * decode(payload) in float32, fused (no decoded copy is materialised)."""
        del reference, key
        return kernels.minmax_dequantize_accumulate(
            acc,
            weight,
            self._codes(payload, acc.shape),
            payload.lo,
            payload.unit,
            chunk=self._layout(acc.size)[1],
            implementation=self.implementation,
        )

    def wire_bytes(self, num_elements: int, dtype=jnp.float32) -> int:
        """ceil(d * bits / 8) code bytes + 8 bytes (lo, unit) per chunk; independent of dtype."""
        del dtype
        return kernels.packed_size(num_elements, self.bits) + 8 * self.num_chunks(num_elements)

    def is_finite(self, payload: MinMaxPayload) -> jax.Array:
        """False if any chunk held NaN/Inf (its lo or unit is then non-finite)."""
        return jnp.all(jnp.isfinite(payload.lo)) & jnp.all(jnp.isfinite(payload.unit))


def minmax(
    bits: int = 8,
    rounding: str = "nearest",
    chunk_size: int | None = None,
    *,
    implementation: kernels.Implementation = None,
    tree_layout: str = "leaves",
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
      tree_layout: how `encode_tree` hands a tree's leaves to the GPU; the bytes
        are the same either way, and CPU and TPU encode leaf by leaf for both.
        "leaves" (default): one quantize launch taking each leaf as its own input
        (`kernels.minmax_quantize_leaves`), then a pack launch per leaf below 8
        bits. "packed": the leaves copied into one buffer of whole chunks and
        encoded by one flat launch that also packs 1, 2 and 4 bits
        (`kernels.minmax_quantize_tree_packed`). Which is the GPU default waits
        for the next GPU measurement (`bench/gpu_kernels.py --parts trees`).

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
        bits=bits,
        rounding=rounding,
        chunk_size=chunk_size,
        implementation=implementation,
        tree_layout=tree_layout,
    )
