"""Leaf-by-leaf compression of pytrees (layer-wise, as seed 002 applies top-k)."""

from __future__ import annotations

from typing import Any

import jax

from lpdec.compress import base


def encode_tree(compressor: base.Compressor, tree: Any, key: jax.Array | None = None) -> Any:
    """Encodes every leaf of `tree`; returns a tree of payloads of the same structure.

    Each leaf is its own payload (layer-wise); `Compressor.encode_leaves` may run
    them as one kernel launch (min-max on GPU), with the same bytes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    keys = [None] * len(leaves) if key is None else list(jax.random.split(key, len(leaves)))
    return jax.tree.unflatten(treedef, compressor.encode_leaves(leaves, keys))


def decode_tree(compressor: base.Compressor, payloads: Any, like: Any) -> Any:
    """Decodes a tree of payloads produced by `encode_tree` from a tree shaped like `like`."""
    treedef = jax.tree.structure(like)
    flat = base.flatten_up_to(treedef, payloads)
    return jax.tree.unflatten(treedef, [compressor.decode(p) for p in flat])


def tree_wire_bytes(compressor: base.Compressor, tree: Any) -> int:
    """Exact bytes on the wire to send `tree` (arrays or ShapeDtypeStructs) once."""
    return sum(compressor.wire_bytes(x.size, x.dtype) for x in jax.tree.leaves(tree))
