"""An elastic round whose bytes go between the machines (`config.elastic_transport="peers"`).

The service decides the round (`ElasticGroup.decide`: the signed headers, each
with the member's peer address, and the decision); the payloads go directly
between the members through `lpdec.elastic.peers`:

- `config.exchange="mean"`, or `"compressed_mean"` with `config.mean_rounds=2`:
  a reduce-scatter and an all-gather. The flat pseudo-gradient is cut into one
  chunk per member; each member's part of chunk j goes to member j, who averages
  the parts (the same `step_weighted_mean` / `slot_mean` as the star, element by
  element in the decision's order) and sends the mean chunk to every member:
  float32 for "mean" (the star's mean, bit for bit), encoded again with the
  compressor for "compressed_mean" (compressed twice, as the non-elastic
  compressed mean of `mean_rounds=2`; the error feedback covers the first).
  Each member sends and receives 2 (n - 1) / n of a payload.
- `"compressed_mean"` with `mean_rounds=1`: an all-gather of the whole payloads
  between the members (the star's arithmetic and bits, without the service's
  link carrying n (n - 1) payloads a round).

A member that took no finite step this round (its pseudo-gradient holds NaN/Inf)
posts 0 steps and every member leaves its parts out, as the star drops it.

A member lost after the decision leaves the others without its parts or its mean
chunk (`PeerTimeout` after `--elastic_deadline`): the round is void for every
member that did not get the whole mean (its anchor stays; the round's steps are
lost, as a dropped contribution's), and the run goes on with the next round.
A member that misses only part of the mean while others got all of it (the
lost member died while sending its mean chunk) leaves the anchors apart: the
next round's `anchors_agree` says so. A machine whose header came after the
decision (late) gets no bytes at all and joins for the state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import lpdec
from lpdec import elastic
from lpdec.elastic import peers as p2p
from lpdec.kernels_pallas import numerics

#: `Round.void` of a machine whose header came after the decision: it is no member, so
#: no member sends it the mean; it joins for the state (the star lets it apply the mean).
LATE = "late"
#: Chunks are cut at multiples of this many values (every compressor's block divides it).
ALIGN = 4096


@dataclasses.dataclass
class Round:
    """What one peer-to-peer round decided and moved, for the trainer's row."""

    exchange: elastic.Exchange
    mean: Any  # the round's mean pseudo-gradient (the anchor's tree), or None: void
    residual: Any  # the error feedback's residual after this round's encoding
    sent: int
    received: int
    nonfinite: int  # members whose contribution was left out for NaN/Inf
    void: str = ""  # why the round is void (a member's bytes did not come), or ""


def message_bytes(values: int) -> int:
    """The longest message a machine of a model of `values` parameters may send a peer."""
    return 8 * values + (1 << 20)


class PeerExchange:
    """One machine's peer-to-peer exchange (see the module docstring).

    Args:
      group: the machine's `ElasticGroup` (membership and decisions).
      peers: its `lpdec.elastic.peers.Peers` (listening, with the run's token).
      like: the anchor (a tree of float32 arrays: the pseudo-gradient's structure).
      compressor: the exchange's compressor (`lpdec.identity()` for "mean").
      compressed: whether the exchange compresses ("compressed_mean").
      rounds: 2 (reduce-scatter + all-gather) or 1 (all-gather of whole payloads).
      encode_tree / decode_tree: the trainer's whole-tree codec (rounds=1).
      mean: (deltas, steps) -> their mean (the trainer's elastic_mean).
      decay: error feedback's residual decay (`config.error_decay`): the two-round
        exchange encodes v = delta + decay * residual.
    """

    def __init__(
        self,
        group: elastic.ElasticGroup,
        peers: p2p.Peers,
        like: Any,
        compressor: Any,
        compressed: bool,
        rounds: int,
        mean: Callable[[list, list[int]], Any],
        decay: float = 1.0,
    ):
        self.group, self.peers = group, peers
        self.decay = decay  # error feedback's residual decay (config.error_decay)
        self.leaves, self.treedef = jax.tree.flatten(like)
        self.sizes = [int(np.size(x)) for x in self.leaves]
        self.size = sum(self.sizes)
        self.compressor, self.compressed, self.rounds = compressor, compressed, rounds
        self.mean = mean
        self._encoders: dict[int, tuple] = {}
        # What a member may send: at most the whole pseudo-gradient's payload; no codec
        # here sends more than 8 bytes a value (a sparsifier's int32 index and float32
        # value; float32 itself is 4), and 1 MiB covers the packing's framing.
        peers.set_limits(message_bytes(self.size), group.machines)

    # -- flat vectors ----------------------------------------------------------

    def flatten(self, tree: Any) -> np.ndarray:
        return np.concatenate([np.ravel(np.asarray(x, np.float32)) for x in jax.tree.leaves(tree)])

    def unflatten(self, flat: np.ndarray) -> Any:
        out, at = [], 0
        for x, n in zip(self.leaves, self.sizes, strict=True):
            out.append(flat[at : at + n].reshape(np.shape(x)))
            at += n
        return jax.tree.unflatten(self.treedef, out)

    # -- a chunk's codec ---------------------------------------------------------

    def _codec(self, size: int) -> tuple:
        """(encode: (x, key) -> (payload, decoded), like) for chunks of `size` values."""
        if size not in self._encoders:
            compressor = self.compressor

            def encode(x, key):
                payload = lpdec.compress.tree.encode_tree(
                    compressor, [x], key if compressor.needs_key else None
                )
                return payload, lpdec.compress.tree.decode_tree(compressor, payload, [x])[0]

            shape = jax.ShapeDtypeStruct((size,), np.float32)
            like = jax.eval_shape(encode, shape, jax.random.key(0))[0]
            decode = jax.jit(lambda p: lpdec.compress.tree.decode_tree(compressor, p, [shape])[0])
            self._encoders[size] = (jax.jit(encode), decode, like)
        return self._encoders[size]

    def encode(self, x: np.ndarray, key) -> tuple[bytes, np.ndarray]:
        """A chunk's bytes and what a receiver decodes from them."""
        if not self.compressed or x.size == 0:  # (a model smaller than n x ALIGN values)
            x = np.ascontiguousarray(x, np.float32)
            return x.tobytes(), x
        encode, _, _ = self._codec(x.size)
        payload, decoded = encode(x, key)
        return elastic.pack(payload), np.asarray(decoded)

    def decode(self, blob: bytes, size: int) -> np.ndarray:
        if not self.compressed or size == 0:
            return np.frombuffer(blob, np.float32, size).copy()
        _, decode, like = self._codec(size)
        return np.asarray(decode(elastic.unpack(blob, like)))

    # -- the round ------------------------------------------------------------

    def round(
        self,
        round_: int,
        delta: Any,
        residual: Any,
        feedback: bool,
        steps: int,
        key,
        anchor_digest: str,
        deadline: float,
        whole_payload: Callable[[], tuple[bytes, Any]],
        decode_whole: Callable[[bytes, int], Any],
    ) -> Round:
        """Decides round `round_` with the service and moves its bytes between the members.

        `whole_payload()` -> (bytes, residual) and `decode_whole(bytes, sender)` -> the
        decoded contribution (None: not finite) are the trainer's own codec, used by the
        one-round (all-gather) exchange.
        """
        self.peers.forget(round_)  # what earlier rounds left (late or forged messages)
        flat = self.flatten(delta)
        finite = bool(np.isfinite(flat).all())
        ex, addresses = self.group.decide(
            round_, steps if finite else 0, anchor_digest, deadline, peer=self.peers.address
        )
        if self.peers.machine not in ex.members:
            return Round(ex, None, residual, 0, 0, 0, void=LATE)
        try:
            return self._move(round_, ex, addresses, flat, residual, feedback, key, deadline,
                              whole_payload, decode_whole)  # fmt: skip
        except p2p.PeerTimeout as error:
            self.peers.forget(round_ + 1)
            return Round(ex, None, residual, 0, 0, 0, void=str(error))

    def _move(self, round_, ex, addresses, flat, residual, feedback, key, deadline,
              whole_payload, decode_whole) -> Round:  # fmt: skip
        members = list(ex.members)
        weights = {c.machine: c.steps for c in ex.contributions}
        nonfinite = sum(weights[m] == 0 for m in members)
        me = self.peers.machine
        if self.rounds == 1:
            payload, new_residual = whole_payload()
            blobs = p2p.all_gather(self.peers, round_, members, addresses, payload, deadline)
            pairs = zip(members, blobs, strict=True)
            decoded = [(decode_whole(b, m), weights[m]) for m, b in pairs if weights[m]]
            kept = [(d, w) for d, w in decoded if d is not None]
            nonfinite += len(decoded) - len(kept)
            mean = self.mean([d for d, _ in kept], [w for _, w in kept]) if kept else None
            n = len(members) - 1
            received = sum(map(len, blobs)) - len(payload)
            return Round(ex, mean, new_residual, len(payload) * n, received, nonfinite)
        # v = update + decay * residual, rounded as every lpdec exchange rounds it.
        v = (
            np.asarray(numerics.feedback_sum(flat, self.flatten(residual), self.decay))
            if feedback
            else flat
        )
        cuts = p2p.split(self.size, len(members), align=ALIGN)
        parts, new_flat = [], np.zeros_like(v)
        for j, (a, b) in enumerate(cuts):
            blob, decoded = self.encode(v[a:b], jax.random.fold_in(key, j))
            parts.append(blob)
            new_flat[a:b] = v[a:b] - decoded
        new_residual = self.unflatten(new_flat) if feedback else residual

        got: list[int] = []

        def reduce(j: int, blobs: list[bytes]) -> bytes:
            a, b = cuts[j]
            got.extend(len(p) for m, p in zip(members, blobs, strict=True) if m != me)
            pairs = zip(members, blobs, strict=True)
            kept = [(self.decode(p, b - a), weights[m]) for m, p in pairs if weights[m]]
            chunk = (
                self.mean([d for d, _ in kept], [w for _, w in kept])
                if kept
                else np.zeros(b - a, np.float32)
            )
            return self.encode(chunk, jax.random.fold_in(key, 1_000_000 + j))[0]

        chunks = p2p.reduce_scatter_gather(
            self.peers, round_, members, addresses, parts, reduce, deadline
        )
        mean = None
        if any(weights.values()):
            mean = self.unflatten(
                np.concatenate(
                    [self.decode(c, b - a) for c, (a, b) in zip(chunks, cuts, strict=True)]
                )
            )
        mine = members.index(me)
        sent = sum(len(p) for j, p in enumerate(parts) if j != mine)
        sent += len(chunks[mine]) * (len(members) - 1)
        received = sum(len(c) for j, c in enumerate(chunks) if j != mine) + sum(got)
        return Round(ex, mean, new_residual, sent, received, nonfinite)
