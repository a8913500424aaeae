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
steps are lost, which the metrics count (`included`).

**Joining** (`join`, `serve_joins`). A machine that starts while the run goes
on (or that lost the service and reconnected) posts a signed request; after
each exchange the lowest-numbered machine of the decision answers it with the
state to start the next round from (the caller's bytes: anchor, outer
optimizer state, round), signed, or with a refusal naming the reason; both
sides log one line.

**The token.** Every header, decision, join request and state is signed with
HMAC-SHA256 under the run's token (never written anywhere); what does not
verify is ignored, so a process without the token cannot add to a mean, decide
a round or receive the model. It can still register a slot with the service,
which has no password: bind the service to an address only the run's
machines reach (or use jax's mutual TLS).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from lpdec.elastic import _runtime

ROOT = "lpdec/run"


class ServiceLost(RuntimeError):
    """The coordinating service cannot be reached (or has dropped this machine)."""


class Behind(RuntimeError):
    """The run decided rounds past the one this machine is in, whose records are gone.

    The store keeps the last two decided rounds; a machine further behind (it
    stalled, or its clock of rounds is wrong) must `join` again for the state."""


class JoinRefused(RuntimeError):
    """A live machine refused this machine's join (its message says why)."""


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


def digest(data: bytes) -> str:
    """SHA-256 of `data`, hex."""
    return hashlib.sha256(data).hexdigest()


def _is(error: Exception, code: str) -> bool:
    return code in str(error)


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
    ):
        _runtime.check_address(address, "address")
        if not (isinstance(machines, int) and machines >= 1):
            raise ValueError(f"machines={machines!r} must be an integer >= 1.")
        if not (isinstance(machine, int) and 0 <= machine < machines):
            raise ValueError(f"machine={machine!r} must be an integer in [0, {machines}).")
        self.address, self.machine, self.machines = address, machine, machines
        self._token = bytes(token)
        self.fingerprint = fingerprint
        self.heartbeat_timeout = int(heartbeat_timeout)
        self.connect_timeout = int(connect_timeout)
        self.poll_s = poll_s
        self.client: Any = None
        self.incarnation: int | None = None
        self._lost = threading.Event()
        self._lost_reason = ""
        self._live: dict[int, int] = {}

    # -- connection --------------------------------------------------------

    def connect(self) -> None:
        """Registers this machine's slot (a new incarnation) with the service.

        Raises:
          ServiceLost: the service did not answer within `connect_timeout`.
        """
        self._lost.clear()
        runtime = _runtime.jax_runtime()
        self.client = runtime.get_distributed_runtime_client(
            self.address,
            self.machine,
            init_timeout=self.connect_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            # No missed_heartbeat_callback: jaxlib cannot hand its status to a Python
            # callable (std::bad_cast, abort); without one it ends the process with a
            # line when the service has declared this machine lost. train.py's
            # supervisor restarts it, and the new process joins.
            shutdown_on_destruction=False,
        )
        try:
            self.client.connect()
            live = self.client.get_live_nodes(list(range(self.machines)))
        except Exception as error:  # noqa: BLE001 - jaxlib raises its own status errors
            raise ServiceLost(
                f"could not register with {self.address}: {_first_line(error)}"
            ) from error
        self.incarnation = int(live[self.machine])
        self._live = {int(m): int(i) for m, i in live.items()}
        threading.Thread(target=self._watch, args=(self.client,), daemon=True).start()

    def _watch(self, client: Any) -> None:
        """Keeps `self._live` current (the training thread never blocks on it).

        The service's `get_live_nodes` is a barrier: it answers once every live
        machine has asked (a lost one stops counting after its heartbeat timeout).
        Asked from the training thread, a machine busy with its local steps would
        hold the others' exchange; asked in a loop from this thread on every
        machine, each answer comes as soon as every live machine's thread has asked.
        """
        while self.client is client and not self._lost.is_set():
            try:
                live = client.get_live_nodes(list(range(self.machines)))
            except Exception as error:  # noqa: BLE001
                if self.client is client:
                    self._lost_reason = f"membership: {_first_line(error)}"
                    self._lost.set()
                return
            self._live = {int(m): int(i) for m, i in live.items()}
            time.sleep(self.poll_s)

    def lost(self) -> bool:
        """Whether the service stopped hearing this machine (it must reconnect and join)."""
        return self._lost.is_set()

    def close(self) -> None:
        """Leaves the service (the others see this slot gone at once)."""
        client, self.client = self.client, None
        if client is not None:
            try:
                client.shutdown()
            except Exception:  # noqa: BLE001 - leaving a service that is gone is fine
                pass

    # -- the store, with failures as ServiceLost ----------------------------

    def _call(self, name: str, *args: Any) -> Any:
        if self.client is None:
            raise ServiceLost("not connected")
        try:
            return getattr(self.client, name)(*args)
        except Exception as error:  # noqa: BLE001
            if _is(error, "NOT_FOUND") or _is(error, "ALREADY_EXISTS"):
                raise
            raise ServiceLost(f"{name} failed: {_first_line(error)}") from error

    def _get(self, key: str) -> bytes | None:
        try:
            return self._call("key_value_try_get_bytes", f"{ROOT}/{key}")
        except Exception as error:  # noqa: BLE001
            if _is(error, "NOT_FOUND"):
                return None
            raise

    def _put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        """Writes `key`; with overwrite=False, False if it already existed."""
        try:
            self._call("key_value_set_bytes", f"{ROOT}/{key}", value, overwrite)
            return True
        except Exception as error:  # noqa: BLE001
            if _is(error, "ALREADY_EXISTS"):
                return False
            raise

    def _dir(self, key: str) -> dict[str, bytes]:
        prefix = f"{ROOT}/{key}/"
        return {k[len(prefix) :]: v for k, v in self._call("key_value_dir_get_bytes", prefix)}

    def _delete(self, key: str) -> None:
        try:
            self._call("key_value_delete", f"{ROOT}/{key}")
        except Exception:  # noqa: BLE001 - a key another machine removed first
            pass

    def _sign(self, *fields: Any) -> str:
        message = "|".join(str(f) for f in fields).encode()
        return hmac.new(self._token, message, hashlib.sha256).hexdigest()

    def _verify(self, mac: Any, *fields: Any) -> bool:
        return bool(self._token) and hmac.compare_digest(str(mac), self._sign(*fields))

    # -- membership --------------------------------------------------------

    def live(self) -> dict[int, int]:
        """{machine: incarnation} of the slots the service hears (as of its last answer)."""
        return dict(self._live)

    def latest_round(self) -> int | None:
        """The newest decided round of the run, or None before the first exchange."""
        value = self._get("latest")
        return None if value is None else int(value)

    def finished_round(self) -> int | None:
        """The run's last round if a machine has finished the run (`finish`), else None."""
        value = self._get("finished")
        return None if value is None else int(value)

    def finished_machines(self) -> set[int]:
        """The slots whose current incarnation finished the run."""
        live = self.live()
        done = {int(m): int(v) for m, v in self._dir("done").items()}
        return {m for m, inc in done.items() if live.get(m) == inc}

    def finish(self, last_round: int) -> None:
        """Declares the run over after `last_round` and this machine no trainer.

        A machine still in an earlier round then gets `Behind` at its exchange and
        joins for the final state (see `serve_joins`) instead of deciding rounds alone.
        """
        self._put("finished", str(int(last_round)).encode())
        self._delete(f"active/{self.machine}")
        self._put(f"done/{self.machine}", str(self.incarnation).encode())

    def mark_active(self) -> None:
        """Declares this incarnation a trainer: exchanges wait for its contributions."""
        self._put(f"active/{self.machine}", str(self.incarnation).encode())

    def expected(self) -> set[int]:
        """The machines an exchange waits for: alive, and training under that incarnation."""
        active = {int(m): int(v) for m, v in self._dir("active").items()}
        return {m for m, inc in self.live().items() if active.get(m) == inc}

    # -- the exchange -------------------------------------------------------

    def exchange(
        self, round_: int, payload: bytes, steps: int, anchor_digest: str, deadline: float
    ) -> Exchange:
        """Contributes `payload` to round `round_` and returns the round's decision.

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
        header = {
            "machine": me,
            "incarnation": self.incarnation,
            "steps": int(steps),
            "digest": digest(payload),
            "anchor": anchor_digest,
        }
        header["mac"] = self._sign("c", round_, *(header[k] for k in sorted(header)))
        self._put(f"r{round_}/g/{me}", payload)
        self._put(f"r{round_}/c/{me}", json.dumps(header).encode())
        sent = len(payload)
        while True:
            if self._lost.is_set():
                raise ServiceLost(self._lost_reason)
            decision = self._get(f"r{round_}/d")
            if decision is not None:
                break
            self._check_behind(round_)
            headers = self._headers(round_)
            waited = time.monotonic() - started
            expected = self.expected()
            if expected <= set(headers) or waited >= deadline:
                reason = "all" if expected <= set(headers) else "deadline"
                members = sorted(headers)
                record = {"round": round_, "members": members, "by": me, "reason": reason}
                record["mac"] = self._sign("d", round_, members, me, reason)
                self._put(f"r{round_}/d", json.dumps(record).encode(), overwrite=False)
                continue  # read back whichever decision was written first
            time.sleep(self.poll_s)
        record = json.loads(decision)
        members = [int(m) for m in record["members"]]
        if not self._verify(
            record.get("mac"), "d", round_, members, record["by"], record["reason"]
        ):
            raise ServiceLost(f"round {round_}'s decision is not signed with this run's token")
        headers = self._headers(round_)
        contributions, received = [], 0
        for m in members:
            blob = payload if m == me else self._fetch(f"r{round_}/g/{m}")
            if m != me:
                received += len(blob)
            if m not in headers or digest(blob) != headers[m]["digest"]:
                raise ServiceLost(f"round {round_}: machine {m}'s contribution does not verify")
            contributions.append(
                Contribution(m, int(headers[m]["steps"]), blob, headers[m]["anchor"])
            )
        if record["by"] == me and round_ >= 2:
            self._delete(f"r{round_ - 2}")  # everyone has read it: the next round is decided
        self._put("latest", str(round_).encode())
        return Exchange(
            round=round_,
            members=tuple(members),
            contributions=tuple(contributions),
            included=me in members,
            reason=record["reason"],
            closed_by=int(record["by"]),
            waited_s=time.monotonic() - started,
            bytes_sent=sent,
            bytes_received=received,
        )

    def _check_behind(self, round_: int) -> None:
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

    def _headers(self, round_: int) -> dict[int, dict]:
        """The round's headers that verify under the token, by machine."""
        out = {}
        for name, raw in self._dir(f"r{round_}/c").items():
            try:
                header = json.loads(raw)
                fields = (header[k] for k in sorted(header) if k != "mac")
                if int(name) == header["machine"] and self._verify(
                    header["mac"], "c", round_, *fields
                ):
                    out[int(name)] = header
            except (ValueError, KeyError, TypeError):
                continue
        return out

    def _fetch(self, key: str) -> bytes:
        try:
            return self._call("blocking_key_value_get_bytes", f"{ROOT}/{key}", 30_000)
        except Exception as error:  # noqa: BLE001
            raise ServiceLost(f"could not read {key}: {_first_line(error)}") from error

    # -- joining ------------------------------------------------------------

    def join(self, model: str, timeout: float) -> tuple[int, bytes]:
        """Asks a live machine for the state to start from; returns (round, state).

        `model` is the model's signature (a join with another model is refused).
        The answer comes after the next exchange of the machines that train.

        Raises:
          JoinRefused: a live machine refused (wrong or missing token, another
            config or model), or nobody answered within `timeout` seconds.
          ServiceLost: the service went away.
        """
        # Not a trainer while it waits: exchanges must not wait for its contributions.
        self._delete(f"active/{self.machine}")
        nonce = secrets.token_hex(8)
        request = {
            "machine": self.machine,
            "incarnation": self.incarnation,
            "nonce": nonce,
            "fingerprint": self.fingerprint,
            "model": model,
        }
        request["mac"] = self._sign("j", *(request[k] for k in sorted(request)))
        self._put(f"join/{self.machine}", json.dumps(request).encode())
        waited = 0.0
        while True:
            if self._lost.is_set():
                raise ServiceLost(self._lost_reason)
            reply = self._get(f"reply/{self.machine}/{nonce}")
            if reply is not None:
                break
            if waited >= timeout:
                self._delete(f"join/{self.machine}")
                raise JoinRefused(
                    f"no live machine answered machine {self.machine}'s join within "
                    f"{timeout:g} s (is the run still going?)"
                )
            time.sleep(self.poll_s)
            waited += self.poll_s
        self._delete(f"reply/{self.machine}/{nonce}")
        size = int.from_bytes(reply[:4], "little")
        header, state = json.loads(reply[4 : 4 + size]), reply[4 + size :]
        if "refused" in header:
            raise JoinRefused(f"join refused by machine {header['by']}: {header['refused']}")
        if not self._verify(header.get("mac"), "s", self.machine, nonce, header["round"]) or (
            digest(state) != header.get("digest")
        ):
            raise JoinRefused(
                f"the state machine {header.get('by')} sent does not verify under this "
                "machine's token"
            )
        return int(header["round"]), state

    def serve_joins(self, round_: int, model: str, state: Callable[[], bytes]) -> list[str]:
        """Answers pending join requests with `state()` to start round `round_` from.

        Call it after an exchange, on the lowest machine of the decision. Returns
        one log line per request answered (accepted or refused, and why).
        """
        lines, blob = [], None
        for name, raw in self._dir("join").items():
            try:
                request = json.loads(raw)
                machine, nonce = int(request["machine"]), str(request["nonce"])
            except (ValueError, KeyError, TypeError):
                self._delete(f"join/{name}")
                continue
            fields = (request.get(k) for k in sorted(request) if k != "mac")
            if not self._verify(request.get("mac"), "j", *fields):
                refused = "wrong or missing token"
            elif request.get("fingerprint") != self.fingerprint:
                refused = "its config differs from the run's (fingerprint mismatch)"
            elif request.get("model") != model:
                refused = "its model differs from the run's (parameter shapes differ)"
            else:
                refused = None
            if refused:
                header = {"refused": refused, "by": self.machine}
                body = b""
                lines.append(f"refused machine {machine}'s join: {refused}")
            else:
                blob = state() if blob is None else blob
                header = {
                    "by": self.machine,
                    "round": round_,
                    "digest": digest(blob),
                    "mac": self._sign("s", machine, nonce, round_),
                }
                body = blob
                # A trainer from the round it starts: the next exchange waits for it
                # (up to its deadline) instead of deciding rounds while it starts up.
                self._put(f"active/{machine}", str(request.get("incarnation")).encode())
                lines.append(
                    f"machine {machine} joins at round {round_} ({len(blob)} bytes of state)"
                )
            raw_header = json.dumps(header).encode()
            self._put(
                f"reply/{machine}/{nonce}",
                len(raw_header).to_bytes(4, "little") + raw_header + body,
            )
            self._delete(f"join/{name}")
        return lines


def _first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
