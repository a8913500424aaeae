"""Moniqua's modulo quantizer (seed 003): send Q((x / B) mod 1), decode against the receiver."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from lpdec import kernels_pallas as kernels
from lpdec.compress import base


@base.payload_dataclass(data=("codes", "nonfinite"))
class ModuloPayload:
    """Wire format of `modulo`: packed codes plus a one-byte non-finite flag.

    Attributes:
      codes: uint8[ceil(d * bits / 8)].
      nonfinite: uint8 scalar, 1 if the encoded array held NaN or Inf.
      shape, dtype: static; the encoded array's shape and dtype.
    """

    codes: jax.Array
    nonfinite: jax.Array
    shape: tuple[int, ...]
    dtype: jnp.dtype


@dataclasses.dataclass(frozen=True)
class Modulo(base.Compressor):
    """Modulo quantizer of Moniqua; see `modulo`."""

    bits: int = 8
    theta: float = 1.0
    rounding: str = "nearest"
    implementation: kernels.Implementation = None

    def __post_init__(self):
        kernels.check_bits(self.bits)
        base.check_rounding(self.rounding)
        kernels.check_implementation(self.implementation)
        _check_theta(self.theta)

    @property
    def needs_key(self) -> bool:
        return self.rounding == "stochastic"

    @property
    def delta(self) -> float:
        """Quantizer error bound on the unit circle (seed 003, eq. 2).

        Nearest rounding to the 2**bits points k / 2**bits has error <= 2**-(bits+1);
        stochastic rounding < 2**-bits.
        """
        return 2.0 ** -(self.bits + 1) if self.rounding == "nearest" else 2.0**-self.bits

    def modulus(self, theta=None):
        """B_theta = 2 theta / (1 - 2 delta) (seed 003, Lemma 2); `theta` may be traced.

        Stochastic rounding at one bit has delta = 1/2, for which Lemma 2 gives no
        finite B; there B = 4 theta, the modulus of one-bit nearest rounding (and of
        two-bit stochastic rounding): see `modulo` for what then holds.

        B is rounded up to 16 significant bits: Lemma 2 holds for any B at least
        this large, and then a code times B / 2**bits is exact in float32, so
        decoding rounds identically in every program (see `kernels_pallas.rounded`).
        """
        theta = self.theta if theta is None else theta
        delta = min(self.delta, 0.25)
        return kernels.round_up_significand(2.0 * theta / (1.0 - 2.0 * delta))

    def encode(self, x: jax.Array, key: jax.Array | None = None, *, theta=None) -> ModuloPayload:
        """Encodes q = Q((x / B) mod 1); `theta` overrides the constant (for schedules)."""
        x = base.check_float_input(x, "modulo")
        if isinstance(theta, (int, float)):
            _check_theta(theta)
        seeds = None
        if self.needs_key:
            seeds = kernels.seeds_from_key(base.check_key(key, "modulo(rounding='stochastic')"))
        scale = jnp.float32(2**self.bits) / jnp.asarray(self.modulus(theta), jnp.float32)
        codes = kernels.modulo_encode(
            x,
            seeds,
            scale,
            bits=self.bits,
            stochastic=self.needs_key,
            implementation=self.implementation,
        )
        packed = kernels.pack_bits(
            codes.reshape(-1), bits=self.bits, implementation=self.implementation
        )
        nonfinite = jnp.any(~jnp.isfinite(x)).astype(jnp.uint8)
        return ModuloPayload(packed, nonfinite, tuple(x.shape), x.dtype)

    def decode(
        self, payload: ModuloPayload, reference: jax.Array | None = None, *, key=None, theta=None
    ) -> jax.Array:
        """x_hat = (q B - y) mod B + y with y = `reference`, the receiver's own model.

        If |x - y| < theta, then |x_hat - x| <= delta * B (seed 003, Lemma 2).
        """
        del key
        d = math.prod(payload.shape)
        if reference is None:
            raise ValueError("modulo decodes against the receiver's model: pass reference=y.")
        if reference.shape != payload.shape:
            raise ValueError(
                f"reference must have the encoded shape {payload.shape}; got {reference.shape}."
            )
        codes = kernels.unpack_bits(
            payload.codes, bits=self.bits, num_elements=d, implementation=self.implementation
        ).reshape(payload.shape)
        modulus = jnp.asarray(self.modulus(theta), jnp.float32)
        # Multiply by explicit reciprocals: XLA turns a division by a constant into a
        # multiplication in some fusions only, which would move the last bit.
        step = modulus * jnp.float32(2.0**-self.bits)
        inv_modulus = 1.0 / modulus
        y = reference.astype(jnp.float32)
        r = kernels.rounded(codes.astype(jnp.float32) * step) - y
        # Centred modulo: r mod B in [-B/2, B/2).
        turns = jnp.floor(kernels.rounded(r * inv_modulus) + 0.5)
        r = r - kernels.rounded(modulus * turns)
        x_hat = y + r
        x_hat = jnp.where(payload.nonfinite > 0, jnp.nan, x_hat)
        return x_hat.astype(payload.dtype)

    def wire_bytes(self, num_elements: int, dtype=jnp.float32) -> int:
        """ceil(d * bits / 8) code bytes + 1 flag byte; independent of dtype."""
        del dtype
        return kernels.packed_size(num_elements, self.bits) + 1

    def is_finite(self, payload: ModuloPayload) -> jax.Array:
        return payload.nonfinite == 0


def _check_theta(theta) -> None:
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise ValueError(f"theta must be a number > 0; got {theta!r}.")


def modulo(
    bits: int = 8,
    theta: float = 1.0,
    rounding: str = "nearest",
    *,
    implementation: kernels.Implementation = None,
) -> Modulo:
    """Moniqua's modulo quantizer: sends Q((x / B) mod 1) with no scales at all.

    .. math::

      B_\\theta = \\frac{2\\theta}{1 - 2\\delta},\\quad
      q = Q_\\delta\\big((x / B_\\theta) \\bmod 1\\big),\\quad
      \\hat x = (q B_\\theta - y) \\bmod B_\\theta + y

    where y is the receiver's own model (`decode(payload, reference=y)`), Q rounds
    onto the 2**bits points k / 2**bits of the unit circle, and delta is its error
    bound (`Modulo.delta`: 2**-(bits+1) nearest, 2**-bits stochastic). If
    |x - y| < theta elementwise, |x_hat - x| <= delta * B_theta (Lemma 2).

    One bit with stochastic rounding (what seed 003's experiments use at every
    width) has delta = 1/2, for which Lemma 2 gives no finite B; it uses
    B = 4 theta, the modulus of one-bit nearest rounding. Its codes are the two
    points a <= x < a + B/2 of the lattice (B/2)Z, drawn with the probabilities
    that make their mean x; the decode is one of them, so unbiased, when y lies
    in x's half-cell (a, a + B/2], which for a uniformly placed x happens with
    probability 1 - 2|x - y| / B (at least 1/2 while |x - y| < theta); otherwise
    the code point beyond y's window decodes a whole B away.

    Args:
      bits: code width, 1..8.
      theta: the a-priori bound on |x - y|; `encode`/`decode` accept a traced
        `theta=` override for schedules.
      rounding: "nearest" or "stochastic" (needs a key).
      implementation: None (Pallas on GPU/TPU, fused jnp on CPU), "xla", "pallas".

    Example:
      >>> comp = modulo(bits=2, theta=0.5)
      >>> y = jnp.zeros(4); x = y + 0.3
      >>> x_hat = comp.decode(comp.encode(x), reference=y)

    References:
      Lu & De Sa, Moniqua: Modulo Quantized Communication in Decentralized SGD,
      ICML 2020, https://arxiv.org/abs/2002.11787
    """
    return Modulo(bits=bits, theta=theta, rounding=rounding, implementation=implementation)
