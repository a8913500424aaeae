"""Offline data sets, the degree-of-skew partitioner of seed 002, per-node batching.

The language model's data is in `lpdec.data.text`, re-exported here: the byte-level
corpus that is on every machine (Python's standard library sources), a directory of
your own text files (`text_directory`, bytes as tokens), and a pre-tokenized corpus
(`token_file`: nanoGPT's train.bin / val.bin, read through np.memmap).
"""

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
from lpdec.data.text import FILE_SEPARATOR
from lpdec.data.text import TOKEN_FILES
from lpdec.data.text import TextCorpus
from lpdec.data.text import load_stdlib_corpus
from lpdec.data.text import load_text_directory
from lpdec.data.text import python_stdlib_files
from lpdec.data.text import stdlib_text
from lpdec.data.text import text_directory
from lpdec.data.text import text_files
from lpdec.data.text import token_file
from lpdec.data.text import window_groups
from lpdec.data.text import windows

__all__ = [
    "CIFAR10_MEAN",
    "CIFAR10_STD",
    "Dataset",
    "FILE_SEPARATOR",
    "TOKEN_FILES",
    "NodeBatcher",
    "TextCorpus",
    "cifar10",
    "class_histogram",
    "digits",
    "load",
    "load_stdlib_corpus",
    "load_text_directory",
    "mnist1d",
    "mnist1d_templates",
    "python_stdlib_files",
    "shard",
    "skew_partition",
    "stdlib_text",
    "synthetic",
    "text_directory",
    "text_files",
    "token_file",
    "window_groups",
    "windows",
]
