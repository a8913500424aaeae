"""Offline data sets, the degree-of-skew partitioner of seed 002, per-node batching."""

from lpdec.data.batching import NodeBatcher
from lpdec.data.batching import shard
from lpdec.data.datasets import CIFAR10_MEAN
from lpdec.data.datasets import CIFAR10_STD
from lpdec.data.datasets import Dataset
from lpdec.data.datasets import cifar10
from lpdec.data.datasets import digits
from lpdec.data.datasets import load
from lpdec.data.datasets import mnist1d
from lpdec.data.datasets import mnist1d_templates
from lpdec.data.datasets import synthetic
from lpdec.data.partition import class_histogram
from lpdec.data.partition import skew_partition

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "Dataset",
    "NodeBatcher",
    "cifar10",
    "class_histogram",
    "digits",
    "load",
    "mnist1d",
    "mnist1d_templates",
    "shard",
    "skew_partition",
    "synthetic",
]
