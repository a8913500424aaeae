"""The compressor interface and the helpers every compressor shares.

A compressor is a frozen, hashable dataclass (so it can be a static argument of
`jax.jit` and a field of an optax transform). It works on one array at a time;
applied leaf by leaf to a pytree (`encode_tree`), per-leaf compressors such as
top-k are layer-wise, as in seed 002.

A payload is a registered pytree dataclass whose array leaves are exactly the
bytes that cross the wire; the shape and dtype of the original array are static
fields of its treedef. `lax.ppermute(payload, ...)` therefore sends it as is,
and `payload_nbytes(payload) == compressor.wire_bytes(x.size, x.dtype)`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable
from typing import Any
from typing import TypeVar
from typing import dataclass_transform
from typing import overload

import jax
import jax.numpy as jnp
import numpy as np

from lpdec.kernels_pallas import numerics

ROUNDINGS = ("nearest", "stochastic")


_PAYLOAD_TYPES: set[type] = set()


_C = TypeVar("_C", bound=type)


@overload
def payload_dataclass(
    cls: None = None, *, data: tuple[str, ...], meta: tuple[str, ...] = ("shape", "dtype")
) -> Callable[[_C], _C]: ...
@overload
def payload_dataclass(
    cls: _C, *, data: tuple[str, ...], meta: tuple[str, ...] = ("shape", "dtype")
) -> _C: ...
# dataclass_transform: type checkers see the fields (__init__, frozen) of each payload.
@dataclass_transform(frozen_default=True)
def payload_dataclass(
    cls: _C | None = None, *, data: tuple[str, ...], meta: tuple[str, ...] = ("shape", "dtype")
) -> _C | Callable[[_C], _C]:
    """Makes `cls` a frozen dataclass registered as a pytree with `data` leaves."""

    def wrap(c: _C) -> _C:
        frozen: Any = dataclasses.dataclass(frozen=True)(c)
        frozen = jax.tree_util.register_dataclass(
            frozen, data_fields=list(data), meta_fields=list(meta)
        )
        _PAYLOAD_TYPES.add(frozen)
        return frozen

    return wrap if cls is None else wrap(cls)


def flatten_up_to(treedef: Any, tree: Any) -> list[Any]:
    """`treedef.flatten_up_to(tree)`: the subtrees of `tree` at `treedef`'s leaves (a
    payload per leaf, whole). `treedef` is typed Any: jaxlib's PyTreeDef (a C++ class)
    has no type information in every supported jaxlib."""
    return treedef.flatten_up_to(tree)


def is_payload(x) -> bool:
    """True for a single array's payload (use as `is_leaf` when mapping over payload trees)."""
    return type(x) in _PAYLOAD_TYPES


def payload_nbytes(payload: Any) -> int:
    """Total bytes of a payload's (or payload tree's) array leaves: what crosses the wire."""
    return int(
        sum(
            np.dtype(leaf.dtype).itemsize * math.prod(leaf.shape)
            for leaf in jax.tree.leaves(payload)
        )
    )


class Compressor(abc.ABC):
    """Interface of lpdec's compressors (subclasses are frozen dataclasses).

    `encode(x, key)` maps a float array to a payload pytree, `decode(payload)`
    maps it back to an array of x's shape and dtype, and
    `wire_bytes(num_elements, dtype)` is the exact byte count of the payload.
    """

    @property
    def needs_key(self) -> bool:
        """Whether `encode` consumes randomness (stochastic rounding, random-k)."""
        return False

    @abc.abstractmethod
    def encode(self, x: jax.Array, key: jax.Array | None = None) -> Any:
        """Compresses one float array into a payload pytree."""

    @abc.abstractmethod
    def decode(self, payload: Any, *, reference=None, key=None) -> jax.Array:
        """Decompresses a payload into an array of the encoded shape and dtype.

        Every compressor accepts both keywords and ignores what it does not use:
        `reference` is the receiver's own array (modulo decodes against it) and
        `key` the sender's key (random-k re-draws its positions from it).
        """

    @abc.abstractmethod
    def wire_bytes(self, num_elements: int, dtype: Any = jnp.float32) -> int:
        """Exact bytes of the payload of `num_elements` values of `dtype`."""

    @abc.abstractmethod
    def is_finite(self, payload: Any) -> jax.Array:
        """bool scalar: False when the encoded array held NaN or Inf."""

    def encode_leaves(self, leaves: list, keys: list) -> list:
        """`encode` of each array (`keys[i]` may be None); compressors with a
        many-array kernel (min-max on GPU) override it to launch once for all."""
        return [self.encode(x, k) for x, k in zip(leaves, keys, strict=True)]

    def encode_feedback(
        self, update: jax.Array, residual: jax.Array, key: jax.Array | None = None, decay=1.0
    ) -> tuple[Any, jax.Array]:
        """Error feedback's encode: (encode(v), v - decode(...)) for v = update + decay * residual.

        v and the new residual are float32 (`update`'s shape); the product decay *
        residual is rounded before the add (`lpdec.kernels_pallas.rounded`), so every
        implementation sums the same bits. Compressors with a fused kernel (min-max
        on GPU) override this to read each input once.
        """
        v = numerics.feedback_sum(update, residual, decay)
        payload = self.encode(v, key)
        return payload, v - self.decode(payload, key=key).astype(jnp.float32)

    def decode_accumulate(
        self, payload: Any, acc: jax.Array, weight, *, reference=None, key=None
    ) -> jax.Array:
        """acc + weight * decode(payload), in acc's dtype (float32 for gossip sums)."""
        decoded = self.decode(payload, reference=reference, key=key).astype(jnp.float32)
        return (acc + jnp.asarray(weight, jnp.float32) * decoded).astype(acc.dtype)


# ----------------------------------------------------------------------------
# Argument validation shared by the factories (the bit-width and `implementation=`
# rules are the kernels' own: `lpdec.kernels_pallas.check_bits`, `check_implementation`).
# ----------------------------------------------------------------------------


def check_rounding(rounding) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be 'nearest' or 'stochastic'; got {rounding!r}.")
    return rounding


def check_ratio(ratio) -> float:
    if (
        isinstance(ratio, bool)
        or not isinstance(ratio, (int, float, np.number))
        or not 0 < ratio <= 1
    ):
        raise ValueError(f"ratio must be a number in (0, 1]; got {ratio!r}.")
    return float(ratio)


def check_float_input(x, who: str) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"{who} compresses floating-point arrays (float32, bfloat16, float16); "
            f"got dtype {x.dtype}."
        )
    return x


def check_key(key, who: str) -> jax.Array:
    if key is None:
        raise ValueError(f"{who} draws random bits: pass a PRNG key, encode(x, key).")
    return key
