"""lpdec: communication-efficient, low-precision decentralized training in JAX."""

from lpdec.compress import Compressor
from lpdec.compress import identity
from lpdec.compress import minmax
from lpdec.compress import modulo
from lpdec.compress import payload_nbytes
from lpdec.compress import random_k
from lpdec.compress import top_k

__version__ = "0.1.0"

__all__ = [
    "Compressor",
    "identity",
    "minmax",
    "modulo",
    "payload_nbytes",
    "random_k",
    "top_k",
]
