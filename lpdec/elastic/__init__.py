"""Elastic local-step training: machines that come and go (issue 27).

A DiLoCo run whose machines meet only at exchanges, through jax's own
coordination service run standalone (`service`): a lost machine is dropped
from the next exchange, a machine that (re)starts joins at an exchange with
the state of a live one, a late contribution is dropped, machines may take
different numbers of local steps (a mean weighted by them). `group` holds the
protocol's membership and exchange, `joins` its joins, `signing` the run's
token, `gate` the service's door (only the token's holders reach jax's
service), `store` the service it meets at (jax's, or one in memory for tests),
`codec` the bytes and the arithmetic. Needs nothing beyond jax;
`train.py --elastic_service=...` runs it (see docs/training.md).
"""

from lpdec.elastic import credentials
from lpdec.elastic import gate
from lpdec.elastic import peers
from lpdec.elastic.codec import pack
from lpdec.elastic.codec import signature
from lpdec.elastic.codec import slot_mean
from lpdec.elastic.codec import step_weighted_mean
from lpdec.elastic.codec import tree_digest
from lpdec.elastic.codec import unpack
from lpdec.elastic.gate import GateRefused
from lpdec.elastic.group import Behind
from lpdec.elastic.group import Contribution
from lpdec.elastic.group import ElasticGroup
from lpdec.elastic.group import Exchange
from lpdec.elastic.joins import JoinRefused
from lpdec.elastic.service import Service
from lpdec.elastic.service import serve_forever
from lpdec.elastic.service import start
from lpdec.elastic.store import MemoryService
from lpdec.elastic.store import MemoryStore
from lpdec.elastic.store import ServiceLost
from lpdec.elastic.store import ServiceStore
from lpdec.elastic.store import Store

__all__ = [
    "peers",
    "credentials",
    "gate",
    "Behind",
    "Contribution",
    "ElasticGroup",
    "Exchange",
    "GateRefused",
    "JoinRefused",
    "MemoryService",
    "MemoryStore",
    "ServiceLost",
    "Service",
    "ServiceStore",
    "Store",
    "pack",
    "serve_forever",
    "signature",
    "slot_mean",
    "start",
    "step_weighted_mean",
    "tree_digest",
    "unpack",
]
