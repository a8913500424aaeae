r"""One model per machine, split over the machine's workers (FSDP / ZeRO-3 inside a machine).

On a layout of machines x workers (`lpdec.make_layout(n, machines=M)`, one
worker per device), the k workers of a machine can hold ONE replica between
them instead of one each. A `ShardPlan` says how: every leaf of the model is
cut into k equal blocks along one of its dimensions (the largest that k
divides), and worker w of every machine holds block w. Everything that lives
beside the parameters (the local optimizer's state, DiLoCo's anchor and outer
momentum, error-feedback residuals, gossip replicas) is then built from the
blocks and is 1/k of its replicated size too, with no change to the
algorithms: they run on each worker's blocks with
``axis_name=layout.machine_axis``, so worker w exchanges its blocks, compressed,
with worker w of the other machines, and a machine sends one model per
exchange in all.

Inside a step, each worker gathers the full leaves over the fast in-machine
axis for the forward and backward pass (`ShardPlan.gather`), and the gradient
of that gather is the reduce-scatter: worker w receives the SUM over the
machine's workers of the gradient with respect to block w, which divided by
k is the gradient of the machine's whole batch:

.. math::

  g_w = \frac{1}{k} \sum_{v=1}^{k} \big[\nabla f_v(\mathrm{gather}(x_1, \dots, x_k))\big]_w

Storage: every value is kept per device, as `NodeLayout` keeps per-node
values, a global array with a leading axis of n = M k sharded over
``("machines", "workers")``; row m k + w holds machine m's block w. `put`
builds it from one model, `unshard` turns it back into one model per
machine.

  >>> layout = lpdec.make_layout(8, machines=2)          # 2 machines x 4 workers
  >>> plan = lpdec.plan_shards({"w": jnp.zeros((64, 16))}, workers=4)
  >>> plan.dims["w"], plan.block_shapes["w"]
  (0, (16, 16))
  >>> blocks = plan.put({"w": np.ones((64, 16), np.float32)}, layout)
  >>> blocks["w"].shape                                  # [n, 16, 16]
  (8, 16, 16)

Why manual collectives rather than letting XLA partition the worker axis
automatically: the exchange's compressors (bit packing, Pallas kernels) are
not partitionable by XLA's SPMD partitioner, which would gather a leaf before
encoding it and send k copies; written per block, each worker encodes exactly
its block, and the bytes over the machines axis are one compressed model per
machine, which the wire audit checks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lpdec import wire

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class ShardPlan:
    """How each leaf of a model is split over a machine's workers.

    Attributes:
      workers: k, the workers of a machine (blocks per leaf).
      dims: per leaf (the model's tree structure), the dimension cut into k blocks.
      shapes: per leaf, the whole leaf's shape.
      block_shapes: per leaf, one worker's block's shape.
    """

    workers: int
    dims: PyTree
    shapes: PyTree
    block_shapes: PyTree

    def split(self, params: PyTree) -> PyTree:
        """One model (host arrays) -> its k blocks per leaf, stacked: [k, *block]."""

        def cut(x, dim):
            x = np.asarray(x)
            return np.stack(np.split(x, self.workers, axis=dim))

        return jax.tree.map(cut, params, self.dims)

    def put(self, params: PyTree, layout) -> PyTree:
        """One model, the same on every machine -> per-device blocks [n, *block] on `layout`.

        Every process passes the same model and contributes its own devices' blocks.
        """
        _check_layout(layout, self.workers)
        machines = layout.machines
        blocks = self.split(params)
        tiled = jax.tree.map(lambda b: np.concatenate([b] * machines), blocks)
        return layout.put(tiled)

    def gather(self, blocks: PyTree, axis_name) -> PyTree:
        """This worker's blocks -> the whole leaves, gathered over the workers' axis.

        Call it inside the per-device program (`NodeLayout.map`). Its gradient is the
        reduce-scatter: differentiated, each block receives the SUM over the workers of
        their gradients; divide by `workers` for the mean (the machine's whole batch).
        The traffic meter (`lpdec.wire`) counts both, as a training step sends them: the
        all-gather of the blocks and the reduce-scatter of the whole leaves' gradient.
        """
        leaves, treedef = jax.tree.flatten(blocks)
        dims = jax.tree.leaves(self.dims)  # ints, in the blocks' leaf order
        out = list(leaves)
        # One all-gather per dtype of every block, concatenated (its gradient: one
        # reduce-scatter), not one per leaf: a collective's fixed cost paid once.
        groups: dict[Any, list[int]] = {}
        for i, block in enumerate(leaves):
            groups.setdefault(jnp.result_type(block), []).append(i)
        for indices in groups.values():
            flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in indices])
            if self.workers > 1:  # a machine of one worker sends nothing
                wire.record(flat, axis_name, collective="all_gather")
            rows = jax.lax.all_gather(flat, axis_name)  # [k, S]: row w, worker w's blocks
            if self.workers > 1:  # the reduce-scatter of the whole leaves' gradient
                wire.record(rows, axis_name, collective="psum_scatter")
            at = 0
            for i in indices:
                block, dim = leaves[i], dims[i]
                pieces = rows[:, at : at + block.size].reshape((self.workers, *block.shape))
                at += block.size
                # Block w at w * b .. (w + 1) * b along `dim`: the tiled all-gather's order.
                shape = list(block.shape)
                shape[dim] *= self.workers
                out[i] = jnp.moveaxis(pieces, 0, dim).reshape(shape)
        return jax.tree.unflatten(treedef, out)

    def unshard(self, blocks: PyTree) -> PyTree:
        """Per-device blocks [n, *block] (global or host arrays) -> one model per machine.

        Returns host arrays [M, *leaf] (M = n / k): machine m's whole model at index m.
        """

        def join(b, dim):
            b = np.asarray(jax.device_get(b) if isinstance(b, jax.Array) else b)
            machines = b.shape[0] // self.workers
            rows = b.reshape((machines, self.workers) + b.shape[1:])
            return np.concatenate(np.split(rows, self.workers, axis=1), axis=dim + 2)[:, 0]

        return jax.tree.map(join, blocks, self.dims)


def plan_shards(params: PyTree, workers: int) -> ShardPlan:
    """Splits every leaf of `params` over `workers` along its largest dimension they divide.

    Args:
      params: the model's parameters (arrays or `jax.ShapeDtypeStruct`s).
      workers: k, the workers of a machine.

    Returns:
      The `ShardPlan`.

    Raises:
      ValueError: (one line, naming the leaf) a leaf with no dimension divisible by k:
        its blocks could not be equal without padding that would cross the wire.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"plan_shards: workers must be a positive integer; got {workers!r}.")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not leaves:
        raise ValueError("plan_shards: params must hold at least one array; got an empty pytree.")
    dims, shapes, block_shapes = [], [], []
    for path, leaf in leaves:
        shape = tuple(int(s) for s in np.shape(leaf))
        fits = [d for d, size in enumerate(shape) if size % workers == 0 and size >= workers]
        if not fits:
            raise ValueError(
                f"plan_shards: params{jax.tree_util.keystr(path)} has shape {shape}, with no "
                f"dimension divisible by the {workers} workers of a machine: give the model "
                f"sizes that {workers} divides, or use fewer workers per machine."
            )
        dim = max(fits, key=lambda d: (shape[d], -d))
        block = shape[:dim] + (shape[dim] // workers,) + shape[dim + 1 :]
        dims.append(dim)
        shapes.append(shape)
        block_shapes.append(block)
    unflatten = lambda xs: jax.tree.unflatten(treedef, xs)  # noqa: E731
    return ShardPlan(workers, unflatten(dims), unflatten(shapes), unflatten(block_shapes))


def _check_layout(layout, workers: int) -> None:
    if not layout.hierarchical or layout.nested:
        raise ValueError(
            "ShardPlan needs a layout of machines x workers with one worker per device: "
            "lpdec.make_layout(num_nodes, machines=M) with num_nodes / M <= each machine's "
            "devices."
        )
    if layout.mesh.shape["workers"] != workers:
        raise ValueError(
            f"ShardPlan: the plan splits over {workers} workers but the layout has "
            f"{layout.mesh.shape['workers']} per machine."
        )


def average_blocks(blocks: PyTree, machine_axis) -> PyTree:
    """The machines' mean of this worker's blocks, summed in machine order on every machine.

    An all-gather over the machines then a sum in a fixed order, not a `psum`, so the
    result has the same bits whatever carries the collective (one process or several).
    """

    def mean(x):
        everyone = jax.lax.all_gather(x.astype(jnp.float32), machine_axis)
        total = everyone[0]
        for i in range(1, everyone.shape[0]):
            total = total + everyone[i]
        return (total / everyone.shape[0]).astype(x.dtype)

    return jax.tree.map(mean, blocks)
