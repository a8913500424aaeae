"""Test helpers: run an optax chain ending in an lpdec algorithm on n nodes.

`run` drives the same per-node program under `jax.shard_map` (one node per
device), under `jax.vmap(axis_name=AXIS)` (all nodes on one device) or both
nested (several nodes per device), carrying the optimizer state through
`lax.scan` (the way training loops are written, so `check_vma=True`
type-checks the state), and returns every step's parameters and state with a
leading node axis. lpdec's own tests use it to check that every layout gives
the same numbers; use it to test a chain of your own the same way:

  >>> import numpy as np, lpdec
  >>> from lpdec import testing
  >>> tx = lpdec.dpsgd(lpdec.ring(8), axis_name=testing.AXIS)
  >>> params = {"w": np.ones((8, 3), np.float32)}          # 8 nodes
  >>> updates = {"w": np.zeros((8, 5, 3), np.float32)}     # 5 steps of zero updates
  >>> ps, states, state0 = testing.run(tx, params, 5, updates=updates, mode="vmap")
  >>> ps["w"].shape                                         # [nodes, steps, ...]
  (8, 5, 3)

For training, `lpdec.init_nodes` and `NodeLayout.map` (lpdec.layout) are the
public way to start and step; `run` is a test fixture that rebuilds its mesh on
each call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lpdec import gossip
from lpdec import layout

# The axis name `run` maps the nodes over: build the transform with axis_name=AXIS.
AXIS = "nodes"
# The one-level layouts every algorithm test runs in.
MODES = ("shard_map", "vmap")
# Several simulated nodes per device: a vmap axis nested in the shard_map axis
# (mode="nested"; build the transform with axis_name=NESTED_AXIS).
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
    """Runs `steps` steps of `tx` on every node, each starting from `tx.init` of its params.

    Every node runs `params_t+1 = apply_updates(params_t, tx.update(g_t, state_t,
    params_t))` inside one jitted `lax.scan`, with its g_t from `updates` or
    `grad_fn`.

    Args:
      tx: the transform (chain) to run.
      params: a tree with a leading node axis n.
      steps: number of steps T.
      updates: a tree [n, T, ...] of the incoming gradients per node and step
        (fed to `tx` as its input), or
      grad_fn: grad_fn(params, node, step) computing them on the fly.
      mode: "shard_map" (one node per device: needs n devices), "vmap" (all nodes on
        the default device), or "nested" (n = D k nodes for the D devices, k per
        device: build `tx` with axis_name=NESTED_AXIS).

    Returns:
      (params after each step [n, T, ...], states after each step [n, T, ...],
       initial state [n, ...]).
    """
    if (updates is None) == (grad_fn is None):
        raise ValueError("pass exactly one of updates= or grad_fn=")
    if mode not in (*MODES, "nested"):
        raise ValueError(f"mode must be one of {(*MODES, 'nested')}; got {mode!r}")

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
        fn = layout.shard_map(
            nested, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False
        )
        sharding = jax.NamedSharding(mesh, spec)
        put = lambda tree: None if tree is None else jax.device_put(blocks(tree), sharding)  # noqa: E731
        out = jax.jit(fn)(put(params), put(updates))
        return jax.tree.map(lambda x: x.reshape((n,) + x.shape[2:]), out)
    mesh = jax.make_mesh((n,), (AXIS,))
    sharding = jax.NamedSharding(mesh, spec)
    put = lambda tree: None if tree is None else jax.device_put(tree, sharding)  # noqa: E731
    fn = layout.shard_map(program, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    return jax.jit(fn)(put(params), put(updates))


def to_numpy(tree: Any) -> Any:
    """Every leaf as a numpy array (copies device arrays to the host)."""
    return jax.tree.map(lambda x: np.asarray(x), tree)


def node_average(params: Any) -> Any:
    """Average over the leading node axis of every leaf, in float64 on the host."""
    return jax.tree.map(lambda x: np.asarray(x, np.float64).mean(axis=0), params)
