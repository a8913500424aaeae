"""Collectives for centralized (all-reduce style) transforms, staged here for `lpdec.gossip`.

`gossip.py` is the only module of lpdec meant to call collectives; these
functions are written with the names and signatures they will have there and
move into it unchanged. Like everything in `gossip`, each must run under the
named axis `axis_name` (`jax.shard_map` over a mesh axis of that name, or
`jax.vmap(..., axis_name=...)`); all of them work under both, and nested
(a 2-axis mesh, or two nested vmaps). Each maps over a pytree, so a payload
tree (codes, scales) travels in one call.
"""

from __future__ import annotations

from typing import Any

import jax

PyTree = Any


def require_axis(axis_name: str, who: str) -> int:
    """The size of `axis_name`; a ValueError naming `who` if no such axis is bound here."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as error:
        raise ValueError(
            f"{who} communicates over the named axis {axis_name!r}, which is not bound here: "
            f"call it inside jax.shard_map over a mesh with an axis {axis_name!r}, or inside "
            f"jax.vmap(..., axis_name={axis_name!r})."
        ) from error


def all_to_all_payload(payload_chunks: PyTree, *, axis_name: str) -> PyTree:
    """Personalised exchange: row c of every leaf goes to node c.

    Args:
      payload_chunks: a pytree whose leaves have a leading axis of size n (the
        axis size); row c is what this node sends to node c (row `me` stays).

    Returns:
      The same structure and shapes; row c is what node c sent to this node.
    """
    return jax.lax.all_to_all(payload_chunks, axis_name, 0, 0)


def all_gather_payload(payload: PyTree, *, axis_name: str) -> PyTree:
    """Every node's `payload`, stacked along a new leading axis of size n (row c: node c's)."""
    return jax.lax.all_gather(payload, axis_name)


def local_reduce_scatter(x: PyTree, *, axis_name: str) -> PyTree:
    """Full-precision mean over `axis_name`, scattered: rank l gets block l of the leading axis.

    Each leaf's leading dimension must be a multiple of the axis size L; the
    result's is 1/L of it.
    """
    size = jax.lax.axis_size(axis_name)
    summed = jax.lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    return jax.tree.map(lambda s: s / size, summed)


def local_all_gather(x: PyTree, *, axis_name: str) -> PyTree:
    """Concatenation of every rank's `x` along the leading axis, in rank order (tiled)."""
    return jax.lax.all_gather(x, axis_name, tiled=True)


def local_sum(x: PyTree, *, axis_name: str) -> PyTree:
    """Full-precision sum over `axis_name` (one all-reduce for the whole tree)."""
    return jax.lax.psum(x, axis_name)
