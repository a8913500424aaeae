"""Sparsifying compressors: top-k (values + indices) and random-k (values only)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from lpdec.compress import base


def _num_kept(ratio: float, num_elements: int) -> int:
    """k = max(1, round(ratio * d)), at most d (0 for an empty array)."""
    if num_elements == 0:
        return 0
    return min(num_elements, max(1, round(ratio * num_elements)))


def _index_dtype(num_elements: int):
    """Indices as uint16 when they fit (2 bytes on the wire instead of 4)."""
    return jnp.uint16 if num_elements <= 1 << 16 else jnp.int32


@base.payload_dataclass(data=("values", "indices"))
class TopKPayload:
    """Wire format of `top_k`: k values in the input dtype and their flat indices."""

    values: jax.Array
    indices: jax.Array
    shape: tuple[int, ...]
    dtype: jnp.dtype


@base.payload_dataclass(data=("values",))
class RandomKPayload:
    """Wire format of `random_k`: k values only; the indices come from the shared key."""

    values: jax.Array
    shape: tuple[int, ...]
    dtype: jnp.dtype


def _scatter(values, indices, shape, dtype):
    d = math.prod(shape)
    out = jnp.zeros((d,), dtype).at[indices.astype(jnp.int32)].set(values.astype(dtype))
    return out.reshape(shape)


def _scatter_add(acc, weight, values, indices):
    flat = acc.reshape(-1)
    contribution = jnp.asarray(weight, jnp.float32) * values.astype(jnp.float32)
    return flat.at[indices.astype(jnp.int32)].add(contribution.astype(acc.dtype)).reshape(acc.shape)


@dataclasses.dataclass(frozen=True)
class TopK(base.Compressor):
    """Keeps the k largest-magnitude entries; see `top_k`."""

    ratio: float

    def __post_init__(self):
        base.check_ratio(self.ratio)

    def num_kept(self, num_elements: int) -> int:
        return _num_kept(self.ratio, num_elements)

    def encode(self, x: jax.Array, key: jax.Array | None = None) -> TopKPayload:
        del key
        x = base.check_float_input(x, "top_k")
        flat = x.reshape(-1)
        k = self.num_kept(flat.size)
        # Non-finite entries rank first, so they always reach the payload (and is_finite).
        magnitude = jnp.where(jnp.isfinite(flat), jnp.abs(flat), jnp.inf).astype(jnp.float32)
        _, indices = jax.lax.top_k(magnitude, k)
        return TopKPayload(
            flat[indices], indices.astype(_index_dtype(flat.size)), tuple(x.shape), x.dtype
        )

    def decode(self, payload: TopKPayload, *, reference=None, key=None) -> jax.Array:
        del reference, key
        return _scatter(payload.values, payload.indices, payload.shape, payload.dtype)

    def decode_accumulate(
        self, payload: TopKPayload, acc: jax.Array, weight, *, reference=None, key=None
    ) -> jax.Array:
        """acc + weight * decode(payload) as a k-element scatter-add."""
        del reference, key
        return _scatter_add(acc, weight, payload.values, payload.indices)

    def wire_bytes(self, num_elements: int, dtype=jnp.float32) -> int:
        k = self.num_kept(num_elements)
        return k * (np.dtype(dtype).itemsize + np.dtype(_index_dtype(num_elements)).itemsize)

    def is_finite(self, payload: TopKPayload) -> jax.Array:
        return jnp.all(jnp.isfinite(payload.values))


@dataclasses.dataclass(frozen=True)
class RandomK(base.Compressor):
    """Keeps k entries at positions drawn from a key both ends share; see `random_k`."""

    ratio: float
    needs_key = True

    def __post_init__(self):
        base.check_ratio(self.ratio)

    def num_kept(self, num_elements: int) -> int:
        return _num_kept(self.ratio, num_elements)

    def indices(self, num_elements: int, key: jax.Array) -> jax.Array:
        """The k distinct positions for `key` (both the sender and the receiver call this)."""
        k = self.num_kept(num_elements)
        return jax.random.choice(key, num_elements, (k,), replace=False)

    def encode(self, x: jax.Array, key: jax.Array | None = None) -> RandomKPayload:
        x = base.check_float_input(x, "random_k")
        key = base.check_key(key, "random_k")
        flat = x.reshape(-1)
        values = flat[self.indices(flat.size, key)]
        # A NaN/Inf outside the sample must not vanish: poison the whole payload instead.
        values = jnp.where(jnp.all(jnp.isfinite(flat)), values, jnp.asarray(jnp.nan, x.dtype))
        return RandomKPayload(values, tuple(x.shape), x.dtype)

    def decode(self, payload: RandomKPayload, *, reference=None, key=None) -> jax.Array:
        """Scatters the values to the positions drawn from `key` (the sender's key)."""
        del reference
        key = base.check_key(key, "random_k.decode (the sender's key)")
        indices = self.indices(math.prod(payload.shape), key)
        return _scatter(payload.values, indices, payload.shape, payload.dtype)

    def decode_accumulate(
        self, payload: RandomKPayload, acc: jax.Array, weight, *, reference=None, key=None
    ) -> jax.Array:
        del reference
        key = base.check_key(key, "random_k.decode_accumulate (the sender's key)")
        indices = self.indices(math.prod(payload.shape), key)
        return _scatter_add(acc, weight, payload.values, indices)

    def wire_bytes(self, num_elements: int, dtype=jnp.float32) -> int:
        return self.num_kept(num_elements) * np.dtype(dtype).itemsize

    def is_finite(self, payload: RandomKPayload) -> jax.Array:
        return jnp.all(jnp.isfinite(payload.values))


def top_k(ratio: float) -> TopK:
    """Top-k sparsifier: keeps the k = max(1, round(ratio * d)) largest |x_i|.

    Applied leaf by leaf it is the layer-wise top-k of seed 002 ("99% compression"
    is ``top_k(0.01)``). The payload holds the k values in the input dtype and
    their flat indices (uint16 when d <= 65536, else int32). NaN/Inf entries
    rank first, so a non-finite input always shows in the payload.

    Args:
      ratio: fraction of entries kept, in (0, 1].

    Example:
      >>> comp = top_k(0.25)
      >>> comp.decode(comp.encode(jnp.array([0.1, -3.0, 0.2, 1.0])))
      Array([ 0., -3.,  0.,  0.], dtype=float32)

    References:
      Aketi et al., Low Precision Decentralized Distributed Training with
      Heterogeneous Data, https://arxiv.org/abs/2111.09389
    """
    return TopK(ratio=ratio)


def random_k(ratio: float) -> RandomK:
    """Random-k sparsifier: k = max(1, round(ratio * d)) entries at positions from a shared key.

    The sender and the receiver derive the same k distinct positions from the
    same key (`RandomK.indices`), so only the k values cross the wire;
    `decode(payload, key=...)` takes the sender's key. If the input holds
    NaN/Inf anywhere, every value of the payload is NaN.

    Args:
      ratio: fraction of entries kept, in (0, 1].

    Example:
      >>> comp, key = random_k(0.5), jax.random.key(0)
      >>> x_hat = comp.decode(comp.encode(jnp.arange(4.0), key), key=key)
    """
    return RandomK(ratio=ratio)
