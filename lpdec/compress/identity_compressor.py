"""The identity compressor: full-precision values on the wire (D-PSGD's exchange)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lpdec.compress import base


@base.payload_dataclass(data=("values",))
class IdentityPayload:
    """Wire format of `identity`: the array itself."""

    values: jax.Array
    shape: tuple[int, ...]
    dtype: jnp.dtype


@dataclasses.dataclass(frozen=True)
class Identity(base.Compressor):
    """No compression; see `identity`."""

    def encode(self, x: jax.Array, key: jax.Array | None = None) -> IdentityPayload:
        del key
        x = base.check_float_input(x, "identity")
        return IdentityPayload(x, tuple(x.shape), x.dtype)

    def decode(self, payload: IdentityPayload, *, reference=None, key=None) -> jax.Array:
        del reference, key
        return payload.values

    def wire_bytes(self, num_elements: int, dtype=jnp.float32) -> int:
        return num_elements * np.dtype(dtype).itemsize

    def is_finite(self, payload: IdentityPayload) -> jax.Array:
        return jnp.all(jnp.isfinite(payload.values))


def identity() -> Identity:
    """The identity compressor: sends x in its own dtype (d * itemsize bytes).

    Example:
      >>> comp = identity()
      >>> comp.decode(comp.encode(jnp.ones(3)))
      Array([1., 1., 1.], dtype=float32)
    """
    return Identity()
