"""The run's coordinating service: jax's own coordination service, standalone.

An elastic run's machines meet at one service (membership by heartbeats, a
key-value store for the exchanges) that runs in its own process, so that any
machine can be lost and come back. It is the coordination service that
`jax.distributed` starts inside process 0, started here with
`recoverable=True` (a task that dies does not end the others; a restarted task
registers again under a new incarnation) and without a training process around
it:

    python -m lpdec.elastic serve --bind 127.0.0.1:29600 --machines 3

The address is where it listens: loopback unless told. Off loopback it needs
the run's credentials (`python -m lpdec.elastic credentials DIR`: mutual TLS,
jax >= 0.11.2), or the user's word that the network is private
(`--private_network`): without them anyone who reaches the port can register a
slot and read every payload.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from lpdec.elastic import _runtime
from lpdec.elastic.credentials import Credentials
from lpdec.elastic.credentials import check as check_credentials


def start(
    bind: str,
    machines: int,
    *,
    heartbeat_timeout: int = 10,
    credentials: Credentials | None = None,
    private_network: bool = False,
) -> Any:
    """Starts the service on `bind` ("host:port") for up to `machines` machines.

    Returns the service object; it serves while it is referenced (call
    `.shutdown()` to stop it). `heartbeat_timeout` is the seconds without a
    machine's heartbeat after which the service counts it as lost.
    `credentials` (`credentials.load(DIR, "service")`): mutual TLS, only the run's
    machines connect. Without them `bind` must be loopback unless `private_network`.
    """
    _runtime.check_address(bind, "bind")
    check_credentials(bind, credentials, private_network)
    if not (isinstance(machines, int) and machines >= 1):
        raise ValueError(f"machines={machines!r} must be an integer >= 1.")
    if not (isinstance(heartbeat_timeout, int) and heartbeat_timeout >= 1):
        raise ValueError(f"heartbeat_timeout={heartbeat_timeout!r} must be an integer >= 1 s.")
    mtls = credentials.jax_kwargs() if credentials is not None else {}
    return _runtime.jax_runtime().get_distributed_runtime_service(
        bind, machines, heartbeat_timeout=heartbeat_timeout, recoverable=True, **mtls
    )


def serve_forever(
    bind: str,
    machines: int,
    *,
    heartbeat_timeout: int = 10,
    credentials: Credentials | None = None,
    private_network: bool = False,
) -> None:
    """`start`, then wait for SIGTERM / SIGINT (the command line's `serve`)."""
    service = start(
        bind,
        machines,
        heartbeat_timeout=heartbeat_timeout,
        credentials=credentials,
        private_network=private_network,
    )
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(
        f"lpdec.elastic: serving {machines} machine slots on {bind} "
        f"(heartbeat timeout {heartbeat_timeout} s, "
        f"{'mutual TLS' if credentials else 'no credentials'}); stop with SIGTERM",
        flush=True,
    )
    while not done.wait(1.0):
        time.sleep(0)
    service.shutdown()
