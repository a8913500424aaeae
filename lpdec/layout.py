"""Nodes on devices: run a per-node function over every node of a training run.

A `NodeLayout` places n nodes on the available devices (on every host after
`jax.distributed.initialize`): one node per device when n <= the device count,
otherwise n / D simulated nodes per device, mapped with `jax.vmap` inside
`jax.shard_map` (the algorithms then get the pair of axis names
``(axis_name, local_axis)`` and lpdec's gossip treats it as one node axis).
Arrays that hold one value per node carry a leading axis of n, sharded over the
mesh axis in contiguous blocks; `map` wraps a function of ONE node's values into
a function of such arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

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
          A (not yet jitted) function; its outputs have a leading node axis.
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
