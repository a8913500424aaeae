"""Runs an optax chain ending in an lpdec algorithm on n simulated nodes.

`run` drives the same per-node program under `jax.shard_map` over the 8 CPU
devices (one node per device) or under `jax.vmap(axis_name=...)`, carrying the
optimizer state through `lax.scan` (the way training loops are written, so
`check_vma=True` type-checks the state), and returns every step's parameters
and state with a leading node axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lpdec import gossip

AXIS = "nodes"
MODES = ("shard_map", "vmap")
# Several simulated nodes per device: a vmap axis nested in the shard_map axis.
NESTED_AXIS = ("nodes", "local")


def run(
    tx: optax.GradientTransformation,
    params: Any,
    steps: int,
    *,
    updates: Any = None,
    grad_fn: Callable[[Any, jax.Array, jax.Array], Any] | None = None,
    mode: str = "shard_map",
):
    """Runs `steps` steps of `tx` on every node.

    Args:
      tx: the transform (chain) to run.
      params: a tree with a leading node axis n.
      steps: number of steps T.
      updates: a tree [n, T, ...] of the incoming gradients per node and step
        (fed to `tx` as its input), or
      grad_fn: grad_fn(params, node, step) computing them on the fly.
      mode: "shard_map" (needs n == 8 CPU devices), "vmap", or "nested" (n = 8 k
        nodes, k per device: build `tx` with axis_name=NESTED_AXIS).

    Returns:
      (params after each step [n, T, ...], states after each step [n, T, ...],
       initial state [n, ...]).
    """
    if (updates is None) == (grad_fn is None):
        raise ValueError("pass exactly one of updates= or grad_fn=")

    axis = NESTED_AXIS if mode == "nested" else AXIS

    def program(p, u):
        if mode == "shard_map":
            p = jax.tree.map(lambda x: x[0], p)
            u = None if u is None else jax.tree.map(lambda x: x[0], u)
        state0 = tx.init(p)
        node = jax.lax.axis_index(axis)

        def body(carry, inputs):
            params_t, state_t = carry
            t, u_t = inputs
            g = grad_fn(params_t, node, t) if grad_fn is not None else u_t
            upd, state_t = tx.update(g, state_t, params_t)
            params_t = optax.apply_updates(params_t, upd)
            return (params_t, state_t), (params_t, state_t)

        ts = jnp.arange(steps, dtype=jnp.int32)
        _, (ps, ss) = jax.lax.scan(body, (p, state0), (ts, u))
        out = gossip.to_varying((ps, ss, state0), AXIS)
        if mode == "shard_map":
            out = jax.tree.map(lambda x: x[None], out)
        return out

    if mode == "vmap":
        return jax.jit(jax.vmap(program, axis_name=AXIS))(params, updates)
    n = jax.tree.leaves(params)[0].shape[0]
    devices = len(jax.devices())
    spec = jax.P(AXIS)
    if mode == "nested":
        mesh = jax.make_mesh((devices,), (AXIS,))
        per_device = n // devices

        def blocks(tree):
            return jax.tree.map(lambda x: x.reshape((devices, per_device) + x.shape[1:]), tree)

        def first(tree):
            return None if tree is None else jax.tree.map(lambda x: x[0], tree)

        def nested(p, u):
            out = jax.vmap(program, axis_name=NESTED_AXIS[1])(first(p), first(u))
            return jax.tree.map(lambda x: x[None], out)

        # jax 0.10 rejects collectives over a vmap axis nested in shard_map under
        # check_vma, so the nested layout runs unchecked.
        fn = jax.shard_map(
            nested, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False
        )
        sharding = jax.NamedSharding(mesh, spec)
        put = lambda tree: None if tree is None else jax.device_put(blocks(tree), sharding)  # noqa: E731
        out = jax.jit(fn)(put(params), put(updates))
        return jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), out)
    mesh = jax.make_mesh((n,), (AXIS,))
    sharding = jax.NamedSharding(mesh, spec)
    put = lambda tree: None if tree is None else jax.device_put(tree, sharding)  # noqa: E731
    fn = jax.shard_map(program, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    return jax.jit(fn)(put(params), put(updates))


def to_numpy(tree):
    return jax.tree.map(lambda x: np.asarray(x), tree)


def node_average(params):
    """Average over the leading node axis of every leaf."""
    return jax.tree.map(lambda x: np.asarray(x, np.float64).mean(axis=0), params)
