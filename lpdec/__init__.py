"""lpdec: communication-efficient, low-precision decentralized training in JAX.

The whole public API is re-exported here; see README.md for a tour. The algorithms
(factories and state classes) come from their modules' declarations.
"""

from lpdec import algorithms
from lpdec import async_sim
from lpdec import compress
from lpdec import data
from lpdec import elastic
from lpdec import fsdp
from lpdec import gossip
from lpdec import layout
from lpdec import metrics
from lpdec import models
from lpdec import nn
from lpdec import testing
from lpdec import topology
from lpdec import wire
from lpdec.algorithms.chain_order import chain
from lpdec.algorithms.chain_order import check_chain
from lpdec.algorithms.health import Health
from lpdec.compress import Compressor
from lpdec.compress import chunked_top_k
from lpdec.compress import identity
from lpdec.compress import minmax
from lpdec.compress import modulo
from lpdec.compress import mx
from lpdec.compress import payload_nbytes
from lpdec.compress import random_k
from lpdec.compress import top_k
from lpdec.fsdp import ShardPlan
from lpdec.fsdp import plan_shards
from lpdec.layout import NodeLayout
from lpdec.layout import init_nodes
from lpdec.layout import make_layout
from lpdec.topology import Topology
from lpdec.topology import complete
from lpdec.topology import directed_ring
from lpdec.topology import exponential
from lpdec.topology import from_matrix
from lpdec.topology import one_peer_exponential
from lpdec.topology import random_matching
from lpdec.topology import ring
from lpdec.topology import torus

__version__ = "0.1.0"

# Every algorithm module's declaration adds its factory, its state classes and its
# other public names (lpdec.algorithms.declaration): nothing to list here.
globals().update(algorithms.exports())

__all__ = [
    "Compressor",
    "Health",
    "NodeLayout",
    "ShardPlan",
    "Topology",
    "async_sim",
    "chain",
    "check_chain",
    "chunked_top_k",
    "complete",
    "compress",
    "data",
    "directed_ring",
    "elastic",
    "exponential",
    "from_matrix",
    "fsdp",
    "gossip",
    "identity",
    "init_nodes",
    "layout",
    "make_layout",
    "metrics",
    "minmax",
    "models",
    "modulo",
    "mx",
    "nn",
    "one_peer_exponential",
    "payload_nbytes",
    "plan_shards",
    "random_k",
    "random_matching",
    "ring",
    "testing",
    "top_k",
    "topology",
    "torus",
    "wire",
]
__all__ += algorithms.exports()
__all__.sort()
