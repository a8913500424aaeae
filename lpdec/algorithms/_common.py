"""Pieces every algorithm shares: health counters, keys, checks, tree arithmetic.

Conventions of lpdec's algorithms (DESIGN.md):

- An algorithm is an optax `GradientTransformationExtraArgs` that comes LAST in
  the chain. It receives the local update u (so params + u is the local step
  x~), communicates, and returns the update that lands the node on its new
  model. It needs `params` and must run under the named axis `axis_name`.
- State that differs between nodes starts out varying (`gossip.to_varying`),
  so the state can be carried through `lax.scan` inside
  `shard_map(check_vma=True)`.
- Randomness: the state holds a key shared by all nodes (raw uint32[2]); the
  key of node i at step t is `node_key(key, t, i)`. A receiver that must
  re-draw a sender's randomness (random-k) calls the same function with the
  sender's index.
- A local update holding NaN/Inf is dropped on that node (it takes no local
  step that round) and counted in `Health.nonfinite_updates`; a received
  payload that is not finite is not used and is counted in
  `Health.nonfinite_received`. One failing node cannot poison its neighbours.
  Algorithms that send a compressed function of the local step (CHOCO, DCD)
  detect a bad update from their own payload (its scales turn non-finite),
  which costs no extra pass over the update; such a node then skips the whole
  step: it neither moves nor sends a usable message, and its receivers count
  the dropped message. The others check the update (`guard_updates`) and still
  take part in the gossip.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from lpdec import gossip
from lpdec.compress import base as compress_base
from lpdec.topology import Topology

PyTree = Any


class Health(NamedTuple):
    """Counters of non-finite values an algorithm refused to use (metrics read these).

    Attributes:
      nonfinite_updates: shape=(), dtype=int32; steps whose local update held
        NaN/Inf and was dropped on this node.
      nonfinite_received: shape=(), dtype=int32; neighbour payloads that held
        NaN/Inf and were not used.
    """

    nonfinite_updates: jax.Array
    nonfinite_received: jax.Array


def init_health(axis_name: str) -> Health:
    zero = gossip.to_varying(jnp.zeros((), jnp.int32), axis_name)
    return Health(zero, zero)


def require_params(params: PyTree | None, name: str) -> PyTree:
    if params is None:
        raise ValueError(
            f"{name} needs the current parameters: call tx.update(updates, state, params)."
        )
    return params


def key_from_seed(seed: int) -> jax.Array:
    """A raw uint32[2] key (plain array leaves checkpoint and shard like any state)."""
    return jax.random.key_data(jax.random.key(seed))


def node_key(key: jax.Array, step: jax.Array, node: jax.Array) -> jax.Array:
    """The key node `node` uses at step `step` (every node can compute every other's)."""
    return jax.random.fold_in(jax.random.fold_in(key, step), node)


def all_finite(tree: PyTree) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.bool_(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def guard_updates(updates: PyTree, health: Health) -> tuple[PyTree, jax.Array, Health]:
    """Zeroes a non-finite local update (the node skips its local step) and counts it."""
    ok = all_finite(updates)
    updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
    return updates, ok, count_update(health, ok)


def count_update(health: Health, ok: jax.Array) -> Health:
    """Counts this node's local update as non-finite unless `ok`."""
    return health._replace(
        nonfinite_updates=health.nonfinite_updates + jnp.where(ok, 0, 1).astype(jnp.int32)
    )


def count_received(health: Health, skipped: jax.Array) -> Health:
    return health._replace(nonfinite_received=health.nonfinite_received + skipped)


def f32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def zeros_f32(tree: PyTree, axis_name: str) -> PyTree:
    return gossip.to_varying(
        jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree), axis_name
    )


def as_updates(new: PyTree, params: PyTree) -> PyTree:
    """new - params, cast to each parameter's dtype (what optax.apply_updates adds)."""
    return jax.tree.map(lambda n, p: (n - p.astype(jnp.float32)).astype(p.dtype), new, params)


def encode(compressor: compress_base.Compressor, tree: PyTree, key: jax.Array | None) -> PyTree:
    """Leaf-by-leaf encode with one key per leaf (a tree of payloads)."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = [None] * len(leaves) if key is None else list(jax.random.split(key, len(leaves)))
    return treedef.unflatten([compressor.encode(x, k) for x, k in zip(leaves, keys, strict=True)])


def decode(
    compressor: compress_base.Compressor,
    payload: PyTree,
    like: PyTree,
    *,
    reference: PyTree | None = None,
    key: jax.Array | None = None,
) -> PyTree:
    """Leaf-by-leaf decode of a payload tree into float32 arrays shaped like `like`."""
    treedef = jax.tree.structure(like)
    payloads = treedef.flatten_up_to(payload)
    n = len(payloads)
    refs = [None] * n if reference is None else treedef.flatten_up_to(reference)
    keys = [None] * n if key is None else list(jax.random.split(key, n))
    return treedef.unflatten(
        [
            compressor.decode(p, reference=r, key=k).astype(jnp.float32)
            for p, r, k in zip(payloads, refs, keys, strict=True)
        ]
    )


def check_topology(
    topology: Topology, name: str, *, require: str | tuple[str, ...], static: bool = False
) -> Topology:
    """Validates a topology for an algorithm at construction time (clear ValueErrors)."""
    if not isinstance(topology, Topology):
        raise TypeError(f"{name} needs an lpdec Topology (e.g. lpdec.ring(8)); got {topology!r}.")
    if static and topology.period != 1:
        raise ValueError(
            f"{name} keeps sums of its neighbours' public copies weighted by a fixed W, so "
            f"it needs a static topology; {topology!r} changes every step (period "
            f"{topology.period})."
        )
    topology.validate(require)
    return topology


def check_gamma(gamma: float, name: str) -> float:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
        raise ValueError(
            f"{name}: gamma (the consensus step size) must be in (0, 1]; got {gamma!r}."
        )
    return float(gamma)


def check_compressor(compressor, name: str, example: str = "lpdec.minmax(8)"):
    if not isinstance(compressor, compress_base.Compressor):
        raise TypeError(f"{name} needs an lpdec compressor (e.g. {example}); got {compressor!r}.")
    return compressor


def transform(
    name: str, init, step, init_kwargs: dict, step_kwargs: dict, *, needs_params: bool = True
) -> optax.GradientTransformationExtraArgs:
    """The optax transform of an algorithm module: `init(params, **init_kwargs)` and
    `step(updates, state, params, **step_kwargs)` (without `params` when the step does
    not read them), with a clear error when a needed `params` is missing."""

    def init_fn(params):
        return init(params, **init_kwargs)

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if not needs_params:
            return step(updates, state, **step_kwargs)
        params = require_params(params, name)
        return step(updates, state, params, **step_kwargs)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
