"""lpdec: communication-efficient, low-precision decentralized training in JAX.

The whole public API is re-exported here, every name imported explicitly so that
editors and type checkers see it; see README.md for a tour. Each algorithm module's
declaration (lpdec.algorithms.declaration) names its factory and state classes:
tests/test_api.py checks that this file imports exactly those.
"""

from lpdec import algorithms
from lpdec import async_sim
from lpdec import compress
from lpdec import data
from lpdec import elastic
from lpdec import fsdp
from lpdec import gossip
from lpdec import host_sum
from lpdec import layout
from lpdec import metrics
from lpdec import models
from lpdec import nn
from lpdec import testing
from lpdec import topology
from lpdec import wire
from lpdec.algorithms.chain_order import chain
from lpdec.algorithms.chain_order import check_chain
from lpdec.algorithms.choco import ChocoPerPeerState
from lpdec.algorithms.choco import ChocoState
from lpdec.algorithms.choco import choco
from lpdec.algorithms.clipped_gossip import ClippedGossipState
from lpdec.algorithms.clipped_gossip import clipped_gossip
from lpdec.algorithms.compressed_mean import CompressedMeanState
from lpdec.algorithms.compressed_mean import compressed_mean
from lpdec.algorithms.d2 import D2State
from lpdec.algorithms.d2 import d2
from lpdec.algorithms.dcd import DCDState
from lpdec.algorithms.dcd import dcd
from lpdec.algorithms.deepsqueeze import DeepSqueezeState
from lpdec.algorithms.deepsqueeze import deepsqueeze
from lpdec.algorithms.delay import DelayState
from lpdec.algorithms.delay import delay
from lpdec.algorithms.diloco import DiLoCoState
from lpdec.algorithms.diloco import diloco
from lpdec.algorithms.dpsgd import DPSGDState
from lpdec.algorithms.dpsgd import dpsgd
from lpdec.algorithms.health import Health
from lpdec.algorithms.local_apply_if_finite import LocalIfFiniteState
from lpdec.algorithms.local_apply_if_finite import local_apply_if_finite
from lpdec.algorithms.local_mean import LocalMeanState
from lpdec.algorithms.local_mean import local_mean
from lpdec.algorithms.master_weights import MasterWeightsState
from lpdec.algorithms.master_weights import master_weights
from lpdec.algorithms.moniqua import MoniquaState
from lpdec.algorithms.moniqua import moniqua
from lpdec.algorithms.moniqua import suggest_theta
from lpdec.algorithms.naive_quantized import NaiveQuantizedState
from lpdec.algorithms.naive_quantized import naive_quantized
from lpdec.algorithms.qg_momentum import QGMomentumState
from lpdec.algorithms.qg_momentum import qg_momentum
from lpdec.algorithms.quant_sgp import QuantSGPState
from lpdec.algorithms.quant_sgp import quant_sgp
from lpdec.algorithms.shard_over import ShardOverState
from lpdec.algorithms.shard_over import shard_over
from lpdec.algorithms.sparse_push import SparsePushState
from lpdec.algorithms.sparse_push import sparse_push
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

__all__ = [
    "ChocoPerPeerState",
    "ChocoState",
    "ClippedGossipState",
    "CompressedMeanState",
    "Compressor",
    "D2State",
    "DCDState",
    "DPSGDState",
    "DeepSqueezeState",
    "DelayState",
    "DiLoCoState",
    "Health",
    "LocalIfFiniteState",
    "LocalMeanState",
    "MasterWeightsState",
    "MoniquaState",
    "NaiveQuantizedState",
    "NodeLayout",
    "QGMomentumState",
    "QuantSGPState",
    "ShardOverState",
    "ShardPlan",
    "SparsePushState",
    "Topology",
    "algorithms",
    "async_sim",
    "chain",
    "check_chain",
    "choco",
    "chunked_top_k",
    "clipped_gossip",
    "complete",
    "compress",
    "compressed_mean",
    "d2",
    "data",
    "dcd",
    "deepsqueeze",
    "delay",
    "diloco",
    "directed_ring",
    "dpsgd",
    "elastic",
    "exponential",
    "from_matrix",
    "fsdp",
    "gossip",
    "host_sum",
    "identity",
    "init_nodes",
    "layout",
    "local_apply_if_finite",
    "local_mean",
    "make_layout",
    "master_weights",
    "metrics",
    "minmax",
    "models",
    "modulo",
    "moniqua",
    "mx",
    "naive_quantized",
    "nn",
    "one_peer_exponential",
    "payload_nbytes",
    "plan_shards",
    "qg_momentum",
    "quant_sgp",
    "random_k",
    "random_matching",
    "ring",
    "shard_over",
    "sparse_push",
    "suggest_theta",
    "testing",
    "top_k",
    "topology",
    "torus",
    "wire",
]
