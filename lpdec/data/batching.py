"""Per-node mini-batches for decentralized training: each node samples only its own data.

`NodeBatcher` turns a partition (one index array per node, e.g. from
`skew_partition`) into a stream of stacked batches ``x [n, b, ...]``,
``y [n, b]``, the leading axis being the node axis that `shard` places over a
mesh (or that `jax.vmap(axis_name=...)` maps over).

Sampling: node k walks through its own indices in epochs; epoch e is a
permutation drawn from ``np.random.default_rng((seed, k, e))``, so every node
sees each of its samples once per epoch (without replacement) in an order that
depends only on (seed, node, epoch). Batches run on across epoch boundaries: a
batch that straddles one takes the end of epoch e and the start of epoch e + 1,
so a sample can appear twice in such a batch (and, when a node holds fewer than
b samples, within every batch). Nothing is dropped and every step has the same
shape. Since the position of node k after s steps is s * b, the whole stream is
a function of the step counter, which is all `state` records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

# Keeps the augmentation's random stream apart from the epochs' (seed, node, epoch).
_AUGMENT_STREAM = 1
_CROP_PADDING = 4


class NodeBatcher:
    """Stacked per-node mini-batches drawn from a partition.

    Example:
      >>> x = np.arange(40, dtype=np.float32).reshape(20, 2)
      >>> y = np.arange(20, dtype=np.int32)
      >>> batcher = NodeBatcher(x, y, [np.arange(10), np.arange(10, 20)], 4, seed=0)
      >>> xb, yb = batcher.next()
      >>> xb.shape, yb.shape
      ((2, 4, 2), (2, 4))
      >>> checkpoint = batcher.state()   # {'step': 1, 'seed': 0, ...}
      >>> batcher.restore(checkpoint)    # resumes exactly after step 1
    """

    def __init__(
        self,
        dataset_x: np.ndarray,
        dataset_y: np.ndarray,
        parts: Sequence[np.ndarray],
        batch_size: int,
        seed: int,
        *,
        augment: bool = False,
        first_node: int = 0,
    ):
        """Creates the batcher at step 0.

        Args:
          dataset_x: [N, ...] inputs, indexed by the partition.
          dataset_y: [N] labels.
          parts: one array of sample indices per node (nonempty).
          batch_size: b, samples per node per step.
          seed: non-negative int; with the step it fixes every batch.
          augment: CIFAR-style augmentation of NHWC images: a random 32x32 crop
            of the image zero-padded by 4 pixels (zero is the mean colour once
            inputs are normalised; torchvision pads the raw image with black),
            then a horizontal flip with probability 1/2. Drawn per (seed, step).
          first_node: the index of `parts[0]` among the run's nodes: node i's order
            follows from (seed, first_node + i, epoch), so a batcher over nodes
            a .. b of a run draws exactly what the whole run's batcher draws for
            them (an elastic machine and the synchronous run it stands for).
        """
        if len(dataset_x) != len(dataset_y):
            raise ValueError(
                f"dataset_x has {len(dataset_x)} samples but dataset_y has {len(dataset_y)}"
            )
        if not parts:
            raise ValueError("parts must hold at least one node's indices")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed}")
        if augment and np.ndim(dataset_x) != 4:
            raise ValueError(
                f"augment=True needs NHWC images [N, H, W, C], got shape {np.shape(dataset_x)}"
            )
        self._parts = []
        for node, part in enumerate(parts):
            part = np.asarray(part)
            if part.ndim != 1 or part.size == 0 or not np.issubdtype(part.dtype, np.integer):
                raise ValueError(f"parts[{node}] must be a nonempty 1-D integer index array")
            if part.min() < 0 or part.max() >= len(dataset_y):
                raise ValueError(f"parts[{node}] has indices outside [0, {len(dataset_y)})")
            self._parts.append(part)
        self._x = dataset_x
        self._y = dataset_y
        self._batch_size = int(batch_size)
        self._seed = int(seed)
        self._augment = augment
        if isinstance(first_node, bool) or not isinstance(first_node, int) or first_node < 0:
            raise ValueError(f"first_node must be a non-negative int, got {first_node!r}")
        self._first_node = first_node
        self._step = 0
        # One cached epoch permutation per node: consecutive steps reuse it.
        self._epoch_cache: dict[int, tuple[int, np.ndarray]] = {}

    @property
    def num_nodes(self) -> int:
        """The number of nodes n."""
        return len(self._parts)

    def _epoch_order(self, node: int, epoch: int) -> np.ndarray:
        cached = self._epoch_cache.get(node)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng((self._seed, self._first_node + node, epoch))
            cached = (epoch, rng.permutation(self._parts[node]))
            self._epoch_cache[node] = cached
        return cached[1]

    def _node_indices(self, node: int, step: int) -> np.ndarray:
        size = self._parts[node].size
        positions = step * self._batch_size + np.arange(self._batch_size)
        epochs, offsets = np.divmod(positions, size)
        out = np.empty(self._batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._epoch_order(node, int(epoch))[offsets[where]]
        return out

    def indices(self) -> np.ndarray:
        """The sample indices of the next batch, [n, b], without advancing."""
        return np.stack([self._node_indices(k, self._step) for k in range(self.num_nodes)])

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """Returns this step's batch and advances one step.

        Returns:
          x of shape [n, b, ...] and y of shape [n, b], numpy arrays.
        """
        idx = self.indices()
        x = np.asarray(self._x[idx.reshape(-1)])
        if self._augment:
            x = _crop_and_flip(x, np.random.default_rng((self._seed, self._step, _AUGMENT_STREAM)))
        self._step += 1
        return x.reshape(idx.shape + x.shape[1:]), np.asarray(self._y[idx])

    def state(self) -> dict[str, int]:
        """The position in the stream, as a dict of ints to checkpoint.

        Returns:
          {"step", "seed", "batch_size", "num_nodes"}; only "step" changes.
        """
        return {
            "step": self._step,
            "seed": self._seed,
            "batch_size": self._batch_size,
            "num_nodes": self.num_nodes,
        }

    def restore(self, state: dict[str, int]) -> None:
        """Continues from a `state()`; the next batch is the one that followed it.

        Raises:
          ValueError: the state was taken from a batcher with another seed,
            batch size or node count, which would silently give other batches.
        """
        for key in ("seed", "batch_size", "num_nodes"):
            if int(state[key]) != self.state()[key]:
                raise ValueError(
                    f"state has {key}={int(state[key])} but this batcher has {self.state()[key]}"
                )
        self._step = int(state["step"])


def _crop_and_flip(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    # Random crop of the zero-padded image and random horizontal flip, gathered
    # for the whole batch at once: output pixel (i, j) of image m comes from
    # padded pixel (top_m + i, left_m + j), or (top_m + i, left_m + W - 1 - j)
    # when flipped.
    num, height, width, _ = images.shape
    pad = _CROP_PADDING
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    top = np.asarray(rng.integers(0, 2 * pad + 1, size=num))
    left = np.asarray(rng.integers(0, 2 * pad + 1, size=num))
    flip = np.asarray(rng.random(num) < 0.5)
    cols = np.where(flip[:, None], np.arange(width)[::-1], np.arange(width))
    rows = top[:, None] + np.arange(height)
    cols = left[:, None] + cols
    return padded[np.arange(num)[:, None, None], rows[:, :, None], cols[:, None, :]]


def shard(batch: Any, mesh: jax.sharding.Mesh, axis_name: str) -> Any:
    """Places arrays with a leading node axis over a mesh axis.

    Args:
      batch: an array [n, ...] or a pytree of them (e.g. the (x, y) of
        `NodeBatcher.next`).
      mesh: the device mesh.
      axis_name: the mesh axis the node axis is split over; n must be a
        multiple of its size (several nodes per device when it is larger).

    Returns:
      The same tree of `jax.Array`s, sharded as ``P(axis_name)``.
    """
    return jax.device_put(batch, jax.NamedSharding(mesh, jax.P(axis_name)))
