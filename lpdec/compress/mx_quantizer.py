"""Block-scaled float formats (MXFP8, MXFP4): 32 values share one power-of-two scale."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lpdec import kernels_pallas as kernels
from lpdec.compress import base
from lpdec.kernels_pallas import mx as mx_kernels


@base.payload_dataclass(data=("codes", "scales"))
class MXPayload:
    """Wire format of `mx`: element codes plus one E8M0 scale byte per block of 32.

    Attributes:
      codes: uint8[d] (fp8) or uint8[ceil(d / 2)] (fp4, two codes per byte).
      scales: uint8[ceil(d / 32)], each block's shared exponent + 127 (255: NaN).
      shape, dtype: static; the encoded array's shape and dtype.
    """

    codes: jax.Array
    scales: jax.Array
    shape: tuple[int, ...]
    dtype: jnp.dtype


@dataclasses.dataclass(frozen=True)
class MX(base.Compressor):
    """MX block-scaled float quantizer; see `mx`."""

    format: str = "fp4"
    rounding: str = "nearest"
    implementation: kernels.Implementation = None

    def __post_init__(self):
        mx_kernels.check_format(self.format)
        base.check_rounding(self.rounding)
        kernels.check_implementation(self.implementation)

    @property
    def bits(self) -> int:
        """Bits per element code: 8 (E4M3) or 4 (E2M1)."""
        return mx_kernels.FORMATS[self.format].bits

    @property
    def needs_key(self) -> bool:
        return self.rounding == "stochastic"

    def encode(self, x: jax.Array, key: jax.Array | None = None) -> MXPayload:
        """Codes and block scales of `x` (flattened, in blocks of 32; see `mx`).

        One kernel on GPU quantizes and packs the codes (`mx_kernels.quantize_packed`).
        """
        x = base.check_float_input(x, "mx")
        seeds = None
        if self.needs_key:
            seeds = kernels.seeds_from_key(base.check_key(key, "mx(rounding='stochastic')"))
        codes, scales = mx_kernels.quantize_packed(
            x,
            seeds,
            fmt=self.format,
            stochastic=self.needs_key,
            implementation=self.implementation,
        )
        return MXPayload(codes, scales, tuple(x.shape), x.dtype)

    def decode(self, payload: MXPayload, *, reference=None, key=None) -> jax.Array:
        """Element values times their block's 2**e, in the encoded shape and dtype."""
        del reference, key
        return mx_kernels.dequantize_packed(
            payload.codes,
            payload.scales,
            fmt=self.format,
            shape=payload.shape,
            dtype=payload.dtype,
            implementation=self.implementation,
        )

    def decode_accumulate(
        self, payload: MXPayload, acc: jax.Array, weight, *, reference=None, key=None
    ) -> jax.Array:
        """acc + weight * decode(payload) in float32, fused."""
        del reference, key
        if acc.size != math.prod(payload.shape):
            raise ValueError(
                f"acc has {acc.size} elements; the payload {math.prod(payload.shape)}."
            )
        return mx_kernels.dequantize_accumulate_packed(
            acc,
            weight,
            payload.codes,
            payload.scales,
            fmt=self.format,
            implementation=self.implementation,
        )

    def wire_bytes(self, num_elements: int, dtype=jnp.float32) -> int:
        """ceil(d * bits / 8) code bytes + one scale byte per block of 32; any dtype."""
        del dtype
        return kernels.packed_size(num_elements, self.bits) + -(-num_elements // mx_kernels.BLOCK)

    def is_finite(self, payload: MXPayload) -> jax.Array:
        """False if any block held NaN/Inf (its scale byte is then 255)."""
        return jnp.all(payload.scales != mx_kernels.NAN_SCALE)


def mx(
    format: str = "fp4", rounding: str = "nearest", *, implementation: kernels.Implementation = None
) -> MX:
    """Block-scaled float quantizer of the OCP Microscaling formats: MXFP4 or MXFP8.

    Each block of 32 consecutive elements (the flattened array; the last block
    may be shorter) shares a scale 2**e, sent as one E8M0 byte; each element is
    sent as x / 2**e rounded to a small float format:

    * "fp4": E2M1, 4 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives;
      4.25 bits per value on the wire.
    * "fp8": E4M3, 8 bits, 3 significant bits, magnitudes 2**-9 .. 448;
      8.25 bits per value.

    e is the smallest integer with max|x| <= largest * 2**e, so no element is
    clipped (the OCP rule can clip the top binade, which would bias stochastic
    rounding; see `lpdec.kernels_pallas.mx`). Unlike min-max, whose error is
    uniform across a chunk's range, the error is relative: a value v in a binade
    [2**k, 2**(k+1)) is off by at most 2**(k - mbits - 1) (nearest), so small
    entries keep their precision next to large ones, down to the subnormals of
    the element format.

    Args:
      format: "fp4" (E2M1) or "fp8" (E4M3).
      rounding: "nearest" (ties to even) or "stochastic" (unbiased; needs a key).
      implementation: None (Pallas on GPU/TPU, jnp on CPU), "xla", "pallas".

    Returns:
      An `MX` compressor.

    Example:
      >>> comp = mx("fp4", rounding="stochastic")
      >>> payload = comp.encode(jnp.linspace(-1.0, 1.0, 100), jax.random.key(0))
      >>> comp.wire_bytes(100)
      54

    References:
      OCP Microscaling Formats (MX) v1.0 Specification, 2023.
      Rouhani et al., Microscaling Data Formats for Deep Learning, https://arxiv.org/abs/2310.10537
    """
    return MX(format=format, rounding=rounding, implementation=implementation)
