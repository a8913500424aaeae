"""Compressors: what crosses the wire between nodes."""

from lpdec.compress.base import Compressor
from lpdec.compress.base import payload_nbytes
from lpdec.compress.identity import Identity
from lpdec.compress.identity import IdentityPayload
from lpdec.compress.identity import identity
from lpdec.compress.minmax import MinMax
from lpdec.compress.minmax import MinMaxPayload
from lpdec.compress.minmax import minmax
from lpdec.compress.modulo import Modulo
from lpdec.compress.modulo import ModuloPayload
from lpdec.compress.modulo import modulo
from lpdec.compress.sparse import RandomK
from lpdec.compress.sparse import RandomKPayload
from lpdec.compress.sparse import TopK
from lpdec.compress.sparse import TopKPayload
from lpdec.compress.sparse import random_k
from lpdec.compress.sparse import top_k
from lpdec.compress.tree import decode_tree
from lpdec.compress.tree import encode_tree
from lpdec.compress.tree import tree_wire_bytes

__all__ = [
    "Compressor",
    "Identity",
    "IdentityPayload",
    "MinMax",
    "MinMaxPayload",
    "Modulo",
    "ModuloPayload",
    "RandomK",
    "RandomKPayload",
    "TopK",
    "TopKPayload",
    "decode_tree",
    "encode_tree",
    "identity",
    "minmax",
    "modulo",
    "payload_nbytes",
    "random_k",
    "top_k",
    "tree_wire_bytes",
]
