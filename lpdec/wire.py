"""What goes on the wire: payload packing and a trace-time byte meter.

`lpdec.gossip` calls these; neither calls a collective itself.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class TrafficMeter:
    """Bytes one node sends per call of a traced function (see `traffic_meter`).

    Two counts. `bytes` is each collective's operand, as the compiled program's
    audit (`lpdec.metrics.collective_traffic`) counts it: the bytes a node hands to
    the collective. `link_bytes` is what a node then puts on its links when each
    collective runs the bandwidth-optimal algorithm over its n nodes (`LINK_SHARE`):
    an all-to-all's row to itself stays home, an all-gather's piece goes to n - 1
    nodes, a ring all-reduce sends 2 (n - 1) / n of the buffer. The two agree for a
    permute and, over 2 nodes, for everything but the all-to-all; `link_bytes` is
    what a link's byte counter sees (BENCHMARKS.md, bench/link.py's tables).

    Attributes:
      bytes: average over the nodes of the operand bytes each hands to
        collectives, per call.
      collectives: number of collective calls traced (time-varying rounds count
        with their share of the period).
      bytes_by_axis: `bytes` split by the axis name the collective ran over
        (e.g. inside vs across machines in a hierarchical layout).
      link_bytes: average over the nodes of the bytes each puts on its links,
        per call (`LINK_SHARE`).
      link_bytes_by_axis: `link_bytes` split by axis name; a sum over (machines,
        workers) that runs hierarchically is split into its parts inside and
        between the machines.
      occasional: number of collectives traced that run on only some calls
        (recorded under a `share` below 1: a round of a time-varying period,
        DiLoCo's exchange, a warm-up's); a compiled program holds each of them
        whole, in a branch of a conditional.
    """

    def __init__(self) -> None:
        self.bytes = 0.0
        self.collectives = 0.0
        self.bytes_by_axis: dict[str, float] = {}
        self.link_bytes = 0.0
        self.link_bytes_by_axis: dict[str, float] = {}
        self.occasional = 0


_METERS: list[TrafficMeter] = []
_SHARE = [1.0]  # share of the steps a traced branch runs (rounds of a period)


@contextlib.contextmanager
def traffic_meter():
    """Counts, while jax traces, the bytes each node sends through this module.

    Every collective of lpdec goes through this module, and the shapes it sees
    while tracing are one node's, so the count holds for every layout: one node
    per device, `vmap`, or both, where compiled HLO shows no (or inflated)
    collectives. A ppermute along a partial permutation counts for the nodes
    that send; a time-varying topology's rounds count with weight 1 / period.

    Example:
      >>> with lpdec.wire.traffic_meter() as meter:
      ...     jax.jit(step).lower(*args)
      >>> meter.bytes  # per node per call of step
    """
    meter = TrafficMeter()
    _METERS.append(meter)
    try:
        yield meter
    finally:
        _METERS.remove(meter)


# Bytes a node puts on its links per byte of a collective's operand, over n nodes, by
# the bandwidth-optimal algorithm (the ring's volumes, which also bound any other
# algorithm's average from below: Patarasuk & Yuan 2009 for the all-reduce).
LINK_SHARE: dict[str, Callable[[int], float]] = {
    "psum": lambda n: 2 * (n - 1) / n,  # reduce-scatter, then all-gather of the sums
    "psum_scatter": lambda n: (n - 1) / n,  # operand: all n blocks; n - 1 leave
    "all_gather": lambda n: n - 1,  # operand: this node's piece; n - 1 others need it
    "all_to_all": lambda n: (n - 1) / n,  # operand: n rows; the row to itself stays
    "ppermute": lambda n: 1.0,  # operand: what this node sends
}


def _axis_key(axis_name) -> str:
    return "+".join(axis_name) if isinstance(axis_name, tuple) else str(axis_name)


def _link_shares(collective: str, axis_name) -> dict[str, float]:
    """{axis key: link bytes per operand byte} of one collective over `axis_name`.

    "hierarchical_psum" over (outer, inner): a reduce-scatter over inner, the sum of
    one block (1/L of the buffer) over outer, an all-gather of it over inner
    (`lpdec.gossip.local_sum`'s route between machines of L workers)."""
    if collective == "hierarchical_psum":
        outer, inner = axis_name
        o, workers = jax.lax.axis_size(outer), jax.lax.axis_size(inner)
        return {inner: 2 * (workers - 1) / workers, outer: LINK_SHARE["psum"](o) / workers}
    if collective not in LINK_SHARE:
        known = [*LINK_SHARE, "hierarchical_psum"]
        raise ValueError(f"wire.record: unknown collective {collective!r}; one of {known}")
    return {_axis_key(axis_name): LINK_SHARE[collective](jax.lax.axis_size(axis_name))}


def record(tree: PyTree, axis_name, senders: float = 1.0, *, collective: str) -> None:
    """Adds a collective's operand to the active meters (a no-op when none is active).

    Args:
      tree: the operand, as one node hands it to the collective.
      axis_name: the axis (or axes) it runs over.
      senders: the share of the nodes that send (a partial permutation's).
      collective: its kind, a key of `LINK_SHARE` or "hierarchical_psum", for
        `link_bytes`.
    """
    if not _METERS:
        return
    nbytes = sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree))
    axis = _axis_key(axis_name)
    weight = senders * _SHARE[-1]
    links = _link_shares(collective, axis_name)
    for meter in _METERS:
        meter.occasional += _SHARE[-1] < 1
        meter.bytes += nbytes * weight
        meter.collectives += _SHARE[-1]
        meter.bytes_by_axis[axis] = meter.bytes_by_axis.get(axis, 0.0) + nbytes * weight
        for key, factor in links.items():
            sent = nbytes * weight * factor
            meter.link_bytes += sent
            meter.link_bytes_by_axis[key] = meter.link_bytes_by_axis.get(key, 0.0) + sent


@contextlib.contextmanager
def share(fraction: float):
    """Weights what is recorded inside by `fraction` (a round of a time-varying period)."""
    _SHARE.append(_SHARE[-1] * fraction)
    try:
        yield
    finally:
        _SHARE.pop()


# Leaves at least this large travel in their own collective; smaller ones are packed.
PACK_BELOW_BYTES = 1 << 18


def pack(tree: PyTree) -> tuple[list[jax.Array], Callable[[list[jax.Array]], PyTree]]:
    """Groups a tree's leaves into few buffers for transfer; returns them and the inverse.

    Every collective is a rendezvous of all the nodes, which costs far more than
    its bytes on a host with few cores for many devices (and is latency on a real
    network). A payload tree holds several small arrays per leaf (a min-max
    payload: codes, lo, unit), so the leaves smaller than `PACK_BELOW_BYTES` are
    bit-cast to uint8 and concatenated into one buffer, while large leaves travel
    as they are (concatenating them would cost a copy of the model).
    """
    leaves, treedef = jax.tree.flatten(tree)
    large = [i for i, x in enumerate(leaves) if x.size * x.dtype.itemsize >= PACK_BELOW_BYTES]
    small = [i for i in range(len(leaves)) if i not in large]
    buffers = [leaves[i] for i in large]
    specs = []
    if small:
        parts = []
        for i in small:
            x = leaves[i]
            raw = x if x.dtype == jnp.uint8 else jax.lax.bitcast_convert_type(x, jnp.uint8)
            parts.append(raw.reshape(-1))
            specs.append((i, x.shape, x.dtype, raw.size))
        buffers.append(jnp.concatenate(parts) if len(parts) > 1 else parts[0])

    def unpack(received: list[jax.Array]) -> PyTree:
        out: list[jax.Array | None] = [None] * len(leaves)
        for i, x in zip(large, received, strict=False):
            out[i] = x
        if small:
            packed, offset = received[-1], 0
            for i, shape, dtype, size in specs:
                raw = packed[offset : offset + size]
                offset += size
                if dtype == jnp.uint8:
                    out[i] = raw.reshape(shape)
                else:
                    width = np.dtype(dtype).itemsize
                    out[i] = jax.lax.bitcast_convert_type(raw.reshape(shape + (width,)), dtype)
        return jax.tree.unflatten(treedef, out)

    return buffers, unpack
