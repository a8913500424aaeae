"""Compressors: what crosses the wire between nodes."""

from lpdec.compress.base import Compressor
from lpdec.compress.base import payload_nbytes
from lpdec.compress.chunked_top_k_compressor import ChunkedTopK
from lpdec.compress.chunked_top_k_compressor import ChunkedTopKPayload
from lpdec.compress.chunked_top_k_compressor import chunked_top_k
from lpdec.compress.identity_compressor import Identity
from lpdec.compress.identity_compressor import IdentityPayload
from lpdec.compress.identity_compressor import identity
from lpdec.compress.minmax_quantizer import MinMax
from lpdec.compress.minmax_quantizer import MinMaxPayload
from lpdec.compress.minmax_quantizer import minmax
from lpdec.compress.modulo_quantizer import Modulo
from lpdec.compress.modulo_quantizer import ModuloPayload
from lpdec.compress.modulo_quantizer import modulo
from lpdec.compress.mx_quantizer import MX
from lpdec.compress.mx_quantizer import MXPayload
from lpdec.compress.mx_quantizer import mx
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
    "ChunkedTopK",
    "ChunkedTopKPayload",
    "Compressor",
    "Identity",
    "IdentityPayload",
    "MinMax",
    "MinMaxPayload",
    "Modulo",
    "ModuloPayload",
    "MX",
    "MXPayload",
    "RandomK",
    "RandomKPayload",
    "TopK",
    "TopKPayload",
    "chunked_top_k",
    "decode_tree",
    "encode_tree",
    "identity",
    "minmax",
    "modulo",
    "mx",
    "payload_nbytes",
    "random_k",
    "top_k",
    "tree_wire_bytes",
]
