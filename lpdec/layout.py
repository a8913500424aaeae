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

Machines: ``make_layout(n, machines=M)`` lays the nodes out in two levels, a
2-D mesh ``("machines", "workers")`` whose row m holds machine m's devices
(with several processes, process m's local devices; in one process, M equal
groups of devices, a simulation). Node ``m * n / M + w`` is worker w of
machine m, which is the row-major order in which `jax.lax.axis_index` and
`jax.lax.ppermute` flatten the pair of axes, so a flat algorithm over
``layout.axis_name`` numbers the nodes as on a 1-D layout. Hierarchical
algorithms communicate over ``layout.machine_axis`` (slow links) and
``layout.worker_axis`` (the fast links inside a machine) separately.

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
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lpdec import gossip
from lpdec.algorithms import chain_order

PyTree = Any


MACHINE_AXIS = "machines"
WORKER_AXIS = "workers"


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """n nodes over a 1-D device mesh, or over a 2-D mesh of machines x workers.

    Attributes:
      num_nodes: n.
      mesh: the device mesh (one axis, `mesh_axis`; or two, machines then workers).
      mesh_axis: the mesh axis name, or the pair ``("machines", "workers")``.
      local_axis: the vmap axis name of the simulated nodes (used when nested).
      per_device: nodes per device (1: no nesting).

    Example:
      >>> layout = lpdec.make_layout(16)   # on 8 devices: 2 nodes per device
      >>> layout.nested, layout.axis_name
      (True, ('nodes', 'local'))
      >>> layout = lpdec.make_layout(8, machines=2)   # 2 machines x 4 workers
      >>> layout.axis_name, layout.machine_axis, layout.worker_axis
      (('machines', 'workers'), 'machines', 'workers')
    """

    num_nodes: int
    mesh: jax.sharding.Mesh
    mesh_axis: str | tuple[str, str] = "nodes"
    local_axis: str = "local"
    per_device: int = 1

    @property
    def nested(self) -> bool:
        return self.per_device > 1

    @property
    def hierarchical(self) -> bool:
        """Whether the nodes are laid out as machines x workers (`make_layout(machines=)`)."""
        return isinstance(self.mesh_axis, tuple)

    @property
    def axis_name(self) -> str | tuple[str, ...]:
        """The axis name the algorithms must use to reach every node."""
        mesh_axes = self.mesh_axis if self.hierarchical else (self.mesh_axis,)
        names = (*mesh_axes, self.local_axis) if self.nested else mesh_axes
        return names if len(names) > 1 else names[0]

    @property
    def machines(self) -> int:
        """M, the number of machines (1 on a layout without machines)."""
        return self.mesh.shape[MACHINE_AXIS] if self.hierarchical else 1

    @property
    def machine_axis(self) -> str:
        """The axis joining the machines (their slow links); only on a hierarchical layout."""
        self._require_machines("machine_axis")
        return MACHINE_AXIS

    @property
    def worker_axis(self) -> str | tuple[str, str]:
        """The axis of a machine's workers: ``"workers"``, or with it the vmap axis when nested."""
        self._require_machines("worker_axis")
        return (WORKER_AXIS, self.local_axis) if self.nested else WORKER_AXIS

    def _require_machines(self, what: str) -> None:
        if not self.hierarchical:
            raise ValueError(
                f"NodeLayout.{what} exists only on a layout of machines: build it with "
                "lpdec.make_layout(num_nodes, machines=M)."
            )

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

            def nested_body(*args):
                return jax.vmap(fn, in_axes=axes, axis_name=self.local_axis)(*args)

            # jax 0.10 rejects collectives over a vmap axis nested in shard_map under
            # check_vma, so the nested layout runs unchecked.
            return shard_map(
                nested_body,
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

        return shard_map(body, mesh=self.mesh, in_specs=specs, out_specs=jax.P(self.mesh_axis))


def shard_map(f: Callable, *, mesh, in_specs, out_specs, **kwargs) -> Callable:
    """`jax.shard_map` that keeps empty (zero-size) arguments out of the mapped program.

    jaxlib 0.11 (0.11.2 seen; 0.10.2 and 0.12.0.1 do not) crashes the interpreter with a
    segmentation fault while it compiles a `shard_map` over two or more devices whose
    body uses an empty argument and returns a non-empty array, e.g. a model with a
    zero-size leaf. An empty array holds no values, so this wrapper passes only the
    non-empty ones across the boundary and gives `f` fresh zeros of each empty
    argument's per-device shape: `f` sees the arguments it would see under
    `jax.shard_map`. Call it as `jax.shard_map`, with every argument positional; without
    empty arguments it is `jax.shard_map` itself.
    """
    mapped = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **kwargs)

    def call(*args):
        leaves, treedef = jax.tree.flatten(args)
        shapes = [tuple(x.shape) if hasattr(x, "shape") else np.shape(x) for x in leaves]
        empty = [math.prod(shape) == 0 for shape in shapes]
        if not any(empty):
            return mapped(*args)
        specs = _leaf_specs(in_specs, args)
        zeros = {
            i: (_local_shape(mesh, shapes[i], specs[i]), jnp.result_type(leaves[i]))
            for i in range(len(leaves))
            if empty[i]
        }

        def stand_in(i):
            """Zeros that vary over the axes the argument was split by, as it would."""
            axes = [a for entry in specs[i] if entry for a in _names(entry)]
            return gossip.to_varying(jnp.zeros(*zeros[i]), axes)

        def body(*kept):
            kept = iter(kept)
            full = [stand_in(i) if i in zeros else next(kept) for i in range(len(leaves))]
            return f(*jax.tree.unflatten(treedef, full))

        inner = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=tuple(s for s, e in zip(specs, empty, strict=True) if not e),
            out_specs=out_specs,
            **kwargs,
        )
        return inner(*(x for x, e in zip(leaves, empty, strict=True) if not e))

    return call


def _leaf_specs(in_specs, args: tuple) -> list:
    """One `PartitionSpec` per leaf of `args`, from `shard_map`'s prefix tree `in_specs`."""
    if isinstance(in_specs, jax.P):  # one spec for every argument
        in_specs = (in_specs,) * len(args)
    groups = jax.tree.map(
        lambda spec, arg: [spec] * len(jax.tree.leaves(arg)),
        tuple(in_specs),
        args,
        is_leaf=lambda x: isinstance(x, jax.P),
    )
    groups = jax.tree.leaves(groups, is_leaf=lambda g: isinstance(g, list))
    return [spec for group in groups for spec in group]


def _names(entry) -> tuple[str, ...]:
    """The mesh axes of one entry of a `PartitionSpec` (a name, a tuple of them or None)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _local_shape(mesh, shape: tuple[int, ...], spec) -> tuple[int, ...]:
    """The per-device block shape of a global `shape` split by `spec` over `mesh`."""
    out = list(shape)
    for dim, entry in enumerate(spec):
        for axis in _names(entry):
            out[dim] //= mesh.shape[axis]
    return tuple(out)


def init_nodes(
    tx: optax.GradientTransformation,
    params: PyTree,
    layout: NodeLayout,
    *,
    stacked: bool = False,
    check_chain: bool = True,
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
      check_chain: run `lpdec.check_chain` on the state: a one-line
        ValueError for a gossip algorithm before a stateful local optimizer
        or a per-node guard around a transform that communicates.

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
    if check_chain:
        chain_order.check_chain(opt_state)
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
    machines: int | None = None,
    devices: list | None = None,
    mesh_axis: str = "nodes",
    local_axis: str = "local",
) -> NodeLayout:
    """Places `num_nodes` nodes on `devices` (default: all devices of all processes).

    Without `machines`: a 1-D mesh over axis `mesh_axis`. With n <= D it uses the
    first n devices; with n > D it needs n to be a multiple of D and simulates
    n / D nodes per device.

    With `machines` = M: a 2-D mesh ``("machines", "workers")``, one row per
    machine, and n / M workers per machine placed on the machine's devices by
    the same rule (the first n / M of them, or n / M divided evenly among them
    under a nested vmap axis). If the devices belong to several processes, each
    process is one machine (M must be the process count) and its row holds its
    own devices by id; in one process the devices are cut into M equal groups
    (machines simulated for tests and for trying a layout out).

    Example:
      >>> layout = lpdec.make_layout(8, machines=2)   # 8 devices: a 2 x 4 mesh
      >>> dict(layout.mesh.shape)
      {'machines': 2, 'workers': 4}
    """
    devices = list(jax.devices() if devices is None else devices)
    if machines is None:
        used, per_device = _fit(num_nodes, devices, "the")
        mesh = jax.sharding.Mesh(np.array(used), (mesh_axis,))
        return NodeLayout(num_nodes, mesh, mesh_axis, local_axis, per_device)

    if isinstance(machines, bool) or not isinstance(machines, int) or machines < 1:
        raise ValueError(f"make_layout: machines must be a positive integer; got {machines!r}.")
    if num_nodes % machines:
        raise ValueError(
            f"make_layout: num_nodes={num_nodes} is not a multiple of machines={machines}: "
            "every machine holds the same number of workers."
        )
    rows = _machine_rows(devices, machines)
    workers = num_nodes // machines
    fitted = [_fit(workers, row, "each machine's") for row in rows]
    used, per_device = [row for row, _ in fitted], fitted[0][1]
    mesh = jax.sharding.Mesh(np.array(used), (MACHINE_AXIS, WORKER_AXIS))
    return NodeLayout(num_nodes, mesh, (MACHINE_AXIS, WORKER_AXIS), local_axis, per_device)


def _fit(num_nodes: int, devices: list, whose: str) -> tuple[list, int]:
    """(the devices used, nodes per device) for `num_nodes` nodes on `devices`."""
    count = len(devices)
    if num_nodes <= count:
        return devices[:num_nodes], 1
    if num_nodes % count == 0:
        return devices, num_nodes // count
    raise ValueError(
        f"num_nodes={num_nodes} exceeds {whose} {count} devices and is not a multiple of "
        f"that count: simulated nodes are spread evenly, so use a multiple of {count}."
    )


def _machine_rows(devices: list, machines: int) -> list[list]:
    """The devices of each machine: one process each, or equal groups in one process."""
    processes = sorted({d.process_index for d in devices})
    if len(processes) > 1:
        if machines != len(processes):
            raise ValueError(
                f"make_layout: machines={machines} but the devices belong to "
                f"{len(processes)} processes: with several processes each one is a machine, "
                f"so machines must be {len(processes)}."
            )
        rows = [
            sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)
            for p in processes
        ]
        if len({len(row) for row in rows}) > 1:
            raise ValueError(
                "make_layout: every process must bring the same number of devices to be a "
                f"machine; got {[len(row) for row in rows]}."
            )
        return rows
    if len(devices) % machines:
        raise ValueError(
            f"make_layout: machines={machines} does not divide the {len(devices)} devices: "
            "one process simulates machines as equal groups of its devices."
        )
    size = len(devices) // machines
    return [devices[m * size : (m + 1) * size] for m in range(machines)]
