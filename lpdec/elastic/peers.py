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

**Who may send.** Every message carries an HMAC-SHA256 under the run's token over
its round, kind, chunk, sender and body; a message that does not verify is
dropped (and counted), so a process without the token cannot add to a mean.
With the run's credentials (`lpdec.elastic.credentials`) the connections are
mutual TLS too: a peer must present a certificate the run's CA signed, naming a
machine of this run, and nothing crosses the network in the clear.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from lpdec.elastic.credentials import Credentials

__all__ = ["PeerTimeout", "Peers", "all_gather", "reduce_scatter_gather", "split"]

_HEADER = struct.Struct("!II")  # header length, body length


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


class Peers:
    """One machine's end of the peer-to-peer exchange: a listening socket and its inbox.

    Args:
      machine: this machine's slot.
      token: the run's secret; messages are signed and checked under it.
      host: the address to listen on (and to advertise: `address`).
      port: 0 picks a free one.
      credentials: the run's (mutual TLS on every connection); None: plain TCP,
        for loopback or a network the user says is private.
    """

    def __init__(
        self,
        machine: int,
        token: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        credentials: Credentials | None = None,
    ):
        self.machine = machine
        self._token = bytes(token)
        self._credentials = credentials
        self._server_tls: ssl.SSLContext | None
        self._client_tls: ssl.SSLContext | None
        self._server_tls, self._client_tls = _contexts(credentials) if credentials else (None, None)
        self._listener = socket.create_server((host, port), backlog=64)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._inbox: dict[tuple, bytes] = {}
        self._arrived = threading.Condition()
        self._out: dict[str, socket.socket] = {}
        self._out_lock = threading.Lock()  # guards _out, _accepted and _locks
        self._locks: dict[str, threading.Lock] = {}  # one per peer: connect, then write
        self._pool = ThreadPoolExecutor(max_workers=64)
        self._threads: list[threading.Thread] = []
        self._accepted: set[socket.socket] = set()
        self.rejected = 0  # messages or connections that failed a check
        self.closed = False
        self._start(self._accept)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    # -- receiving ------------------------------------------------------------

    def _accept(self) -> None:
        while not self.closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with self._out_lock:
                self._accepted.add(connection)
            self._start(self._receive, connection)

    def _receive(self, connection: socket.socket) -> None:
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._server_tls is not None:
                raw = connection
                connection = self._server_tls.wrap_socket(raw, server_side=True)
                with self._out_lock:  # `close` shuts down the socket that holds the fd
                    self._accepted.discard(raw)
                    self._accepted.add(connection)
                assert self._credentials is not None
                if not _is_machine_of_run(connection, self._credentials.peer_prefix):
                    raise ssl.SSLError("the peer's certificate names no machine of this run")
            while True:
                head = _read(connection, _HEADER.size)
                size, length = _HEADER.unpack(head)
                header = json.loads(_read(connection, size))
                body = _read(connection, length)
                key = (header["round"], header["kind"], header["chunk"], header["from"])
                if not hmac.compare_digest(self._mac(*key, body), header["mac"]):
                    self.rejected += 1
                    continue
                with self._arrived:
                    self._inbox[key] = body
                    self._arrived.notify_all()
        except (OSError, ValueError, KeyError, TypeError, ssl.SSLError):
            self.rejected += 0 if self.closed else 1
        finally:
            with self._out_lock:
                self._accepted.discard(connection)
            connection.close()

    def _mac(self, round_: int, kind: str, chunk: int, sender: int, body: bytes) -> str:
        text = json.dumps([round_, kind, chunk, sender, hashlib.sha256(body).hexdigest()])
        return hmac.new(self._token, text.encode(), hashlib.sha256).hexdigest()

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
                    return {s: self._inbox.pop(k) for s, k in keys.items()}
                left = end - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(
                        f"round {round_}: no {kind} of chunk {chunk} from machine(s) "
                        f"{missing} within {timeout:g} s"
                    )
                self._arrived.wait(left)

    def forget(self, before_round: int) -> None:
        """Drops what arrived for rounds before `before_round` (a late member's leftovers)."""
        with self._arrived:
            for key in [k for k in self._inbox if k[0] < before_round]:
                del self._inbox[key]

    # -- sending --------------------------------------------------------------

    def _connection(self, address: str) -> socket.socket:
        """The open connection to `address` (made now if none); call with its peer lock."""
        with self._out_lock:
            connection = self._out.get(address)
        if connection is None:
            host, port = address.rsplit(":", 1)
            connection = socket.create_connection((host, int(port)), timeout=30)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._client_tls is not None:
                connection = self._client_tls.wrap_socket(connection)
                assert self._credentials is not None
                if not _is_machine_of_run(connection, self._credentials.peer_prefix):
                    connection.close()
                    raise ssl.SSLError(f"{address} names no machine of this run")
            connection.settimeout(None)
            with self._out_lock:
                self._out[address] = connection
        return connection

    def send(self, address: str, round_: int, kind: str, chunk: int, body: bytes) -> None:
        """Sends one signed message to the machine listening at `address`."""
        mac = self._mac(round_, kind, chunk, self.machine, body)
        header = json.dumps(
            {"round": round_, "kind": kind, "chunk": chunk, "from": self.machine, "mac": mac}
        ).encode()
        with self._out_lock:
            lock = self._locks.setdefault(address, threading.Lock())
        try:
            with lock:  # one message at a time on a connection; other peers go on
                connection = self._connection(address)
                connection.sendall(_HEADER.pack(len(header), len(body)) + header)
                connection.sendall(body)
        except OSError:
            with self._out_lock:  # a broken connection is made again next time
                broken = self._out.pop(address, None)
            if broken is not None:
                broken.close()
            raise

    def send_all(self, messages: Sequence[tuple[str, int, str, int, bytes]]) -> None:
        """Sends (address, round, kind, chunk, body) messages, to different peers at once."""
        by_peer: dict[str, list] = {}
        for message in messages:
            by_peer.setdefault(message[0], []).append(message)
        futures = [
            self._pool.submit(lambda ms: [self.send(*m) for m in ms], ms)  # type: ignore[func-returns-value]
            for ms in by_peer.values()
        ]
        for future in futures:
            future.result()

    def close(self) -> None:
        """Stops listening, ends every connection and waits for its threads."""
        self.closed = True
        with self._out_lock:
            for connection in [*self._out.values(), *self._accepted]:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                connection.close()
            self._out.clear()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        except OSError:
            pass
        self._listener.close()
        self._pool.shutdown(wait=True)
        for thread in self._threads:
            thread.join(timeout=5)


def _read(connection: socket.socket, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        piece = connection.recv(min(size - len(out), 1 << 20))
        if not piece:
            raise ConnectionError("the peer closed the connection")
        out += piece
    return bytes(out)


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
      timeout: seconds to wait for each phase's messages.

    Raises:
      PeerTimeout: a member's part or reduced chunk did not come in time.
    """
    members = list(members)
    if len(parts) != len(members):
        raise ValueError(f"{len(parts)} parts for {len(members)} members")
    me = members.index(peers.machine)
    others = [m for m in members if m != peers.machine]
    peers.send_all(
        [(addresses[m], round_, "part", j, parts[j]) for j, m in enumerate(members) if j != me]
    )
    got = peers.wait(round_, "part", me, others, timeout)
    got[peers.machine] = parts[me]
    mine = reduce(me, [got[m] for m in members])
    peers.send_all([(addresses[m], round_, "mean", me, mine) for m in others])
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
      PeerTimeout: a member's payload did not come in time.
    """
    members = list(members)
    others = [m for m in members if m != peers.machine]
    peers.send_all([(addresses[m], round_, "payload", 0, payload) for m in others])
    got = peers.wait(round_, "payload", 0, others, timeout)
    got[peers.machine] = payload
    return [got[m] for m in members]
