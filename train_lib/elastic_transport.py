"""How an elastic round's bytes move: the interface the round is written against.

`ElasticTrainer._round` (train_lib/elastic.py) hands its transport an `Offer`
(this machine's pseudo-gradient, its codec, its local steps) and gets back
`Moved` (the round's decision and mean, the bytes, the residual the encoding
left). Two transports, chosen by `config.elastic_transport`:

- `Star` ("service"): every payload through the service's key-value store
  (`ElasticGroup.exchange`); on a group over `lpdec.elastic.MemoryStore` it is
  the in-memory transport the protocol's tests drive in one process;
- `Peers` ("peers"): the service decides the round, the bytes go directly
  between its members (`train_lib.elastic_peers.PeerExchange` over
  `lpdec.elastic.peers`, with its limits on sizes, senders, connections and
  inbox).

Both decode every member's contribution with the machine's codec, leave a
non-finite one out (counted) and take the round's mean with the run's weighting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any
from typing import Protocol

import jax
import numpy as np

from lpdec import elastic
from train_lib import elastic_peers


@dataclasses.dataclass(frozen=True)
class Offer:
    """What a machine brings to a round.

    Attributes:
      delta: its pseudo-gradient (the anchor's tree, float32).
      residual: its error feedback's residual, flat (zeros without feedback).
      feedback: whether the exchange keeps a residual.
      steps: the local steps it took.
      anchor_digest: the digest of the anchor it started from.
      payload: () -> (its whole encoded contribution as bytes, the residual it leaves).
      decode: (bytes, sender) -> a member's contribution as a flat float32 vector, or
        None when it holds NaN/Inf.
    """

    delta: Any
    residual: np.ndarray
    feedback: bool
    steps: int
    anchor_digest: str
    payload: Callable[[], tuple[bytes, np.ndarray]]
    decode: Callable[[bytes, int], np.ndarray | None]


@dataclasses.dataclass(frozen=True)
class Moved:
    """What a round decided and moved, as this machine saw it.

    `mean` is flat (None: no finite contribution); `void` says why this machine
    cannot apply the round (a member's bytes did not come), or is "".
    """

    exchange: elastic.Exchange
    mean: np.ndarray | None
    sent: int
    received: int
    residual: np.ndarray
    nonfinite: int
    void: str = ""


class Transport(Protocol):
    def round(self, round_: int, offer: Offer, deadline: float) -> Moved:
        """Decides round `round_` with the service and moves its bytes; raises
        `lpdec.elastic.Behind` when this machine came after the decision and no member
        will send it the round (it joins for the state)."""
        ...


class Star:
    """Every payload through the service (`ElasticGroup.exchange`: a star)."""

    def __init__(self, group: elastic.ElasticGroup, mean: Callable[[list, list[int]], Any]):
        self.group, self.mean = group, mean

    def round(self, round_: int, offer: Offer, deadline: float) -> Moved:
        blob, residual = offer.payload()
        ex = self.group.exchange(round_, blob, offer.steps, offer.anchor_digest, deadline)
        # Sent or dropped, what the payload could not carry stays for the next round.
        decoded = [(offer.decode(c.payload, c.machine), c.steps) for c in ex.contributions]
        kept = [(d, n) for d, n in decoded if d is not None]
        mean = self.mean([d for d, _ in kept], [n for _, n in kept]) if kept else None
        return Moved(
            ex, mean, ex.bytes_sent, ex.bytes_received,
            residual if offer.feedback else offer.residual, len(decoded) - len(kept),
        )  # fmt: skip


class Peers:
    """The bytes directly between the round's members (`PeerExchange`)."""

    def __init__(self, exchange: elastic_peers.PeerExchange, seed: int):
        self.exchange, self.seed = exchange, seed

    def round(self, round_: int, offer: Offer, deadline: float) -> Moved:
        flat = self.exchange.flatten
        r = self.exchange.round(
            round_, offer.delta, self.exchange.unflatten(offer.residual), offer.feedback,
            offer.steps, jax.random.fold_in(jax.random.key(self.seed), round_),
            offer.anchor_digest, deadline, whole_payload=offer.payload,
            decode_whole=offer.decode,
        )  # fmt: skip
        if r.void == elastic_peers.LATE:
            raise elastic.Behind(
                f"machine {self.exchange.peers.machine}'s contribution to round {round_} "
                "came after the decision: no member sends it the mean; it joins for the state"
            )
        residual = flat(r.residual) if offer.feedback else offer.residual
        mean = None if r.mean is None else flat(r.mean)
        return Moved(r.exchange, mean, r.sent, r.received, residual, r.nonfinite, r.void)
