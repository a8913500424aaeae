"""The service's gate: nothing reaches jax's coordination service without the run's token.

jax's coordination service has no password: whoever connects to it as task m
registers slot m, and with `recoverable=True` that *replaces* the live
machine's incarnation (the service declares it gone, its contributions come
late, jaxlib ends it). Checking the token afterwards (a signed join request) is
too late, so `serve` puts a gate in front of the service:

- **Without credentials** jax's service listens on a Unix socket in a directory
  only its user can open, and the run's address (`--bind`) is the gate's TCP
  port. A machine passes the gate, then its jaxlib client talks to the service
  through a tunnel the gate opens for it (`Tunnel`: a Unix socket in the
  machine's own private directory, each connection of which goes through the
  gate again). A connection that does not prove the token is closed before a
  byte reaches jax's service: a wrong or missing token, a hand-written jax
  client, a port scanner.
- **With credentials** (mutual TLS, jax >= 0.11.2) jax's service listens on
  the port after the gate's (`host:port+1`) and admits only the run's
  certificates; a machine still passes the gate first, so a process with the
  run's certificates but another token is refused before it registers.

The handshake proves knowledge of the token without sending it (HMAC-SHA256
under a key derived from it), both ways, over fresh nonces from each side, and
binds what the client asks for (its slot, the kind of request) so that an
answer cannot be replayed or moved to another request:

    client: MAGIC, kind, slot, argument, client nonce        (42 bytes)
    gate:   gate nonce, mode ("T" tunnel / "M" mutual TLS)     (17 bytes)
    client: HMAC(key, "c" | the 59 bytes above)               (32 bytes)
    gate:   "Y" + HMAC(key, "s" | the 59 bytes | "Y"), or "N" + 32 zero bytes

Kinds: "P" probe (a machine checks its token before it registers), "T" tunnel
(then the connection carries jax's bytes), "F" the run has finished (argument:
its last round; `serve` says so once and stops after a grace period).

What the gate does not do: encrypt. After the handshake a tunnel carries jax's
bytes in the clear, so someone who can read or alter the traffic on the path
(not merely reach the port) sees the payloads and could take over a
connection; off loopback that is what credentials (or the user's word that the
network is private) are for. Processes of the service's own user on its host
can open the service's socket directly; they can read the run's token as well.

The gate is written for hostile input: fixed-size reads, a handshake timeout,
a bounded number of handshakes and of tunnels (the rest are closed at once).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from lpdec.elastic.joins import JoinRefused

__all__ = ["Gate", "GateRefused", "Tunnel", "announce_finished", "probe"]

MAGIC = b"lpdec-gate-1\n"
_HELLO = struct.Struct(f"!{len(MAGIC)}scIq16s")  # magic, kind, slot, argument, nonce
_REPLY = struct.Struct("!16sc")  # gate nonce, mode
_MAC = 32
HANDSHAKE_TIMEOUT_S = 5.0
TUNNEL = b"T"
MUTUAL_TLS = b"M"


class GateRefused(JoinRefused):
    """The run's gate refused this machine (its message says why): it did not register."""


def _key(token: bytes) -> bytes:
    return hmac.new(bytes(token), b"lpdec elastic gate", hashlib.sha256).digest()


def _mac(key: bytes, side: bytes, transcript: bytes) -> bytes:
    return hmac.new(key, side + transcript, hashlib.sha256).digest()


def _read(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes (a short read on a closed connection is an OSError)."""
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise OSError("the connection closed during the gate's handshake")
        data += chunk
    return bytes(data)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = str(address).rpartition(":")
    return host.strip("[]"), int(port)


def service_address(address: str) -> str:
    """Where jax's service listens with credentials: the port after the gate's."""
    host, port = split_address(address)
    return f"{host}:{port + 1}"


# -- the client side (a machine) ---------------------------------------------------


def _handshake(
    address: str, slot: int, token: bytes, kind: bytes, argument: int = 0, timeout: float = 10.0
) -> tuple[socket.socket, bytes]:
    """Opens a connection to the gate and passes it; returns (it, the gate's mode).

    Raises GateRefused (the gate said no, or did not prove the token itself) or
    OSError (the gate cannot be reached).
    """
    sock = socket.create_connection(split_address(address), timeout=timeout)
    try:
        hello = _HELLO.pack(MAGIC, kind, slot, argument, secrets.token_bytes(16))
        sock.sendall(hello)
        reply = _read(sock, _REPLY.size)
        _, mode = _REPLY.unpack(reply)
        key, transcript = _key(token), hello + reply
        sock.sendall(_mac(key, b"c", transcript))
        answer = _read(sock, 1 + _MAC)
        if answer[:1] != b"Y":
            raise GateRefused(
                f"the service at {address} refused machine {slot}: wrong or missing token "
                "(it did not register; the run's machines are untouched)"
            )
        if not hmac.compare_digest(answer[1:], _mac(key, b"s", transcript + b"Y")):
            raise GateRefused(
                f"the service at {address} does not hold this machine's token (its answer "
                "does not verify): not this run's service"
            )
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return sock, mode


def probe(
    address: str, slot: int, token: bytes, *, mutual_tls: bool, timeout: float = 300.0
) -> None:
    """Passes the gate at `address` before this machine registers slot `slot`.

    Waits up to `timeout` seconds for the gate to come up (a fresh run's machines
    may start before it).

    Raises:
      GateRefused: a wrong or missing token, or the service's mode is not the
        machine's (credentials on one side only).
      OSError: the gate could not be reached within `timeout`.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock, mode = _handshake(address, slot, token, b"P")
            break
        except GateRefused:
            raise
        except OSError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)
    sock.close()
    if mode == MUTUAL_TLS and not mutual_tls:
        raise GateRefused(
            f"the service at {address} takes only the run's credentials (mutual TLS): "
            "give this machine its credentials (--elastic_credentials)"
        )
    if mode == TUNNEL and mutual_tls:
        raise GateRefused(
            f"the service at {address} runs without credentials but this machine has "
            "them: start the service with --credentials, or the machine without"
        )


def announce_finished(address: str, slot: int, token: bytes, last_round: int) -> bool:
    """Tells the service that the run has finished after `last_round` (best effort)."""
    try:
        sock, _ = _handshake(address, slot, token, b"F", int(last_round), timeout=5.0)
    except (OSError, GateRefused):
        return False
    sock.close()
    return True


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copies a's bytes to b until a closes, then closes b's sending side."""
    try:
        while chunk := a.recv(1 << 16):
            b.sendall(chunk)
    except OSError:
        pass
    for sock, how in ((b, socket.SHUT_WR), (a, socket.SHUT_RD)):
        try:
            sock.shutdown(how)
        except OSError:
            pass


def _pipe(a: socket.socket, b: socket.socket, on_end: Callable[[], None] | None = None) -> None:
    """Relays both ways on two threads; closes both sockets when both ways ended."""

    def both() -> None:
        other = threading.Thread(target=_relay, args=(b, a), daemon=True)
        other.start()
        _relay(a, b)
        other.join()
        a.close()
        b.close()
        if on_end is not None:
            on_end()

    threading.Thread(target=both, daemon=True).start()


class Tunnel:
    """A machine's way to jax's service through the gate (a service without credentials).

    Listens on a Unix socket in a fresh directory only this user can open;
    jaxlib's client connects there (`jax_address`), and each connection is
    carried to the gate, which lets it through to jax's service once it proves
    the token.
    """

    def __init__(self, address: str, slot: int, token: bytes):
        self.address, self.slot, self._token = address, slot, bytes(token)
        self._dir = tempfile.mkdtemp(prefix="lpdec-tunnel-")  # mode 0700
        self.path = os.path.join(self._dir, "service.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(8)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def jax_address(self) -> str:
        """The address jaxlib's client is given."""
        return f"unix:{self.path}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                local, _ = self._listener.accept()
            except OSError:
                return
            try:
                remote, _ = _handshake(self.address, self.slot, self._token, TUNNEL)
            except (OSError, GateRefused):
                local.close()  # jaxlib sees a dropped connection and tries again
                continue
            _pipe(local, remote)

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)


# -- the service's side ---------------------------------------------------------------


class Gate:
    """The gate's listener at `bind` for a run of `machines` slots under `token`.

    Args:
      bind: the run's address, host:port (what the machines are given).
      machines: the slot count: a hello naming another slot is refused.
      token: the run's secret (non-empty).
      upstream: jax's service, for tunnels ("unix:PATH"); None with mutual TLS
        (the machines then connect to it directly and only probe the gate).
      on_finished: called with (last round, slot) for each verified "finished" notice.
      max_handshakes / max_tunnels: connections beyond these are closed at once.
    """

    def __init__(
        self,
        bind: str,
        machines: int,
        token: bytes,
        *,
        upstream: str | None,
        on_finished: Callable[[int, int], None] | None = None,
        max_handshakes: int = 16,
        max_tunnels: int | None = None,
    ):
        if not token:
            raise ValueError(
                "the service needs the run's token (--token_file or LPDEC_ELASTIC_TOKEN): its "
                "gate lets in only machines that prove it"
            )
        self.machines, self._key = machines, _key(token)
        self.upstream, self.on_finished = upstream, on_finished
        self.mode = TUNNEL if upstream else MUTUAL_TLS
        self._handshakes = threading.BoundedSemaphore(max_handshakes)
        self._tunnels = threading.BoundedSemaphore(max_tunnels or 4 * machines + 4)
        self.refused = 0
        host, port = split_address(bind)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as error:
            self._listener.close()
            raise ValueError(f"--bind {bind}: {error.strerror}") from None
        self._listener.listen(64)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._listener.accept()
            except OSError:
                return
            if not self._handshakes.acquire(blocking=False):
                sock.close()  # a flood of connections: the run's machines retry
                continue
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True).start()

    def _serve(self, sock: socket.socket, peer) -> None:
        tunnel = False
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            hello = _read(sock, _HELLO.size)
            magic, kind, slot, argument, _ = _HELLO.unpack(hello)
            if magic != MAGIC or kind not in (b"P", b"T", b"F") or not slot < self.machines:
                sock.close()
                return
            reply = _REPLY.pack(secrets.token_bytes(16), self.mode)
            sock.sendall(reply)
            transcript = hello + reply
            proof = _read(sock, _MAC)
            ok = hmac.compare_digest(proof, _mac(self._key, b"c", transcript))
            if ok and kind == TUNNEL and self.upstream is None:
                ok = False  # with mutual TLS nothing is tunnelled
            if not ok:
                self.refused += 1
                if self.refused <= 10 or self.refused % 1000 == 0:
                    print(
                        f"lpdec.elastic: refused a connection from {peer[0]} for slot {slot}: "
                        f"wrong or missing token ({self.refused} refused so far)",
                        file=sys.stderr,
                        flush=True,
                    )
                sock.sendall(b"N" + bytes(_MAC))
                sock.close()
                return
            if kind == TUNNEL and not self._tunnels.acquire(blocking=False):
                sock.close()
                return
            tunnel = kind == TUNNEL
            if kind == b"F" and self.on_finished is not None:
                # Recorded before the answer: once the machine reads "Y", the service knows.
                self.on_finished(int(argument), int(slot))
            sock.sendall(b"Y" + _mac(self._key, b"s", transcript + b"Y"))
            if not tunnel:
                sock.close()
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            assert self.upstream is not None  # a tunnelling gate has its service's socket
            upstream.connect(self.upstream.removeprefix("unix:"))
            sock.settimeout(None)
            _pipe(sock, upstream, on_end=self._tunnels.release)
            tunnel = False  # released by the pipe
        except (OSError, struct.error):
            sock.close()
            if tunnel:
                self._tunnels.release()
        finally:
            self._handshakes.release()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
