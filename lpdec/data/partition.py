r"""Degree-of-skew (non-IID) partitions of a labelled data set over nodes (seed 002).

The partitioner follows the authors' code for seed 002
(github.com/aparna-aketi/Low_Precision_DL, ``DataPartitioner``): with N samples,
n nodes and a degree of skew s in [0, 1],

1. sort the samples by label (stable, so ties keep their original order);
2. per class c of size N_c, the first :math:`\lfloor s N_c \rfloor` samples go
   to a *sorted* pool (kept in label order) and the rest to a *random* pool,
   which is shuffled with ``seed``;
3. node k, in rank order, takes the next :math:`\lfloor N s / n \rfloor`
   samples of the sorted pool and the next :math:`\lfloor N (1 - s) / n \rfloor`
   samples of the random pool.

Skew 0 is IID (every node draws from the shuffled whole set); skew 1 gives each
node a contiguous run of the label-sorted set (one or two classes for CIFAR-10
on 8 nodes); in between a node holds a fraction s of "its" classes plus a
fraction 1 - s of random samples, the class mixes of Figures 2, 5, 6 and 7.

Leftovers: the floors mean up to n - 1 samples of each pool are left over after
the last node, and they are dropped, as in the authors' code (e.g. 6 of 50,000
for 7 nodes at skew 0.8). When classes are so small that the per-class floors
leave the sorted pool short of :math:`n \lfloor N s / n \rfloor` samples, the
last nodes take what is left of it, as in the authors' code.

The floors are taken in exact arithmetic on the decimal value of ``skew`` (its
shortest ``repr``), so 0.29 × 50,000 / 2 is exactly 7,250 and not 7,249.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np


def _exact_fraction(skew: float) -> Fraction:
    # A binary float like 0.29 is slightly below 29/100, so floor(0.29 * 50000 / 2)
    # gives 7249 in floating point; the user means the decimal they typed.
    return Fraction(repr(float(skew)))


def _check_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must have an integer dtype, got {labels.dtype}")
    return labels


def skew_partition(labels: np.ndarray, num_nodes: int, skew: float, seed: int) -> list[np.ndarray]:
    """Splits sample indices over nodes with a degree of skew (seed 002).

    Args:
      labels: [N] integer class labels.
      num_nodes: number of nodes n, 1 <= n <= N.
      skew: degree of skew s in [0, 1]; 0 is IID, 1 fully label-sorted.
      seed: seed of the shuffle of the random pool; the result is a
        deterministic function of (labels, num_nodes, skew, seed).

    Returns:
      One int64 array of sample indices per node, in node (rank) order, each
      sorted ascending. The arrays are disjoint; the few samples the floors leave
      over are in none of them (see the module docstring).

    Raises:
      ValueError: bad ``labels``, ``num_nodes`` or ``skew``, or a node would
        get no samples.

    Example:
      >>> labels = np.repeat(np.arange(10), 5000)
      >>> parts = skew_partition(labels, num_nodes=8, skew=0.8, seed=0)
      >>> [len(p) for p in parts] == [6250] * 8
      True
    """
    labels = _check_labels(labels)
    total = labels.shape[0]
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, (int, np.integer)):
        raise ValueError(f"num_nodes must be an int, got {num_nodes!r}")
    if not 1 <= num_nodes <= total:
        raise ValueError(
            f"num_nodes must be in [1, {total}] (the number of labels), got {num_nodes}"
        )
    if not 0.0 <= skew <= 1.0:
        raise ValueError(f"skew must be in [0, 1], got {skew!r}")
    skew_q = _exact_fraction(skew)

    by_label = np.argsort(labels, kind="stable")
    _, class_sizes = np.unique(labels, return_counts=True)
    class_starts = np.concatenate([[0], np.cumsum(class_sizes)[:-1]])
    sorted_pool = []
    random_pool = []
    for start, size in zip(class_starts, class_sizes, strict=True):
        num_sorted = math.floor(skew_q * int(size))
        sorted_pool.append(by_label[start : start + num_sorted])
        random_pool.append(by_label[start + num_sorted : start + size])
    sorted_all = np.concatenate(sorted_pool)
    random_all = np.random.default_rng(seed).permutation(np.concatenate(random_pool))

    per_node_sorted = math.floor(total * skew_q / num_nodes)
    per_node_random = math.floor(total * (1 - skew_q) / num_nodes)
    parts = []
    for k in range(num_nodes):
        part = np.concatenate(
            [
                sorted_all[k * per_node_sorted : (k + 1) * per_node_sorted],
                random_all[k * per_node_random : (k + 1) * per_node_random],
            ]
        )
        if part.size == 0:
            raise ValueError(
                f"node {k} gets no samples: {total} samples are too few for "
                f"num_nodes={num_nodes} at skew={skew}"
            )
        parts.append(np.sort(part).astype(np.int64))
    return parts


def class_histogram(
    labels: np.ndarray, parts: Sequence[np.ndarray], num_classes: int
) -> np.ndarray:
    """Counts each node's samples per class (the bars of seed 002's Figure 2).

    Args:
      labels: [N] integer class labels in [0, num_classes).
      parts: one index array per node, as returned by `skew_partition`.
      num_classes: number of classes C.

    Returns:
      int64 array [nodes, C]; entry (k, c) is the number of samples of class c
      that node k holds.
    """
    labels = _check_labels(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}) for num_classes={num_classes}")
    counts = [np.bincount(labels[part], minlength=num_classes) for part in parts]
    return np.stack(counts).astype(np.int64) if counts else np.zeros((0, num_classes), np.int64)
