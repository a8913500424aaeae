"""The run's coordinating service: jax's own coordination service, standalone.

An elastic run's machines meet at one service (membership by heartbeats, a
key-value store for the exchanges) that runs in its own process, so that any
machine can be lost and come back. It is the coordination service that
`jax.distributed` starts inside process 0, started here with
`recoverable=True` (a task that dies does not end the others; a restarted task
registers again under a new incarnation) and without a training process around
it:

    python -m lpdec.elastic serve --bind 127.0.0.1:29600 --machines 3

The address is where it listens: loopback unless told; give a private address
the machines can reach, never 0.0.0.0 on an open network (the service itself
has no password; mutual TLS is jax's option from 0.11.2 on, see
`docs/DESIGN.md`).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from lpdec.elastic import _runtime


def start(bind: str, machines: int, *, heartbeat_timeout: int = 10) -> Any:
    """Starts the service on `bind` ("host:port") for up to `machines` machines.

    Returns the service object; it serves while it is referenced (call
    `.shutdown()` to stop it). `heartbeat_timeout` is the seconds without a
    machine's heartbeat after which the service counts it as lost.
    """
    _runtime.check_address(bind, "bind")
    if not (isinstance(machines, int) and machines >= 1):
        raise ValueError(f"machines={machines!r} must be an integer >= 1.")
    if not (isinstance(heartbeat_timeout, int) and heartbeat_timeout >= 1):
        raise ValueError(f"heartbeat_timeout={heartbeat_timeout!r} must be an integer >= 1 s.")
    return _runtime.jax_runtime().get_distributed_runtime_service(
        bind, machines, heartbeat_timeout=heartbeat_timeout, recoverable=True
    )


def serve_forever(bind: str, machines: int, *, heartbeat_timeout: int = 10) -> None:
    """`start`, then wait for SIGTERM / SIGINT (the command line's `serve`)."""
    service = start(bind, machines, heartbeat_timeout=heartbeat_timeout)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    print(
        f"lpdec.elastic: serving {machines} machine slots on {bind} "
        f"(heartbeat timeout {heartbeat_timeout} s); stop with SIGTERM",
        flush=True,
    )
    while not done.wait(1.0):
        time.sleep(0)
    service.shutdown()
