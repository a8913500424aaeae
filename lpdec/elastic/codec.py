"""Trees of arrays as bytes, and the elastic exchange's arithmetic, in numpy.

The machines of an elastic run may be different hardware; the mean of a round
and the outer step are computed here in float32 numpy, element by element in a
fixed order (the decision's machine order), so every machine gets the same
bits from the same contributions and the anchors never drift apart.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import serialization


def pack(tree: Any) -> bytes:
    """The leaves of `tree` (in `jax.tree` order) as one msgpack byte string.

    flax's msgpack encoding (`flax.serialization.msgpack_serialize`): a map from
    each leaf's index to the array, with its shape and dtype; any pytree packs,
    since its structure travels with the receiver's `like`, not with the bytes.
    """
    # np.asarray, not np.ascontiguousarray: that one turns a 0-d array into a 1-d one.
    leaves = {str(i): np.asarray(x) for i, x in enumerate(jax.tree.leaves(tree))}
    return serialization.msgpack_serialize(leaves)


def unpack(blob: bytes, like: Any) -> Any:
    """Inverse of `pack`, into the structure of `like`; one-line ValueError on a mismatch."""
    try:
        restored = serialization.msgpack_restore(blob)
    except Exception as error:  # noqa: BLE001 - msgpack raises several kinds
        raise ValueError(f"the bytes are not a packed tree: {error}") from error
    if not isinstance(restored, dict) or set(restored) != {str(i) for i in range(len(restored))}:
        raise ValueError("the bytes are not a packed tree: expected leaves by index")
    arrays = [np.asarray(restored[str(i)]) for i in range(len(restored))]
    got = [[list(x.shape), x.dtype.str] for x in arrays]
    expect = [[list(np.shape(x)), _dtype(x).str] for x in jax.tree.leaves(like)]
    if got != expect:
        where = next((i for i, (a, b) in enumerate(zip(got, expect, strict=False)) if a != b), None)
        raise ValueError(
            f"the bytes hold {len(got)} arrays, the tree {len(expect)}"
            + ("" if where is None else f"; array {where}: {got[where]} vs {expect[where]}")
        )
    # Writable copies (msgpack's arrays are views of the read-only bytes).
    return jax.tree.unflatten(jax.tree.structure(like), [np.array(x) for x in arrays])


def _dtype(x: Any) -> np.dtype:
    # An array, a numpy scalar or a jax.ShapeDtypeStruct (`jax.eval_shape`'s leaves).
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype


def tree_digest(tree: Any) -> str:
    """SHA-256 of the leaves' bytes (equal trees, equal digests)."""
    h = hashlib.sha256()
    for x in jax.tree.leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def signature(tree: Any) -> str:
    """A short digest of the tree's structure, shapes and dtypes (not its values)."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    spec = [
        (jax.tree_util.keystr(p), list(np.shape(x)), str(np.asarray(x).dtype)) for p, x in paths
    ]
    return hashlib.sha256(json.dumps(spec).encode()).hexdigest()[:16]


def step_weighted_mean(deltas: Sequence[Any], steps: Sequence[int]) -> Any:
    """The round's pseudo-gradient from machines that took different numbers of steps.

    Machine i took steps[i] local steps and moved by deltas[i]; returned is
    sum_i steps[i] * deltas[i] / sum_i steps[i]: every local step (every batch)
    counts once, as in data parallelism, and with equal steps it is the plain
    mean. It is a convex combination, never longer than the longest
    contribution. FedNova's normalized average (Wang et al. 2020: tau *
    mean_i(deltas[i] / steps[i]), which makes every machine's direction count
    equally) was tried first and diverged: a machine of 1 step among machines of
    10 gets its one step, which moves much further than a tenth of ten noisy
    steps, scaled up by tau = 7, and DiLoCo's outer Nesterov step (lr 0.7,
    momentum 0.9) blew that up (train loss 1e20 in BENCHMARKS.md's elastic
    faults; with non-IID shards the step weighting leans towards the faster
    machines' data, FedNova's concern). float32, summed in the given order.
    """
    if not deltas or len(deltas) != len(steps) or min(steps) < 1:
        raise ValueError(f"need one delta per machine and steps >= 1; got {list(steps)}")
    total_steps = np.float32(sum(int(s) for s in steps))

    def combine(*leaves):
        total = np.zeros(np.shape(leaves[0]), np.float32)
        for leaf, s in zip(leaves, steps, strict=True):
            total = total + np.float32(s) * np.asarray(leaf, np.float32)
        return total / total_steps

    return jax.tree.map(combine, *deltas)


def slot_mean(deltas: Sequence[Any], slots: int) -> Any:
    """The round's pseudo-gradient as the uninterrupted run of `slots` machines weighs it.

    Returns sum_i deltas[i] / slots: a machine that is missing adds zero, one that
    took fewer local steps adds the steps it took, each local step at the weight
    it has in a round of every machine (1 / slots). With every machine there it
    is the plain mean. Against `step_weighted_mean` (the mean over the
    contributors): a round of m < slots machines moves the anchor m / slots as
    far, with the noise of m machines' batches, so the anchor's noise per local
    step, and with a constant learning rate the loss it settles at, stay those
    of the full run (the linear scaling of the step with the batch); the
    contributors' mean takes full-length steps from fewer batches, and with a
    10x slower machine settled 1.6-5.8 points of test accuracy lower in
    BENCHMARKS.md's elastic faults, where this mean ended within the
    uninterrupted runs'.
    float32, summed in the given order.
    """
    if not deltas or not isinstance(slots, int) or slots < len(deltas):
        raise ValueError(f"need 1 to slots={slots!r} deltas; got {len(deltas)}")

    def combine(*leaves):
        total = np.zeros(np.shape(leaves[0]), np.float32)
        for leaf in leaves:
            total = total + np.asarray(leaf, np.float32)
        return total / np.float32(slots)

    return jax.tree.map(combine, *deltas)


def nesterov_step(anchor: Any, momentum: Any, delta: Any, lr: float, mu: float):
    """DiLoCo's outer step on the anchor: SGD with Nesterov momentum on delta = anchor - x.

    The arithmetic of `optax.sgd(lr, momentum=mu, nesterov=True)` (`optax.trace`):
    m <- delta + mu * m;  anchor <- anchor - lr * (delta + mu * m).  Returns
    (anchor, momentum); mu = 0 is plain SGD (momentum stays zero).
    """
    lr, mu = np.float32(lr), np.float32(mu)  # type: ignore[assignment]  # float32 from here on

    def one(a, m, d):
        d = np.asarray(d, np.float32)
        m = d + mu * m
        return a - lr * (d + mu * m), m

    pairs = jax.tree.map(one, anchor, momentum, delta)
    is_pair = lambda x: isinstance(x, tuple)  # noqa: E731
    return (
        jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
        jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair),
    )
