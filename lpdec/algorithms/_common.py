"""Small helpers each algorithm file calls: keys, guards, hyperparameters, checks, tree arithmetic.

Conventions of lpdec's algorithms (docs/DESIGN.md):

- An algorithm file holds its `State` (a public NamedTuple), a pure
  `init`/`step` pair where the paper's update rule lives, and a factory that
  returns an `optax.GradientTransformationExtraArgs` built from two closures.
  A gossip algorithm comes LAST in the chain: it receives the local update u
  (so params + u is the local step x~), communicates, and returns the update
  that lands the node on its new model. It needs `params`.
- `init` and `step` must run under the named axis `axis_name`
  (`gossip.require_axis` raises a one-line error naming the axis otherwise).
  `init` builds state that differs between nodes as varying
  (`gossip.to_varying`), so the state can be carried through `lax.scan` inside
  `shard_map(check_vma=True)`, and owns every buffer it holds (never aliases
  `params`), so a train state can be donated.
- Randomness: the state holds a key shared by all nodes (raw uint32[2]); the
  key of node i at step t is `node_key(key, t, i)`. A receiver that must
  re-draw a sender's randomness (random-k) calls the same function with the
  sender's index.
- Scalar hyperparameters (gamma, theta, ...) may be Python numbers, scalar
  arrays (so `optax.inject_hyperparams` works) or schedules of the step count;
  `check_scalar` validates them when they are concrete and `at_step` reads them.
- A local update holding NaN/Inf is dropped on that node (it takes no local
  step that round) and counted in `Health.nonfinite_updates`; a received
  payload that is not finite is not used and is counted in
  `Health.nonfinite_received` (`lpdec.algorithms.health`). One failing node
  cannot poison its neighbours. Algorithms that send a compressed function of
  the local step (CHOCO, DCD) detect a bad update from their own payload (its
  scales turn non-finite), which costs no extra pass over the update; such a
  node then skips the whole step: it neither moves nor sends a usable message,
  and its receivers count the dropped message. The others check the update
  (`guard_updates`) and still take part in the gossip.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lpdec import gossip
from lpdec.algorithms import health as health_lib
from lpdec.compress import base as compress_base
from lpdec.topology import Topology

PyTree = Any
Scalar = float | jax.Array | Callable[[jax.Array], Any]


def is_axis_name(name: Any) -> bool:
    """A string, or a non-empty tuple of distinct strings."""
    if isinstance(name, str):
        return True
    return (
        isinstance(name, tuple)
        and bool(name)
        and all(isinstance(a, str) for a in name)
        and len(set(name)) == len(name)
    )


def require_params(params: PyTree | None, name: str) -> PyTree:
    if params is None:
        raise ValueError(
            f"{name} needs the current parameters: call tx.update(updates, state, params)."
        )
    return params


def check_float_params(params: PyTree, name: str) -> None:
    """Refuses parameter leaves that are not floating point, naming them.

    Mixing integer models stalls silently: every averaged step rounds back to
    the node's own integers.
    """
    bad = [
        f"{jax.tree_util.keystr(path) or 'params'} ({x.dtype})"
        for path, x in jax.tree.leaves_with_path(params)
        if not jnp.issubdtype(x.dtype, jnp.floating)
    ]
    if bad:
        raise TypeError(
            f"{name}: parameters must be floating point; {', '.join(bad[:5])}"
            f"{' ...' if len(bad) > 5 else ''} are not. Cast them (e.g. to float32) or keep "
            "integer values out of the parameters the optimizer updates."
        )


def key_from_seed(seed: int | jax.Array) -> jax.Array:
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


def guard_updates(
    updates: PyTree, health: health_lib.Health
) -> tuple[PyTree, jax.Array, health_lib.Health]:
    """Zeroes a non-finite local update (the node skips its local step) and counts it."""
    ok = all_finite(updates)
    updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
    return updates, ok, health_lib.count_update(health, ok)


def f32(tree: PyTree) -> PyTree:
    """Every leaf as float32 (the same array where it already is: for arithmetic, not state)."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def own_f32(tree: PyTree, axis_name: gossip.AxisName) -> PyTree:
    """A float32 copy of `tree` for the state: never the caller's buffers (donation-safe)."""
    return gossip.to_varying(
        jax.tree.map(lambda x: jnp.array(x, dtype=jnp.float32, copy=True), tree), axis_name
    )


def zeros_f32(tree: PyTree, axis_name: gossip.AxisName) -> PyTree:
    return gossip.to_varying(
        jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree), axis_name
    )


def as_updates(new: PyTree, params: PyTree) -> PyTree:
    """new - params, cast to each parameter's dtype (what optax.apply_updates adds)."""
    return jax.tree.map(lambda n, p: (n - p.astype(jnp.float32)).astype(p.dtype), new, params)


def decode(
    compressor: compress_base.Compressor,
    payload: PyTree,
    like: PyTree,
    *,
    reference: PyTree | None = None,
    key: jax.Array | None = None,
) -> PyTree:
    """Leaf-by-leaf decode of a payload tree into float32 arrays shaped like `like`.

    The inverse of `lpdec.compress.tree.encode_tree` with the same `key` (one key
    per leaf, split from it), decoding against `reference` for compressors that
    decode relative to the receiver's model (modulo).
    """
    treedef = jax.tree.structure(like)
    payloads = compress_base.flatten_up_to(treedef, payload)
    n = len(payloads)
    refs = [None] * n if reference is None else compress_base.flatten_up_to(treedef, reference)
    keys = [None] * n if key is None else list(jax.random.split(key, n))
    return jax.tree.unflatten(
        treedef,
        [
            compressor.decode(p, reference=r, key=k).astype(jnp.float32)
            for p, r, k in zip(payloads, refs, keys, strict=True)
        ],
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


def check_scalar(
    value: Scalar,
    name: str,
    field: str,
    *,
    low: float,
    high: float = math.inf,
    low_open: bool = True,
    what: str = "",
) -> Scalar:
    """Validates a scalar hyperparameter in (low, high] (or [low, high] if not `low_open`).

    A Python number, a scalar array or a schedule `count -> value`. Concrete
    values are checked now; traced ones (`optax.inject_hyperparams` passes them
    inside jit) and schedules are taken as they are.
    """
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    if callable(value):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, np.ndarray, jax.Array)):
        raise ValueError(
            f"{name}: {field}{what} must be a number in {interval}, a scalar array or a "
            f"schedule (count -> value); got {value!r}."
        )
    if np.ndim(value) != 0:
        raise ValueError(f"{name}: {field}{what} must be a scalar; got shape {np.shape(value)}.")
    try:
        concrete = float(value)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return value
    if not (low < concrete if low_open else low <= concrete) or not concrete <= high:
        raise ValueError(f"{name}: {field}{what} must be in {interval}; got {value!r}.")
    return value


def check_gamma(gamma: Scalar, name: str) -> Scalar:
    """gamma, the consensus step size, in (0, 1]."""
    return check_scalar(gamma, name, "gamma", low=0.0, high=1.0, what=" (the consensus step size)")


def at_step(value: Scalar, count: jax.Array) -> jax.Array:
    """The value of a hyperparameter at step `count`, as a float32 scalar."""
    return jnp.asarray(value(count) if callable(value) else value, jnp.float32)


def check_compressor(compressor, name: str, example: str = "lpdec.minmax(8)"):
    if not isinstance(compressor, compress_base.Compressor):
        raise TypeError(f"{name} needs an lpdec compressor (e.g. {example}); got {compressor!r}.")
    return compressor
