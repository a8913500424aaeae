"""Nodes on devices: the public way to lay out, start and step n nodes.

A `NodeLayout` places n nodes on the available devices (on every host after
`jax.distributed.initialize`): one node per device when n <= the device count,
otherwise n / D simulated nodes per device, mapped with `jax.vmap` inside
`jax.shard_map` (the algorithms then get the pair of axis names
``(axis_name, local_axis)`` and lpdec's gossip treats it as one node axis).
Build every communicating transform with ``axis_name=layout.axis_name``.

Arrays that hold one value per node are global arrays with a leading axis of n,
sharded over the mesh axis in contiguous blocks. `NodeLayout.map` wraps a
function of ONE node's values into a function of such arrays, and
`init_nodes` builds the per-node parameters and optimizer state to feed it:

  >>> layout = lpdec.make_layout(8)
  >>> tx = optax.chain(optax.sgd(0.1), lpdec.choco(
  ...     lpdec.ring(8), lpdec.minmax(8), gamma=0.5, axis_name=layout.axis_name))
  >>> params, opt_state = lpdec.init_nodes(tx, {"w": jnp.zeros(3)}, layout)
  >>> params["w"].shape                      # every leaf: [n, ...]
  (8, 3)
  >>> def step(params, opt_state, grads):    # one node's program: w is [3] here
  ...     updates, opt_state = tx.update(grads, opt_state, params)
  ...     return optax.apply_updates(params, updates), opt_state
  >>> step = jax.jit(layout.map(step, (True, True, True)))
  >>> params, opt_state = step(params, opt_state, {"w": jnp.ones((8, 3))})

The leading axis, inside and outside: under `NodeLayout.map` the per-node
function sees one node's arrays with no node axis (it removes the axis of 1
that `shard_map` leaves on each node's block, or vmaps over the nodes of a
device) and puts the axis back on its outputs. In a `jax.shard_map` you write
yourself over the mesh axis, each node's block keeps that leading axis of 1
(shape [1, ...]): index it away (``x[0]``) before calling an lpdec transform,
and add it back (``x[None]``) on the way out, as `map` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from lpdec import gossip

PyTree = Any


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """n nodes over a 1-D device mesh.

    Attributes:
      num_nodes: n.
      mesh: the device mesh (one axis, `mesh_axis`).
      mesh_axis: the mesh axis name.
      local_axis: the vmap axis name of the simulated nodes (used when nested).
      per_device: nodes per device (1: no nesting).

    Example:
      >>> layout = lpdec.make_layout(16)   # on 8 devices: 2 nodes per device
      >>> layout.nested, layout.axis_name
      (True, ('nodes', 'local'))
    """

    num_nodes: int
    mesh: jax.sharding.Mesh
    mesh_axis: str = "nodes"
    local_axis: str = "local"
    per_device: int = 1

    @property
    def nested(self) -> bool:
        return self.per_device > 1

    @property
    def axis_name(self) -> str | tuple[str, str]:
        """The axis name the algorithms must use."""
        return (self.mesh_axis, self.local_axis) if self.nested else self.mesh_axis

    @property
    def node_sharding(self) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, jax.P(self.mesh_axis))

    @property
    def replicated(self) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(self.mesh, jax.P())

    def put(self, tree: PyTree, *, per_node: bool = True) -> PyTree:
        """Host numpy arrays -> global arrays (per node: leading axis n; else replicated).

        Every process passes the same full arrays and contributes its own
        devices' shards, so this works on one host and on many.
        """
        sharding = self.node_sharding if per_node else self.replicated

        def place(x):
            x = np.asarray(x)
            return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

        return jax.tree.map(place, tree)

    def map(self, fn: Callable, per_node_args: tuple[bool, ...]) -> Callable:
        """fn(one node's args...) -> one node's outputs, as a function of global arrays.

        Args:
          fn: a per-node function; it may call lpdec's algorithms/gossip with
            `axis_name=self.axis_name`.
          per_node_args: for each positional argument, True if it carries a
            leading node axis, False if every node gets the same value.

        Returns:
          A (not yet jitted) function of global arrays (per-node arguments: leading
          axis n, as `put` or `init_nodes` make them); every output gets a leading
          node axis n. Inside, `fn` sees one node's arrays without that axis.
        """
        specs = tuple(jax.P(self.mesh_axis) if p else jax.P() for p in per_node_args)
        axes = tuple(0 if p else None for p in per_node_args)

        if self.nested:

            def body(*args):
                return jax.vmap(fn, in_axes=axes, axis_name=self.local_axis)(*args)

            # jax 0.10 rejects collectives over a vmap axis nested in shard_map under
            # check_vma, so the nested layout runs unchecked.
            return jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=specs,
                out_specs=jax.P(self.mesh_axis),
                check_vma=False,
            )

        def body(*args):
            args = [
                jax.tree.map(lambda x: x[0], a) if p else a
                for a, p in zip(args, per_node_args, strict=True)
            ]
            out = gossip.to_varying(fn(*args), self.mesh_axis)
            return jax.tree.map(lambda x: x[None], out)

        return jax.shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=jax.P(self.mesh_axis))


def init_nodes(
    tx: optax.GradientTransformation,
    params: PyTree,
    layout: NodeLayout,
    *,
    stacked: bool = False,
) -> tuple[PyTree, PyTree]:
    """Per-node parameters and optimizer state of every node, built under the node axis.

    Communicating transforms must be initialised where their axis is bound (some
    exchange the initial model with their neighbours, all take the node index
    or key from it), so `tx.init` runs inside `layout.map`, once per node,
    whatever the layout: one node per device, several per device, or several
    processes (every process passes the same `params`).

    Args:
      tx: the optimizer (e.g. an optax chain ending in an lpdec algorithm),
        built with ``axis_name=layout.axis_name``.
      params: one node's parameters (a pytree of arrays); every node starts from
        this same model. With ``stacked=True``: per-node parameters, every leaf
        with a leading axis of n = ``layout.num_nodes``.
      layout: where the nodes live (`make_layout`).
      stacked: whether `params` already holds one model per node.

    Returns:
      ``(params, opt_state)``: global arrays with a leading node axis n, sharded
      as `NodeLayout.map` expects; the state owns its buffers (none is shared
      with `params`), so both can be donated to a jitted step.

    Example:
      >>> layout = lpdec.make_layout(8)
      >>> tx = lpdec.dpsgd(lpdec.ring(8), axis_name=layout.axis_name)
      >>> params, opt_state = lpdec.init_nodes(tx, {"w": np.zeros(3, np.float32)}, layout)
    """
    n = layout.num_nodes
    leaves = jax.tree.leaves(params)
    if not leaves:
        raise ValueError("params must hold at least one array; got an empty pytree")
    if stacked:
        for path, leaf in jax.tree.leaves_with_path(params):
            if np.ndim(leaf) < 1 or np.shape(leaf)[0] != n:
                raise ValueError(
                    f"params{jax.tree_util.keystr(path)} has shape {np.shape(leaf)}: with "
                    f"stacked=True every leaf needs a leading node axis of {n}"
                )
    else:
        params = jax.tree.map(lambda x: _broadcast_to_nodes(x, n), params)
    params = jax.tree.map(lambda x: _place(layout, x), params)
    opt_state = jax.jit(layout.map(tx.init, (True,)))(params)
    return params, opt_state


def _broadcast_to_nodes(x: Any, n: int) -> np.ndarray:
    x = np.asarray(x)
    return np.broadcast_to(x, (n, *x.shape))


def _place(layout: NodeLayout, x: Any) -> jax.Array:
    """One per-node leaf as a global array sharded over the nodes."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # Already global (e.g. the output of a previous run on several processes).
        return jax.device_put(x, layout.node_sharding)
    return layout.put(x)


def make_layout(
    num_nodes: int,
    *,
    devices: list | None = None,
    mesh_axis: str = "nodes",
    local_axis: str = "local",
) -> NodeLayout:
    """Places `num_nodes` nodes on `devices` (default: all devices of all processes).

    With n <= D it uses the first n devices; with n > D it needs n to be a
    multiple of D and simulates n / D nodes per device.
    """
    devices = list(jax.devices() if devices is None else devices)
    count = len(devices)
    if num_nodes <= count:
        used, per_device = devices[:num_nodes], 1
    elif num_nodes % count == 0:
        used, per_device = devices, num_nodes // count
    else:
        raise ValueError(
            f"num_nodes={num_nodes} exceeds the {count} devices and is not a multiple of "
            f"that count: simulated nodes are spread evenly, so use a multiple of {count}."
        )
    mesh = jax.sharding.Mesh(np.array(used), (mesh_axis,))
    return NodeLayout(num_nodes, mesh, mesh_axis, local_axis, per_device)
