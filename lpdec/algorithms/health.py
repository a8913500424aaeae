"""`Health`: what an algorithm refused to use, counted per node in its state.

A local update holding NaN/Inf is dropped on its node (the node takes no local
step that round) and counted in `Health.nonfinite_updates`; a received payload
that is not finite is not used and is counted in `Health.nonfinite_received`.
One failing node cannot poison its neighbours. Every algorithm state that
communicates has a `health` field; `totals` sums the counters of a whole
optimizer state (any chain, any nesting). Moniqua also counts, in
`Health.theta_warnings`, neighbour models that decoded further than θ/2 + δB from
the receiver's own: its θ is then close to too small (see `lpdec.moniqua`).
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from lpdec import gossip


class Health(NamedTuple):
    """Counters of non-finite values an algorithm refused to use (metrics read these).

    Attributes:
      nonfinite_updates: shape=(), dtype=int32; steps whose local update held
        NaN/Inf and was dropped on this node.
      nonfinite_received: shape=(), dtype=int32; neighbour payloads that held
        NaN/Inf and were not used.
      theta_warnings: shape=(), dtype=int32; Moniqua only (zero elsewhere):
        neighbour payloads with an element that decoded further than θ/2 + δB from
        this node's model, i.e. θ had less than a 2x margin over the distance
        between the two models (or the decode wrapped: θ was too small).
    """

    nonfinite_updates: jax.Array
    nonfinite_received: jax.Array
    theta_warnings: jax.Array


def init(axis_name: gossip.AxisName) -> Health:
    """Zero counters, varying over `axis_name` (they differ between nodes after a step)."""
    zero = gossip.to_varying(jnp.zeros((), jnp.int32), axis_name)
    return Health(zero, zero, zero)


def count_update(health: Health, ok: jax.Array) -> Health:
    """Counts this node's local update as non-finite unless `ok`."""
    return health._replace(
        nonfinite_updates=health.nonfinite_updates + jnp.where(ok, 0, 1).astype(jnp.int32)
    )


def count_received(health: Health, skipped: jax.Array) -> Health:
    """Adds `skipped` neighbour payloads that were not used."""
    return health._replace(nonfinite_received=health.nonfinite_received + skipped)


def count_theta_warnings(health: Health, warnings: jax.Array) -> Health:
    """Adds `warnings` neighbour payloads that decoded further than θ/2 + δB away (Moniqua)."""
    return health._replace(theta_warnings=health.theta_warnings + warnings)


def totals(opt_state: Any) -> Health:
    """Every `Health` found in `opt_state`, summed over nodes and transforms (numpy int64).

    Args:
      opt_state: any optimizer state (host or device arrays, with or without a
        leading node axis); arrays must be addressable from this process.
    """
    found = [
        h
        for h in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, Health))
        if isinstance(h, Health)
    ]
    sums = [np.int64(0)] * len(Health._fields)
    for h in found:
        sums = [t + np.sum(np.asarray(x), dtype=np.int64) for t, x in zip(sums, h, strict=True)]
    # Host-side totals: numpy int64 scalars where a traced Health holds jax arrays.
    return Health(*(np.int64(t) for t in sums))  # type: ignore[arg-type]
