"""Where an elastic run's machines meet: a key-value store with liveness.

`ElasticGroup` (the protocol) needs five things of the service: register this
machine's slot (a new incarnation), say which slots are alive, and a key-value
store with a create-only write, a directory read and a blocking read. `Store`
names them; two implement it:

- `ServiceStore`: jax's coordination service through jaxlib's client (the
  gate passed first, the connection, the liveness thread, jaxlib's errors
  turned into `ServiceLost`). The one place that talks to jaxlib, and the one
  that tells its errors apart.
- `MemoryStore`: the same in one process (`MemoryService` holds the keys and
  the live slots; a test kills, restarts and delays machines by hand), so the
  protocol's races run deterministically, without processes or timeouts.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any
from typing import Protocol

from lpdec.elastic import _runtime
from lpdec.elastic import gate
from lpdec.elastic.credentials import Credentials
from lpdec.elastic.credentials import check as check_credentials


class ServiceLost(RuntimeError):
    """The coordinating service cannot be reached (or has dropped this machine)."""


class Store(Protocol):
    """One machine's connection to the run's service (keys are relative to the run)."""

    def connect(self) -> int:
        """Registers the slot; returns its new incarnation. Raises ServiceLost."""
        ...

    def live(self) -> dict[int, int]:
        """{machine: incarnation} of the slots the service hears."""
        ...

    def lost(self) -> str | None:
        """Why the service stopped hearing this machine, or None while it hears it."""
        ...

    def get(self, key: str) -> bytes | None:
        """The value of `key`, or None if it is not there."""
        ...

    def put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        """Writes `key`; with overwrite=False only if absent (False if it existed)."""
        ...

    def dir(self, prefix: str) -> dict[str, bytes]:
        """{name: value} of the keys directly under `prefix`/."""
        ...

    def delete(self, key: str) -> None:
        """Removes `key` (and what lies under it); nothing if it is gone."""
        ...

    def fetch(self, key: str, timeout_s: float) -> bytes:
        """The value of `key`, waiting up to `timeout_s` for it. Raises ServiceLost."""
        ...

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        """The value of `key` once written, or None after `timeout_s` (a blocking `get`)."""
        ...

    def close(self) -> None:
        """Leaves the service (the others see the slot gone at once)."""
        ...

    def announce_finished(self, last_round: int) -> None:
        """Tells the service that the run ended after `last_round` (best effort)."""
        ...


ROOT = "lpdec/run"


def _first_line(error: Any) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


class ServiceStore:
    """`Store` on jax's coordination service (`lpdec.elastic.service`), through jaxlib.

    Args:
      address: the service, "host:port".
      machine, machines: this machine's slot and the service's slot count.
      heartbeat_timeout: seconds without a heartbeat before the service counts
        a machine as lost (the service's own setting decides; keep them equal).
      connect_timeout: seconds to wait for the service (a fresh start waits for
        every slot to register).
      poll_s: how often the liveness thread asks.
      credentials: this machine's (`credentials.load(DIR, machine)`): mutual TLS
        with the service. Without them `address` must be loopback unless
        `private_network`.
      token: the run's secret, proved at the service's gate before this machine
        registers (`lpdec.elastic.gate`); a wrong or missing one is `GateRefused`.
    """

    def __init__(
        self,
        address: str,
        machine: int,
        machines: int,
        *,
        heartbeat_timeout: int = 10,
        connect_timeout: int = 300,
        poll_s: float = 0.05,
        credentials: Credentials | None = None,
        private_network: bool = False,
        token: bytes = b"",
    ):
        _runtime.check_address(address, "address")
        check_credentials(address, credentials, private_network)
        self.credentials = credentials
        self.address, self.machine, self.machines = address, machine, machines
        self.heartbeat_timeout = int(heartbeat_timeout)
        self.connect_timeout = int(connect_timeout)
        self.poll_s = poll_s
        self.client: Any = None
        self._token = bytes(token)
        self._tunnel: gate.Tunnel | None = None
        self._lost = threading.Event()
        self._lost_reason = ""
        self._live: dict[int, int] = {}

    def connect(self) -> int:
        """Passes the gate (GateRefused: a wrong or missing token; nothing registered),
        then registers the slot. Raises ServiceLost when the service cannot be reached."""
        self._lost.clear()
        runtime = _runtime.jax_runtime()
        mutual_tls = self.credentials is not None
        try:
            gate.probe(
                self.address,
                self.machine,
                self._token,
                mutual_tls=mutual_tls,
                timeout=self.connect_timeout,
            )
        except OSError as error:
            raise ServiceLost(
                f"machine {self.machine} gave up before it registered with the service at "
                f"{self.address}: not reached within {self.connect_timeout} s "
                f"({error.strerror or error})"
            ) from None
        if mutual_tls:
            target = gate.service_address(self.address)
        else:
            if self._tunnel is None:
                self._tunnel = gate.Tunnel(self.address, self.machine, self._token)
            target = self._tunnel.jax_address
        self.client = runtime.get_distributed_runtime_client(
            target,
            self.machine,
            init_timeout=self.connect_timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            # No missed_heartbeat_callback: jaxlib cannot hand its status to a Python
            # callable (std::bad_cast, abort); without one it ends the process with a
            # line when the service has declared this machine lost. train.py's
            # supervisor restarts it, and the new process joins.
            shutdown_on_destruction=False,
            **(self.credentials.jax_kwargs() if self.credentials else {}),
        )
        try:
            self.client.connect()
            live = self.client.get_live_nodes(list(range(self.machines)))
        except Exception as error:  # noqa: BLE001 - jaxlib raises its own status errors
            raise ServiceLost(
                f"could not register with {self.address}: {_first_line(error)}"
            ) from error
        self._live = {int(m): int(i) for m, i in live.items()}
        threading.Thread(target=self._watch, args=(self.client,), daemon=True).start()
        return int(live[self.machine])

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

    def live(self) -> dict[int, int]:
        return dict(self._live)

    def lost(self) -> str | None:
        return self._lost_reason if self._lost.is_set() else None

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            try:
                client.shutdown()
            except Exception:  # noqa: BLE001 - leaving a service that is gone is fine
                pass
        tunnel, self._tunnel = self._tunnel, None
        if tunnel is not None:
            tunnel.close()

    def announce_finished(self, last_round: int) -> None:
        gate.announce_finished(self.address, self.machine, self._token, last_round)

    # jaxlib reports a missing key and a create-only write's collision as status
    # errors whose text names the code; every other error is a lost service.

    def _call(self, name: str, *args: Any) -> Any:
        if self.client is None:
            raise ServiceLost("not connected")
        try:
            return getattr(self.client, name)(*args)
        except Exception as error:  # noqa: BLE001
            if "NOT_FOUND" in str(error) or "ALREADY_EXISTS" in str(error):
                raise
            raise ServiceLost(f"{name} failed: {_first_line(error)}") from error

    def get(self, key: str) -> bytes | None:
        try:
            return self._call("key_value_try_get_bytes", f"{ROOT}/{key}")
        except ServiceLost:
            raise
        except Exception as error:  # noqa: BLE001
            if "NOT_FOUND" in str(error):
                return None
            raise

    def put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        try:
            self._call("key_value_set_bytes", f"{ROOT}/{key}", value, overwrite)
            return True
        except ServiceLost:
            raise
        except Exception as error:  # noqa: BLE001
            if "ALREADY_EXISTS" in str(error):
                return False
            raise

    def dir(self, prefix: str) -> dict[str, bytes]:
        full = f"{ROOT}/{prefix}/"
        return {k[len(full) :]: v for k, v in self._call("key_value_dir_get_bytes", full)}

    def delete(self, key: str) -> None:
        try:
            self._call("key_value_delete", f"{ROOT}/{key}")
        except Exception:  # noqa: BLE001 - a key another machine removed first
            pass

    def fetch(self, key: str, timeout_s: float) -> bytes:
        try:
            return self._call(
                "blocking_key_value_get_bytes", f"{ROOT}/{key}", int(timeout_s * 1000)
            )
        except Exception as error:  # noqa: BLE001
            raise ServiceLost(f"could not read {key}: {_first_line(error)}") from error

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        if self.client is None:
            raise ServiceLost("not connected")
        try:
            return self.client.blocking_key_value_get_bytes(
                f"{ROOT}/{key}", max(1, int(timeout_s * 1000))
            )
        except Exception as error:  # noqa: BLE001 - jaxlib raises its own status errors
            if "DEADLINE_EXCEEDED" in str(error):
                return None
            raise ServiceLost(f"could not read {key}: {_first_line(error)}") from error


class MemoryService:
    """An in-process service: the run's keys and its live slots, behind one lock.

    A test plays the service's part by hand: `kill(m)` stops hearing slot m (as
    the service does after a missed heartbeat), a store's `connect` gives its
    slot a new incarnation, `hold(key)` makes a write to `key` fail (a service
    that went away in the middle of an exchange), and `before_put(machine, key)`,
    if set, runs before every write: a test interleaves two machines there (the
    other machine's whole exchange runs between this one's read and its write).
    """

    def __init__(self, machines: int):
        self.machines = machines
        self.keys: dict[str, bytes] = {}
        self.incarnations: dict[int, int] = {}
        self.alive: set[int] = set()
        self.lock = threading.Condition()
        self.refused_writes: set[str] = set()
        self.finished_notices: list[tuple[int, int]] = []  # (machine, last round)
        self.before_put: Callable[[int, str], None] | None = None

    def store(self, machine: int) -> MemoryStore:
        """The `Store` machine `machine` connects through."""
        return MemoryStore(self, machine)

    def kill(self, machine: int) -> None:
        """The service stops hearing `machine` (its keys stay, as jaxlib's do)."""
        with self.lock:
            self.alive.discard(machine)

    def hold(self, key: str) -> None:
        """Every later write of `key` fails as if the service were gone."""
        with self.lock:
            self.refused_writes.add(key)


class MemoryStore:
    """`Store` on a `MemoryService` (one machine's view of it)."""

    def __init__(self, service: MemoryService, machine: int):
        self.service, self.machine = service, machine
        self.connected = False

    def connect(self) -> int:
        s = self.service
        with s.lock:
            s.incarnations[self.machine] = s.incarnations.get(self.machine, 0) + 1
            s.alive.add(self.machine)
            self.connected = True
            return s.incarnations[self.machine]

    def live(self) -> dict[int, int]:
        s = self.service
        with s.lock:
            return {m: s.incarnations[m] for m in sorted(s.alive)}

    def lost(self) -> str | None:
        with self.service.lock:
            if self.connected and self.machine not in self.service.alive:
                return "membership: the service stopped hearing this machine"
        return None

    def _check(self) -> None:
        if not self.connected:
            raise ServiceLost("not connected")

    def get(self, key: str) -> bytes | None:
        self._check()
        with self.service.lock:
            return self.service.keys.get(key)

    def put(self, key: str, value: bytes, overwrite: bool = True) -> bool:
        self._check()
        s = self.service
        if s.before_put is not None:
            s.before_put(self.machine, key)
        with s.lock:
            if key in s.refused_writes:
                raise ServiceLost(f"key_value_set_bytes failed: {key} refused")
            if not overwrite and key in s.keys:
                return False
            s.keys[key] = bytes(value)
            s.lock.notify_all()
            return True

    def dir(self, prefix: str) -> dict[str, bytes]:
        self._check()
        full = f"{prefix}/"
        with self.service.lock:
            return {
                k[len(full) :]: v
                for k, v in self.service.keys.items()
                if k.startswith(full) and "/" not in k[len(full) :]
            }

    def delete(self, key: str) -> None:
        self._check()
        with self.service.lock:
            for k in [k for k in self.service.keys if k == key or k.startswith(f"{key}/")]:
                del self.service.keys[k]

    def fetch(self, key: str, timeout_s: float) -> bytes:
        self._check()
        s = self.service
        with s.lock:
            if not s.lock.wait_for(lambda: key in s.keys, timeout=timeout_s):
                raise ServiceLost(f"could not read {key}: not written within {timeout_s:g} s")
            return s.keys[key]

    def wait(self, key: str, timeout_s: float) -> bytes | None:
        self._check()
        s = self.service
        with s.lock:
            s.lock.wait_for(lambda: key in s.keys, timeout=timeout_s)
            return s.keys.get(key)

    def close(self) -> None:
        with self.service.lock:
            self.service.alive.discard(self.machine)
        self.connected = False

    def announce_finished(self, last_round: int) -> None:
        with self.service.lock:
            self.service.finished_notices.append((self.machine, int(last_round)))
