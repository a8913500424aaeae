"""Peer-to-peer exchange of an elastic round: the bytes go between the machines.

The star (`ElasticGroup.exchange`) moves every payload through the coordinating
service: with n machines the service's link carries n payloads in and n (n - 1)
out per round, so a round's time grows with n^2 on one link. Here the service
keeps what it is good at (liveness, the round's decision, joins) and the
payloads go directly between the round's members, as a reduce-scatter and an
all-gather (`reduce_scatter_gather`):

1. the n members cut the round's flat vector into n chunks; member i sends its
   encoded part of chunk j to member j, chunk j's owner;
2. each owner reduces the n parts of its chunk (decodes, averages, encodes the
   mean: the caller's `reduce`);
3. each owner sends its reduced chunk to every other member.

Every member sends and receives 2 (n - 1) / n of a payload: a ring all-reduce's
bytes, over n - 1 direct connections at once instead of n - 1 sequential ring
steps. Every member ends with the same bytes for every chunk, so every member
decodes the same mean.

**Who may send.** A message is a fixed-size frame header (`FRAME` bytes: kind,
round, sender, chunk, body length and the body's SHA-256) signed with an
HMAC-SHA256 under the run's token, then the body. The receiver reads the header
alone, checks its signature, the sender's slot, the kind, the chunk and the
length against its limits, and only then reads the body (and checks it against
the signed digest): a process without the token costs the receiver `FRAME`
bytes before its connection is closed, whatever length it announces. With the
run's credentials (`lpdec.elastic.credentials`) the connections are mutual TLS
too: a peer must present a certificate the run's CA signed, naming a machine of
this run, and nothing crosses the network in the clear.

**Limits.** The receiver bounds what anyone can make it hold: a body is at most
`max_message_bytes` (the caller derives it from the model: `PeerExchange`), the
inbox at most `INBOX_MESSAGES` messages and 2 `max_message_bytes` per sender
(older rounds are dropped first, then the newcomer; counted in `dropped`), and
connections that have not yet sent a signed header at most `max_pending` (the
oldest is closed when another arrives) for at most `header_s` seconds; once a
header verifies, the connection speaks for its sender, one connection per
sender (a newer one replaces it). Every read has a deadline (a header within
`header_s`, a body at `MIN_RATE` bytes/s at least), so a slow sender holds a
thread for seconds, not forever. The receiver acknowledges every message; a
sender whose message was not acknowledged connects again and resends it until
its timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from lpdec.elastic.credentials import Credentials

__all__ = [
    "FRAME",
    "MAX_MESSAGE_BYTES",
    "PeerTimeout",
    "Peers",
    "all_gather",
    "reduce_scatter_gather",
    "split",
]

#: The kinds of message a round sends (a header naming another is refused).
KINDS = ("part", "mean", "payload")
_MAGIC = b"LPD1"  # the frame format's version
# magic, kind, round, sender, chunk, body length, SHA-256 of the body, then the header's HMAC.
_HEADER = struct.Struct("!4sBQIIQ32s")
_MAC_SIZE = hashlib.sha256().digest_size
#: Bytes of a frame's header, read (and bounded) before anything else.
FRAME = _HEADER.size + _MAC_SIZE
#: The hard ceiling of `max_message_bytes` (4 GiB: the largest body the format ever carried).
MAX_MESSAGE_BYTES = 1 << 32
#: A body must arrive at this many bytes/s at least, after `header_s` of grace (a signed
#: sender's: one without the token never gets this far). 64 kB/s: a 100 Mbit link that
#: 64 senders share at once gives each 195 kB/s.
MIN_RATE = 1 << 16
#: Messages one sender may have waiting in the inbox: a round's part and mean, and the
#: next round's of a member that is ahead, twice over.
INBOX_MESSAGES = 8
#: Keys of messages handed out that are remembered (a late copy of one is dropped).
TAKEN = 4096
_ACK = b"\x06"


class PeerTimeout(RuntimeError):
    """A member's part or reduced chunk did not arrive in time (it died or stalled)."""


def split(size: int, parts: int, align: int = 1) -> list[tuple[int, int]]:
    """[start, stop) of `parts` near-equal chunks of range(size), cut at multiples of `align`."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    blocks = -(-size // align)
    cuts = [min(size, (blocks * i // parts) * align) for i in range(parts + 1)]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _contexts(credentials: Credentials) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """Server and client contexts of mutual TLS under the run's CA."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # machines are named by their URI SAN, checked below
    for context in (server, client):
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(credentials.cert_file, credentials.key_file)
        context.load_verify_locations(credentials.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return server, client


def _is_machine_of_run(connection: ssl.SSLSocket, prefix: str) -> bool:
    cert = connection.getpeercert() or {}
    # typeshed types every certificate field as one union; subjectAltName is (kind, value) pairs.
    uris = [v for k, v in cert.get("subjectAltName", ()) if k == "URI"]  # type: ignore[str-unpack]
    return any(uri.startswith(prefix + "machine/") for uri in uris)  # type: ignore[union-attr]


class _Refused(Exception):
    """A connection that failed a check: it is closed and counted in `rejected`."""


class Peers:
    """One machine's end of the peer-to-peer exchange: a listening socket and its inbox.

    Args:
      machine: this machine's slot.
      token: the run's secret; messages are signed and checked under it.
      host: the address to listen on (and to advertise: `address`).
      port: 0 picks a free one.
      credentials: the run's (mutual TLS on every connection); None: plain TCP,
        for loopback or a network the user says is private.
      machines: the run's slot count: a header from a slot outside [0, machines)
        or from this machine's own is refused (None: any slot below 2^16).
      max_message_bytes: the longest body accepted (at most `MAX_MESSAGE_BYTES`);
        `set_limits` tightens it once the model is known.
      max_pending: connections that may wait for their first signed header at once.
      header_s: seconds a header may take to arrive (from its first byte, or from
        the connection's acceptance for its first header).
    """

    def __init__(
        self,
        machine: int,
        token: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        credentials: Credentials | None = None,
        *,
        machines: int | None = None,
        max_message_bytes: int = 64 << 20,
        max_pending: int = 32,
        header_s: float = 5.0,
    ):
        if not (isinstance(max_pending, int) and max_pending >= 1):
            raise ValueError(f"max_pending={max_pending!r} must be an integer >= 1.")
        if not header_s > 0:
            raise ValueError(f"header_s={header_s!r} must be > 0.")
        self.machine = machine
        self._token = bytes(token)
        self._credentials = credentials
        self._server_tls: ssl.SSLContext | None = None
        self._client_tls: ssl.SSLContext | None = None
        if credentials is not None:
            self._server_tls, self._client_tls = _contexts(credentials)
        self.set_limits(max_message_bytes, machines if machines is not None else 1 << 16)
        self.max_pending, self.header_s = max_pending, header_s
        # A burst of connections waits in the kernel's queue for the accept thread (whose
        # `max_pending` rule sorts them), not in the SYN retransmits of a short queue.
        self._listener = socket.create_server((host, port), backlog=1024)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        # The inbox: {(round, kind, chunk, sender): body}, with each sender's count and
        # bytes (bodies being read count already: they are reserved before the read).
        self._inbox: dict[tuple, bytes] = {}
        self._held: dict[int, list[int]] = {}  # sender -> [messages, bytes]
        self._floor = 0  # rounds below it are forgotten: their messages are dropped
        self._taken: dict[tuple, None] = {}  # the keys `wait` handed out, oldest first
        self._arrived = threading.Condition()
        self._out: dict[str, socket.socket] = {}
        self._lock = threading.Lock()  # guards _out, _locks, _pending, _senders, _threads
        self._locks: dict[str, threading.Lock] = {}  # one per peer: connect, write, ack
        self._pool = ThreadPoolExecutor(max_workers=64)
        self._threads: set[threading.Thread] = set()
        self._pending: list[socket.socket] = []  # accepted, no signed header yet: oldest first
        self._senders: dict[int, socket.socket] = {}  # sender -> its connection
        self.rejected = 0  # connections or messages that failed a check
        self.dropped = 0  # signed messages left out: a forgotten round or a full inbox
        self.evicted = 0  # connections closed unheard to make room (`max_pending`)
        self.closed = False
        self._start(self._accept)

    def set_limits(self, max_message_bytes: int, machines: int) -> None:
        """The longest body and the slot count that headers are checked against."""
        if not (isinstance(max_message_bytes, int) and 1 <= max_message_bytes <= MAX_MESSAGE_BYTES):
            raise ValueError(
                f"max_message_bytes={max_message_bytes!r} must be an integer in "
                f"[1, {MAX_MESSAGE_BYTES}] (the peer transport's ceiling)."
            )
        if not (isinstance(machines, int) and machines >= 1):
            raise ValueError(f"machines={machines!r} must be an integer >= 1.")
        self.max_message_bytes, self.machines = max_message_bytes, machines

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    # -- receiving ------------------------------------------------------------

    def _accept(self) -> None:
        while not self.closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._pending.append(connection)
                oldest = self._pending.pop(0) if len(self._pending) > self.max_pending else None
                self.evicted += oldest is not None
            if oldest is not None:
                _shut(oldest)  # its thread's read fails and it closes
            self._start(self._receive, connection)

    def _receive(self, connection: socket.socket) -> None:
        raw, sender = connection, None
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self.header_s
            if self._server_tls is not None:
                connection.settimeout(self.header_s)
                connection = self._server_tls.wrap_socket(raw, server_side=True)
                with self._lock:  # the TLS socket holds the descriptor now: track it
                    if raw not in self._pending:
                        raise _Refused("closed unheard to make room")
                    self._pending[self._pending.index(raw)] = connection
                raw = connection
                assert self._credentials is not None
                if not _is_machine_of_run(connection, self._credentials.peer_prefix):
                    raise _Refused("the peer's certificate names no machine of this run")
            while not self.closed:
                if sender is not None:  # between messages a machine's connection may idle
                    connection.settimeout(None)
                    first = connection.recv(1)
                    if not first:
                        return
                    deadline = time.monotonic() + self.header_s
                    head = first + _read(connection, FRAME - 1, deadline)
                else:
                    head = _read(connection, FRAME, deadline)
                key, length, digest = self._check_header(head, sender)
                if sender is None:
                    sender = self._promote(raw, key[3])
                deadline += length / MIN_RATE
                if self._reserve(key, length):
                    try:
                        body = _read(connection, length, deadline)
                        if not hmac.compare_digest(hashlib.sha256(body).digest(), digest):
                            raise _Refused("the body is not the one the header signed")
                        self._store(key, body)
                    finally:
                        self._release(key[3], length)
                else:
                    _skip(connection, length, deadline)
                connection.settimeout(max(deadline - time.monotonic(), 0.001))
                connection.sendall(_ACK)
        except (_Refused, OSError, ValueError):
            if not self.closed:
                with self._lock:
                    self.rejected += 1
        finally:
            with self._lock:
                if raw in self._pending:
                    self._pending.remove(raw)
                if sender is not None and self._senders.get(sender) is raw:
                    del self._senders[sender]
                self._threads.discard(threading.current_thread())
            _shut(raw)
            connection.close()

    def _check_header(self, head: bytes, sender: int | None) -> tuple[tuple, int, bytes]:
        """((round, kind, chunk, sender), body length, body digest) of a header that verifies."""
        fields, mac = head[: _HEADER.size], head[_HEADER.size :]
        if not hmac.compare_digest(hmac.new(self._token, fields, hashlib.sha256).digest(), mac):
            raise _Refused("the header's signature does not verify (wrong or no token)")
        magic, kind, round_, source, chunk, length, digest = _HEADER.unpack(fields)
        if magic != _MAGIC or kind >= len(KINDS):
            raise _Refused(f"unknown frame format {magic!r} or kind {kind}")
        if not 0 <= source < self.machines or source == self.machine:
            raise _Refused(f"a header from slot {source}")
        if sender is not None and source != sender:
            raise _Refused(f"machine {sender}'s connection speaks for machine {source}")
        if chunk >= self.machines or length > self.max_message_bytes:
            raise _Refused(f"chunk {chunk}, {length} bytes: beyond this run's limits")
        return (round_, KINDS[kind], chunk, source), length, digest

    def _promote(self, raw: socket.socket, sender: int) -> int:
        """Makes an accepted connection `sender`'s (its first header verified)."""
        with self._lock:
            if raw not in self._pending:  # closed to make room: the sender sends again
                raise _Refused("closed unheard to make room")
            self._pending.remove(raw)
            older = self._senders.get(sender)
            self._senders[sender] = raw
        if older is not None:
            _shut(older)  # the machine connected again (it restarted, or its link broke)
        return sender

    def _reserve(self, key: tuple, length: int) -> bool:
        """Whether the message is to be read (room held in its sender's share) or skipped."""
        round_, sender = key[0], key[3]
        with self._arrived:
            if round_ < self._floor or key in self._taken:  # forgotten, or sent again
                self.dropped += 1
                return False
            held = self._held.setdefault(sender, [0, 0])
            limit = 2 * self.max_message_bytes
            while held[0] >= INBOX_MESSAGES or held[1] + length > limit:
                older = [k for k in self._inbox if k[3] == sender and k[0] < round_]
                if not older:
                    self.dropped += 1
                    return False
                self._discard(min(older))
                self.dropped += 1
            held[0] += 1
            held[1] += length
            return True

    def _release(self, sender: int, length: int) -> None:
        """Gives back a reservation (the body is stored, counted again, or it failed)."""
        with self._arrived:
            held = self._held[sender]
            held[0] -= 1
            held[1] -= length

    def _store(self, key: tuple, body: bytes) -> None:
        with self._arrived:
            held = self._held[key[3]]
            if key in self._inbox:  # sent again after a lost acknowledgement
                held[0] -= 1
                held[1] -= len(self._inbox[key])
            self._inbox[key] = body
            held[0] += 1
            held[1] += len(body)
            self._arrived.notify_all()

    def _take(self, key: tuple) -> bytes:
        self._taken[key] = None  # a copy sent again (its acknowledgement was lost) is dropped
        if len(self._taken) > TAKEN:
            del self._taken[next(iter(self._taken))]
        return self._discard(key)

    def _discard(self, key: tuple) -> bytes:
        body = self._inbox.pop(key)
        held = self._held[key[3]]
        held[0] -= 1
        held[1] -= len(body)
        return body

    def wait(
        self, round_: int, kind: str, chunk: int, senders: Sequence[int], timeout: float
    ) -> dict[int, bytes]:
        """{sender: body} of `kind` messages for `chunk` of `round_` from every sender."""
        end = time.monotonic() + timeout
        keys = {s: (round_, kind, chunk, s) for s in senders}
        with self._arrived:
            while True:
                missing = [s for s, k in keys.items() if k not in self._inbox]
                if not missing:
                    return {s: self._take(k) for s, k in keys.items()}
                left = end - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(
                        f"round {round_}: no {kind} of chunk {chunk} from machine(s) "
                        f"{missing} within {timeout:g} s"
                    )
                self._arrived.wait(left)

    def inbox(self) -> tuple[int, int]:
        """(messages, bytes) waiting in the inbox, bodies being read included."""
        with self._arrived:
            held = list(self._held.values())
        return sum(h[0] for h in held), sum(h[1] for h in held)

    def forget(self, before_round: int) -> None:
        """Drops what arrived for rounds before `before_round`, and refuses what comes for them."""
        with self._arrived:
            self._floor = max(self._floor, before_round)
            for key in [k for k in self._inbox if k[0] < before_round]:
                self._discard(key)
                self.dropped += 1
            for key in [k for k in self._taken if k[0] < before_round]:
                del self._taken[key]

    # -- sending --------------------------------------------------------------

    def _connection(self, address: str, timeout: float) -> socket.socket:
        """The open connection to `address` (made now if none); call with its peer lock."""
        with self._lock:
            connection = self._out.get(address)
        if connection is None:
            host, port = address.rsplit(":", 1)
            connection = socket.create_connection((host, int(port)), timeout=timeout)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._client_tls is not None:
                connection = self._client_tls.wrap_socket(connection)
                assert self._credentials is not None
                if not _is_machine_of_run(connection, self._credentials.peer_prefix):
                    connection.close()
                    raise ssl.SSLError(f"{address} names no machine of this run")
            with self._lock:
                self._out[address] = connection
        return connection

    def frame(self, round_: int, kind: str, chunk: int, body: bytes) -> bytes:
        """The signed header of a message from this machine (what `send` writes before `body`)."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}.")
        fields = _HEADER.pack(
            _MAGIC, KINDS.index(kind), round_, self.machine, chunk, len(body),
            hashlib.sha256(body).digest(),
        )  # fmt: skip
        return fields + hmac.new(self._token, fields, hashlib.sha256).digest()

    def send(
        self, address: str, round_: int, kind: str, chunk: int, body: bytes, timeout: float = 30.0
    ) -> None:
        """Sends one signed message to the machine listening at `address`.

        Returns once the receiver acknowledged it; a message that was not (the
        connection broke or was refused) is sent again on a new connection, with a
        growing pause, until `timeout` seconds have passed: then the last error is
        raised. An attempt may take a second even past `timeout` (0: one attempt).
        """
        if len(body) > self.max_message_bytes:  # every machine has the same limit: a bug
            raise ValueError(
                f"a {len(body)}-byte {kind} is beyond max_message_bytes={self.max_message_bytes}"
            )
        head = self.frame(round_, kind, chunk, body)
        end = time.monotonic() + timeout
        with self._lock:
            lock = self._locks.setdefault(address, threading.Lock())
        pause = 0.01
        while True:
            try:
                with lock:  # one message at a time on a connection; other peers go on
                    # An attempt has a second at least (`timeout=0`: one attempt).
                    attempt = max(end, time.monotonic() + 1.0)
                    connection = self._connection(address, attempt - time.monotonic())
                    connection.settimeout(attempt - time.monotonic())
                    connection.sendall(head)
                    connection.sendall(body)
                    if _read(connection, 1, attempt) != _ACK:
                        raise ConnectionError(f"{address} answered no acknowledgement")
                return
            except OSError:
                with self._lock:  # a broken connection is made again next time
                    broken = self._out.pop(address, None)
                if broken is not None:
                    broken.close()
                if time.monotonic() + pause >= end or self.closed:
                    raise
                time.sleep(pause)
                pause = min(2 * pause, 0.5)

    def send_all(
        self, messages: Sequence[tuple[str, int, str, int, bytes]], timeout: float = 30.0
    ) -> None:
        """Sends (address, round, kind, chunk, body) messages, to different peers at once.

        Raises:
          PeerTimeout: a peer did not acknowledge its messages within `timeout` seconds
            (naming its address).
        """
        by_peer: dict[str, list] = {}
        for message in messages:
            by_peer.setdefault(message[0], []).append(message)

        def deliver(ms: list) -> None:  # one peer's messages, in order
            for address, round_, kind, chunk, body in ms:
                self.send(address, round_, kind, chunk, body, timeout)

        futures = {address: self._pool.submit(deliver, ms) for address, ms in by_peer.items()}
        failed = []
        for address, future in futures.items():
            try:
                future.result()
            except OSError as error:
                failed.append(f"{address} ({error})")
        if failed:
            raise PeerTimeout(f"no acknowledgement within {timeout:g} s from {', '.join(failed)}")

    def close(self) -> None:
        """Stops listening, ends every connection and waits for its threads."""
        self.closed = True
        with self._lock:
            for connection in [*self._out.values(), *self._pending, *self._senders.values()]:
                _shut(connection)
            for connection in self._out.values():
                connection.close()
            self._out.clear()
        _shut(self._listener)  # wakes the thread blocked in accept
        self._listener.close()
        self._pool.shutdown(wait=True)
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=5)


def _shut(connection: socket.socket) -> None:
    """Ends a connection's reads and writes (a thread blocked on it returns)."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _read(connection: socket.socket, size: int, deadline: float) -> bytes:
    """Exactly `size` bytes, all of them before `deadline` (time.monotonic())."""
    out = bytearray()
    while len(out) < size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{size - len(out)} of {size} bytes still missing at the deadline")
        connection.settimeout(left)
        piece = connection.recv(min(size - len(out), 1 << 20))
        if not piece:
            raise ConnectionError("the peer closed the connection")
        out += piece
    return bytes(out)


def _skip(connection: socket.socket, size: int, deadline: float) -> None:
    """Reads `size` bytes and keeps none (a signed message the inbox has no room for)."""
    while size > 0:
        size -= len(_read(connection, min(size, 1 << 20), deadline))


def reduce_scatter_gather(
    peers: Peers,
    round_: int,
    members: Sequence[int],
    addresses: dict[int, str],
    parts: Sequence[bytes],
    reduce: Callable[[int, list[bytes]], bytes],
    timeout: float,
) -> list[bytes]:
    """One round's exchange among `members`; returns the n reduced chunks, in order.

    Args:
      peers: this machine's `Peers` (its slot must be one of `members`).
      round_: the round (messages of other rounds never mix in).
      members: the round's members, sorted: member members[j] owns chunk j.
      addresses: {machine: "host:port"} of every member's `Peers`.
      parts: this machine's encoded part of each chunk (len(members) of them).
      reduce: (chunk, [the members' parts of it, in `members` order]) -> the
        reduced chunk's bytes; called once, for the chunk this machine owns.
      timeout: seconds to wait for each phase's messages (and for each member to
        acknowledge what this machine sends it).

    Raises:
      PeerTimeout: a member's part or reduced chunk did not come in time, or a
        member did not take this machine's.
    """
    members = list(members)
    if len(parts) != len(members):
        raise ValueError(f"{len(parts)} parts for {len(members)} members")
    me = members.index(peers.machine)
    others = [m for m in members if m != peers.machine]
    peers.send_all(
        [(addresses[m], round_, "part", j, parts[j]) for j, m in enumerate(members) if j != me],
        timeout,
    )
    got = peers.wait(round_, "part", me, others, timeout)
    got[peers.machine] = parts[me]
    mine = reduce(me, [got[m] for m in members])
    peers.send_all([(addresses[m], round_, "mean", me, mine) for m in others], timeout)
    chunks = []
    for j, owner in enumerate(members):
        chunks.append(mine if j == me else peers.wait(round_, "mean", j, [owner], timeout)[owner])
    return chunks


def all_gather(
    peers: Peers,
    round_: int,
    members: Sequence[int],
    addresses: dict[int, str],
    payload: bytes,
    timeout: float,
) -> list[bytes]:
    """Every member's `payload` of round `round_`, in `members` order.

    The all-gather of a one-round mean (`config.mean_rounds=1`): each member sends
    its whole payload to every other member, n - 1 payloads each way per member
    (the star's bytes per machine, without the service's link in between).

    Raises:
      PeerTimeout: a member's payload did not come in time, or a member did not take ours.
    """
    members = list(members)
    others = [m for m in members if m != peers.machine]
    peers.send_all([(addresses[m], round_, "payload", 0, payload) for m in others], timeout)
    got = peers.wait(round_, "payload", 0, others, timeout)
    got[peers.machine] = payload
    return [got[m] for m in members]
