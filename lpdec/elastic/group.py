"""Membership and exchange of an elastic run, on jax's coordination service.

`ElasticGroup` is one machine's seat in the run. Each machine owns a slot
0 .. M-1 of the service (its identity); the service tracks which slots are
alive by heartbeats and gives every (re)start of a slot a new incarnation
number. Everything else goes through the service's key-value store, under
`lpdec/run/`:

    active/<m>          incarnation of m while it trains (not while it joins)
    r<R>/g/<m>          m's contribution to round R's exchange (bytes)
    r<R>/c/<m>          its signed header: local steps, payload digest, anchor digest
    r<R>/d              the round's decision: which contributions the mean is over
    latest              the newest decided round
    join/<m>            a join request;  reply/<m>/<nonce>: its answer
    finished, done/<m>  the run's last round; the machines that finished it
    resume/<m>          on a fresh service: the round of m's saved state (`resume`)

**The exchange of round R** (`exchange`). A machine writes its contribution,
then waits until every *expected* machine has contributed (alive, with the
incarnation it trains under: a dead machine is dropped from the wait as soon
as the service notices, after its heartbeat timeout) or until its `deadline`
passes. Whoever gets there first writes the decision, the sorted list of the
contributions present, with the store's create-only write: exactly one
decision per round exists, and every machine reads the same one, so every
machine averages the same contributions in the same order and the anchors stay
bit-identical. A contribution that arrives after the decision is *dropped*:
its machine still applies the round's mean (it is late, not lost) and starts
the next round from the same anchor as everyone; the dropped pseudo-gradient's
steps are lost, which the metrics count (`included`). The machine that decides
round R removes round R-2's records, after marking R decided (`latest`, never
lowered); a machine that reads a decision checks `latest` once more, so one the
run left behind (whose create-only write could recreate a removed decision) is
told to join instead of applying a round nobody else applied.

**Without payloads** (`decide`). The same round with only the headers, each
carrying the member's peer address: the decision says who is in the round, and
the bytes go directly between the members (`lpdec.elastic.peers`), so the
service's link carries no payload at all.

**Joining** (`join`, `serve_joins`). A machine that starts while the run goes
on (or that lost the service and reconnected) posts a signed request; after
each exchange the lowest-numbered machine of the decision answers it with the
state to start the next round from (the caller's bytes: anchor, outer
optimizer state, round), signed, or with a refusal naming the reason; both
sides log one line.

**The token.** Every header, decision, join request and state is signed with
HMAC-SHA256 under the run's token (never written anywhere); what does not
verify is ignored, so a process without the token cannot add to a mean, decide
a round or receive the model. Nor can it register a slot: `connect` proves the
token at the service's gate first (`lpdec.elastic.gate`), and a process that
cannot is refused (`GateRefused`) before anything of it reaches jax's service,
so a live machine keeps its slot and its incarnation.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

from lpdec.elastic import joins
from lpdec.elastic.credentials import Credentials
from lpdec.elastic.joins import JoinRefused
from lpdec.elastic.signing import Signer
from lpdec.elastic.signing import digest
from lpdec.elastic.store import ServiceLost
from lpdec.elastic.store import ServiceStore
from lpdec.elastic.store import Store

__all__ = ["Behind", "Contribution", "ElasticGroup", "Exchange", "JoinRefused", "ServiceLost"]


class Behind(RuntimeError):
    """The run decided rounds past the one this machine is in, whose records are gone.

    The store keeps the last two decided rounds; a machine further behind (it
    stalled, or its clock of rounds is wrong) must `join` again for the state."""


@dataclasses.dataclass(frozen=True)
class Contribution:
    """One machine's part of a round: its local steps and its encoded pseudo-gradient."""

    machine: int
    steps: int
    payload: bytes
    anchor_digest: str


@dataclasses.dataclass(frozen=True)
class Exchange:
    """What one round's exchange decided, as this machine saw it.

    Attributes:
      round: the round.
      members: the machines whose contributions the mean is over (sorted).
      contributions: theirs, in `members` order.
      included: whether this machine's own contribution is among them.
      reason: "all" (every expected machine contributed) or "deadline".
      closed_by: the machine that wrote the decision.
      waited_s: seconds this machine waited after contributing.
      bytes_sent / bytes_received: through the service, this machine's share.
    """

    round: int
    members: tuple[int, ...]
    contributions: tuple[Contribution, ...]
    included: bool
    reason: str
    closed_by: int
    waited_s: float
    bytes_sent: int
    bytes_received: int


class ElasticGroup:
    """One machine's membership in an elastic run (see the module docstring).

    Args:
      address: the coordinating service, "host:port".
      machine: this machine's slot, 0 <= machine < machines.
      machines: the service's slot count (all start together; later any may
        leave and come back).
      token: the run's secret (bytes); b"" means this machine has none, and it
        is refused wherever a signature is checked.
      fingerprint: the run's config fingerprint; a join with another is refused.
      heartbeat_timeout: seconds without a heartbeat before the service counts
        a machine as lost (the service's own setting decides; keep them equal).
      connect_timeout: seconds to wait for the service (a fresh start waits for
        every slot to register).
      poll_s: how often a waiting machine looks at the store.
      store: the service to meet at (default: a `ServiceStore` on `address`;
        tests pass a `store.MemoryStore`).
      credentials, private_network: the `ServiceStore`'s (mutual TLS; or a
        network the user says is private, for an address off loopback).
    """

    def __init__(
        self,
        address: str,
        machine: int,
        machines: int,
        token: bytes,
        fingerprint: str,
        *,
        heartbeat_timeout: int = 10,
        connect_timeout: int = 300,
        poll_s: float = 0.05,
        store: Store | None = None,
        credentials: Credentials | None = None,
        private_network: bool = False,
    ):
        if not (isinstance(machines, int) and machines >= 1):
            raise ValueError(f"machines={machines!r} must be an integer >= 1.")
        if not (isinstance(machine, int) and 0 <= machine < machines):
            raise ValueError(f"machine={machine!r} must be an integer in [0, {machines}).")
        if store is None:
            store = ServiceStore(
                address,
                machine,
                machines,
                heartbeat_timeout=heartbeat_timeout,
                connect_timeout=connect_timeout,
                poll_s=poll_s,
                credentials=credentials,
                private_network=private_network,
                token=token,
            )
        self.address, self.machine, self.machines = address, machine, machines
        self.store = store
        self.signer = Signer(token)
        self.fingerprint = fingerprint
        self.poll_s = poll_s
        self.incarnation: int | None = None
        self._finished: int | None = None  # the run's last round, once this machine ended it
        self._latest_seen: int | None = None  # "latest" as this machine's last decision read it

    # -- connection --------------------------------------------------------

    def connect(self) -> None:
        """Proves the token at the service's gate, then registers this machine's slot
        (a new incarnation) with the service.

        Raises:
          GateRefused: the gate refused this machine (a wrong or missing token);
            nothing registered, the slot's live machine (if any) is untouched.
          ServiceLost: the service did not answer within its connect timeout.
        """
        self.incarnation = self.store.connect()

    def lost(self) -> bool:
        """Whether the service stopped hearing this machine (it must reconnect and join)."""
        return self.store.lost() is not None

    def check_lost(self) -> None:
        """Raises ServiceLost (with the reason) if the service stopped hearing this machine."""
        reason = self.store.lost()
        if reason is not None:
            raise ServiceLost(reason)

    def close(self) -> None:
        """Leaves the service (the others see this slot gone at once); after `finish`,
        tells the service first that the run has ended (it says so and stops)."""
        finished, self._finished = self._finished, None
        if finished is not None:
            self.store.announce_finished(finished)
        self.store.close()

    # -- membership --------------------------------------------------------

    def live(self) -> dict[int, int]:
        """{machine: incarnation} of the slots the service hears (as of its last answer)."""
        return self.store.live()

    def latest_round(self) -> int | None:
        """The newest decided round of the run, or None before the first exchange."""
        value = self.store.get("latest")
        return None if value is None else int(value)

    def finished_round(self) -> int | None:
        """The run's last round if a machine has finished the run (`finish`), else None."""
        value = self.store.get("finished")
        return None if value is None else int(value)

    def finished_machines(self) -> set[int]:
        """The slots whose current incarnation finished the run."""
        live = self.live()
        done = {int(m): int(v) for m, v in self.store.dir("done").items()}
        return {m for m, inc in done.items() if live.get(m) == inc}

    def finish(self, last_round: int) -> None:
        """Declares the run over after `last_round` and this machine no trainer.

        A machine still in an earlier round then gets `Behind` at its exchange and
        joins for the final state (see `serve_joins`) instead of deciding rounds alone.
        """
        self.store.put("finished", str(int(last_round)).encode())
        self.store.delete(f"active/{self.machine}")
        self.store.put(f"done/{self.machine}", str(self.incarnation).encode())
        self._finished = int(last_round)

    def mark_active(self) -> None:
        """Declares this incarnation a trainer: exchanges wait for its contributions."""
        self.store.put(f"active/{self.machine}", str(self.incarnation).encode())

    def resume(self, round_: int, state_digest: str, timeout: float) -> dict[int, tuple[int, str]]:
        """On a fresh service (no round decided): where each machine's saved state is.

        Posts this machine's signed record (the round its saved state starts, -1 for
        none, and the state's digest), then waits until every machine the service
        hears has posted one, or `timeout` seconds. Returns {machine: (round,
        digest)} of the records that verify: the machines holding the highest round
        (with the lowest one's digest) go on from their own state, the others join.

        Raises:
          ServiceLost: the service went away.
        """
        record = {"machine": self.machine, "round": int(round_), "digest": state_digest}
        record["mac"] = self.signer.sign("r", self.machine, int(round_), state_digest)
        self.store.put(f"resume/{self.machine}", json.dumps(record).encode())
        started = time.monotonic()
        while True:
            self.check_lost()
            records = {}
            for name, raw in self.store.dir("resume").items():
                try:
                    r = json.loads(raw)
                    m, at, dig = int(r["machine"]), int(r["round"]), str(r["digest"])
                except (ValueError, KeyError, TypeError):
                    continue
                if m == int(name) and self.signer.verify(r.get("mac"), "r", m, at, dig):
                    records[m] = (at, dig)
            if set(self.live()) <= set(records) or time.monotonic() - started >= timeout:
                return records
            time.sleep(self.poll_s)

    def expected(self) -> set[int]:
        """The machines an exchange waits for: alive, and training under that incarnation."""
        active = {int(m): int(v) for m, v in self.store.dir("active").items()}
        return {m for m, inc in self.live().items() if active.get(m) == inc}

    # -- the exchange -------------------------------------------------------

    def exchange(
        self, round_: int, payload: bytes, steps: int, anchor_digest: str, deadline: float
    ) -> Exchange:
        """Contributes `payload` to round `round_` and returns the round's decision.

        The star: every payload goes through the service, and every machine reads
        every member's (`decide` is the same round without payloads, for an exchange
        whose bytes go between the machines: `lpdec.elastic.peers`).

        Args:
          round_: the round (the same count on every machine: rounds since the start).
          payload: this machine's encoded pseudo-gradient.
          steps: the local steps it took this round (the mean's weight).
          anchor_digest: digest of the anchor the round started from (a check that
            every member started from the same one).
          deadline: seconds to wait for the expected machines after contributing.

        Raises:
          ServiceLost: the service went away (reconnect, then `join`).
          Behind: the run is more than a round ahead of `round_`, or ended before
            it (`join` again).
        """
        me, started = self.machine, time.monotonic()
        self._check_behind(round_)
        self.store.put(f"r{round_}/g/{me}", payload)
        record, headers = self._decide(round_, payload, steps, anchor_digest, deadline, {})
        contributions, received = [], 0
        for m in record["members"]:
            blob = payload if m == me else self.store.fetch(f"r{round_}/g/{m}", 30.0)
            if m != me:
                received += len(blob)
            if m not in headers or digest(blob) != headers[m]["digest"]:
                raise ServiceLost(f"round {round_}: machine {m}'s contribution does not verify")
            contributions.append(
                Contribution(m, int(headers[m]["steps"]), blob, headers[m]["anchor"])
            )
        return self._decided(round_, record, contributions, started, len(payload), received)

    def decide(
        self,
        round_: int,
        steps: int,
        anchor_digest: str,
        deadline: float,
        peer: str = "",
        digest_: str = "",
    ) -> tuple[Exchange, dict[int, str]]:
        """Round `round_`'s decision without payloads: who the mean is over.

        For an exchange whose bytes go directly between the members
        (`lpdec.elastic.peers`); the service carries only the signed headers and the
        decision. The contributions it returns have empty payloads.

        Args:
          round_, steps, anchor_digest, deadline: as `exchange`'s.
          peer: this machine's "host:port" for the members' peer-to-peer exchange.
          digest_: a digest of what this machine will send (recorded in its header).

        Returns:
          (the decision, {member: its peer address}).
        """
        started = time.monotonic()
        self._check_behind(round_)
        extra = {"peer": str(peer)}
        record, headers = self._decide(
            round_, digest_.encode(), steps, anchor_digest, deadline, extra
        )
        contributions = [
            Contribution(m, int(headers[m]["steps"]), b"", headers[m]["anchor"])
            for m in record["members"]
        ]
        addresses = {m: str(headers[m].get("peer", "")) for m in record["members"]}
        return self._decided(round_, record, contributions, started, 0, 0), addresses

    def _decide(
        self,
        round_: int,
        payload: bytes,
        steps: int,
        anchor_digest: str,
        deadline: float,
        extra: dict,
    ) -> tuple[dict, dict[int, dict]]:
        """Posts this machine's signed header and waits for the round's decision.

        Returns (the decision record, with its members as ints; the round's headers
        that verify, by machine)."""
        me, started = self.machine, time.monotonic()
        header = {
            "machine": me,
            "incarnation": self.incarnation,
            "steps": int(steps),
            "digest": digest(payload),
            "anchor": anchor_digest,
            **extra,
        }
        header["mac"] = self.signer.sign("c", round_, *(header[k] for k in sorted(header)))
        self.store.put(f"r{round_}/c/{me}", json.dumps(header).encode())
        # Rarely changing things are read at most every `slow_s`: with n machines
        # polling one service, each call a poll saves is n calls.
        # (The caller checked `_check_behind` just before.)
        slow_s, checked, expected, headers = 0.25, started, self.expected(), {}
        while True:
            self.check_lost()
            decision = self.store.get(f"r{round_}/d")
            if decision is not None:
                break
            now = time.monotonic()
            if now - checked >= slow_s:
                self._check_behind(round_)
                expected, checked = self.expected(), now
            headers = self._headers(round_)
            waited = now - started
            if expected <= set(headers) or waited >= deadline:
                # Before deciding, always: the run may have moved on and removed this
                # round's records (this machine's own header with them).
                self._check_behind(round_)
                if me not in headers:
                    raise Behind(
                        f"machine {me}'s header for round {round_} is gone: the run moved "
                        "on; it must join again"
                    )
                reason = "all" if expected <= set(headers) else "deadline"
                members = sorted(headers)
                record = {"round": round_, "members": members, "by": me, "reason": reason}
                record["mac"] = self.signer.sign("d", round_, members, me, reason)
                self.store.put(f"r{round_}/d", json.dumps(record).encode(), overwrite=False)
                continue  # read back whichever decision was written first
            # Blocked in the service until the decision is written (the last machine to
            # post its header writes it at once), or for a while: then look again.
            # Never past the deadline: a machine must decide when it comes.
            left = deadline - (time.monotonic() - started)
            wait_s = max(0.001, min(slow_s, 20 * self.poll_s, left))
            decision = self.store.wait(f"r{round_}/d", wait_s)
            if decision is not None:
                break
        # The decision read may be one a machine wrote after the run had moved on and
        # removed the round's records (its own, if this machine's last check came just
        # before that): a decision no other machine applied. The run marks the newer
        # round decided before it removes an old one (`_decided`), so looking again
        # now tells.
        latest = self._check_behind(round_)
        record = json.loads(decision)
        record["members"] = [int(m) for m in record["members"]]
        if not self.signer.verify(
            record.get("mac"), "d", round_, record["members"], record["by"], record["reason"]
        ):
            raise ServiceLost(f"round {round_}'s decision is not signed with this run's token")
        if not set(record["members"]) <= set(headers):
            headers = self._headers(round_)
        missing = [m for m in record["members"] if m not in headers]
        if missing:
            raise ServiceLost(
                f"round {round_}: machine(s) {missing} in the decision have no header"
            )
        self._latest_seen = latest
        return record, headers

    def _decided(
        self,
        round_: int,
        record: dict,
        contributions: list,
        started: float,
        sent: int,
        received: int,
    ) -> Exchange:
        # "latest" first: a machine that finds round r-2's records gone must also find
        # the run past it (`_decide`'s last check).
        # Never lowered: a machine a round behind reads the newer "latest" just above.
        if self._latest_seen is None or round_ > self._latest_seen:
            self.store.put("latest", str(round_).encode())
        if record["by"] == self.machine and round_ >= 2:
            self.store.delete(f"r{round_ - 2}")  # everyone has read it: the next round is decided
        members = tuple(record["members"])
        return Exchange(
            round=round_,
            members=members,
            contributions=tuple(contributions),
            included=self.machine in members,
            reason=record["reason"],
            closed_by=int(record["by"]),
            waited_s=time.monotonic() - started,
            bytes_sent=sent,
            bytes_received=received,
        )

    def _check_behind(self, round_: int) -> int | None:
        """Raises `Behind` if the run ended before `round_` or decided a round past
        `round_ + 1`; returns the newest decided round read (None: none yet)."""
        finished = self.finished_round()
        if finished is not None and round_ > finished:
            raise Behind(
                f"machine {self.machine} is in round {round_} but the run ended after round "
                f"{finished}: it must join for the final state"
            )
        latest = self.latest_round()
        if latest is not None and latest > round_ + 1:
            raise Behind(
                f"machine {self.machine} is in round {round_} but the run decided round "
                f"{latest}: it must join again"
            )
        return latest

    def _headers(self, round_: int) -> dict[int, dict]:
        """The round's headers that verify under the token, by machine."""
        out = {}
        for name, raw in self.store.dir(f"r{round_}/c").items():
            try:
                header = json.loads(raw)
                fields = (header[k] for k in sorted(header) if k != "mac")
                if int(name) == header["machine"] and self.signer.verify(
                    header["mac"], "c", round_, *fields
                ):
                    out[int(name)] = header
            except (ValueError, KeyError, TypeError):
                continue
        return out

    # -- joining (lpdec.elastic.joins) --------------------------------------

    def join(self, model: str, timeout: float) -> tuple[int, bytes]:
        """Asks a live machine for the state to start from; returns (round, state).

        See `joins.request`.
        """
        return joins.request(self, model, timeout)

    def serve_joins(self, round_: int, model: str, state: Callable[[], bytes]) -> list[str]:
        """Answers pending join requests with `state()` to start round `round_` from.

        Call it after an exchange, on the lowest machine of the decision; see
        `joins.serve`.
        """
        return joins.serve(self, round_, model, state)
