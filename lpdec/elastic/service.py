"""The run's coordinating service: jax's own coordination service, standalone, behind a gate.

An elastic run's machines meet at one service (membership by heartbeats, a
key-value store for the exchanges) that runs in its own process, so that any
machine can be lost and come back. It is the coordination service that
`jax.distributed` starts inside process 0, started here with
`recoverable=True` (a task that dies does not end the others; a restarted task
registers again under a new incarnation) and without a training process around
it:

    python -m lpdec.elastic serve --bind 127.0.0.1:29600 --machines 3 --token_file run.token

The address is where the run's gate listens (`lpdec.elastic.gate`): a machine
proves the run's token there before anything of it reaches jax's service, so a
process without the token cannot register a slot (and so cannot end a live
machine's incarnation by registering its slot again). Without credentials jax's
service listens on a Unix socket only this user can open, reached through the
gate; with the run's credentials (`python -m lpdec.elastic credentials DIR`:
mutual TLS, jax >= 0.11.2) it listens on the next port, host:port+1. Off
loopback without credentials it needs the user's word that the network is
private (`--private_network`): the gate keeps strangers out, but it does not
encrypt, and whoever can read the traffic reads every payload.

When a machine tells the gate that the run has finished (its last round is
decided and it is leaving), the service says so once and stops `linger`
seconds after the last such notice.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any

from lpdec.elastic import _runtime
from lpdec.elastic import gate as gate_lib
from lpdec.elastic.credentials import Credentials
from lpdec.elastic.credentials import check as check_credentials


class Service:
    """A running service: jax's coordination service and the gate in front of it.

    Attributes:
      address: where the machines find it (the gate's host:port).
      finished: (last round, slot, time) of the newest "run finished" notice, or None.
    """

    def __init__(self, address: str, jax_service: Any, gate: gate_lib.Gate, directory: str):
        self.address, self._jax, self.gate, self._dir = address, jax_service, gate, directory
        self.finished: tuple[int, int, float] | None = None
        self._lock = threading.Lock()

    def notice(self, last_round: int, slot: int) -> None:
        """A verified notice from machine `slot` that the run ended after `last_round`."""
        with self._lock:
            first = self.finished is None
            self.finished = (last_round, slot, time.monotonic())
        if first:
            self.on_first_finished(last_round, slot)

    def on_first_finished(self, last_round: int, slot: int) -> None:
        """Called once, at the first notice that the run has finished (serve_forever prints)."""

    def shutdown(self) -> None:
        """Stops the gate and jax's service."""
        self.gate.close()
        self._jax.shutdown()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)


def start(
    bind: str,
    machines: int,
    *,
    token: bytes = b"",
    heartbeat_timeout: int = 10,
    credentials: Credentials | None = None,
    private_network: bool = False,
) -> Service:
    """Starts the service on `bind` ("host:port") for up to `machines` machines.

    Returns the `Service`; call `.shutdown()` to stop it. `token` is the run's
    secret: the gate lets in only machines that prove it. `heartbeat_timeout` is
    the seconds without a machine's heartbeat after which the service counts it
    as lost. `credentials` (`credentials.load(DIR, "service")`): mutual TLS, only
    the run's machines connect. Without them `bind` must be loopback unless
    `private_network`.
    """
    _runtime.check_address(bind, "bind")
    check_credentials(bind, credentials, private_network)
    if not (isinstance(machines, int) and machines >= 1):
        raise ValueError(f"machines={machines!r} must be an integer >= 1.")
    if not (isinstance(heartbeat_timeout, int) and heartbeat_timeout >= 1):
        raise ValueError(f"heartbeat_timeout={heartbeat_timeout!r} must be an integer >= 1 s.")
    if not token:
        raise ValueError(
            "the service needs the run's token (--token_file or LPDEC_ELASTIC_TOKEN): its gate "
            "lets in only machines that prove it"
        )
    runtime = _runtime.jax_runtime()
    directory = ""
    if credentials is not None:
        jax_address, mtls, upstream = gate_lib.service_address(bind), credentials.jax_kwargs(), None
    else:
        directory = tempfile.mkdtemp(prefix="lpdec-service-")  # mode 0700: this user only
        upstream = f"unix:{os.path.join(directory, 'service.sock')}"
        jax_address, mtls = upstream, {}
    try:
        gate = gate_lib.Gate(bind, machines, token, upstream=upstream)
    except ValueError:
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    jax_service = runtime.get_distributed_runtime_service(
        jax_address, machines, heartbeat_timeout=heartbeat_timeout, recoverable=True, **mtls
    )
    service = Service(bind, jax_service, gate, directory)
    gate.on_finished = service.notice
    return service


def serve_forever(
    bind: str,
    machines: int,
    *,
    token: bytes = b"",
    heartbeat_timeout: int = 10,
    credentials: Credentials | None = None,
    private_network: bool = False,
    linger: float = 10.0,
) -> None:
    """`start`, then serve until SIGTERM / SIGINT, or `linger` seconds after the last
    notice that the run has finished (never, if `linger` < 0)."""
    service = start(
        bind,
        machines,
        token=token,
        heartbeat_timeout=heartbeat_timeout,
        credentials=credentials,
        private_network=private_network,
    )

    def said(last_round: int, slot: int) -> None:
        then = f"it stops in {linger:g} s" if linger >= 0 else "stop it with SIGTERM"
        print(
            f"lpdec.elastic: the run has finished (its last round, {last_round}, is decided; "
            f"machine {slot} said so): the service is no longer needed; {then}",
            flush=True,
        )

    service.on_first_finished = said  # type: ignore[method-assign]  # this command's own report
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(
        f"lpdec.elastic: serving {machines} machine slots on {bind} "
        f"(heartbeat timeout {heartbeat_timeout} s, the run's token at the gate, "
        f"{'mutual TLS' if credentials else 'no credentials'}); stop with SIGTERM",
        flush=True,
    )
    while not done.wait(0.5):
        finished = service.finished
        if finished is not None and linger >= 0 and time.monotonic() - finished[2] >= linger:
            print("lpdec.elastic: the run has finished; the service stops", flush=True)
            break
    service.shutdown()
