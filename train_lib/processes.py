"""Starting a multi-process run: checked arguments, a handshake before jax starts, and a
check that the workdir is shared.

`jax.distributed.initialize` on its own waits silently when a peer never
comes (and then aborts from C++), listens on every interface, and lets
processes with different configs (or a different `--num_processes`, or the
same `--process_id` twice) start and then hang in their first collective.
`start` checks the arguments, says what it waits for, runs a handshake on the
coordinator's port that names whatever differs, binds the coordinator to the
address the peers dial (loopback stays loopback) unless told otherwise, and
gives up after `--peer_timeout`; the handshake's connections then stay open
for `watchdog.PeerWatch`, which ends the run when a process is lost.
`check_shared_workdir` refuses per-machine workdirs, on which orbax's
multi-process checkpoints would wait for ever.

jax is imported where it is first needed, after the handshake: a process refused
there exits before paying jax's import (seconds).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import struct
import time

import numpy as np
from absl import logging

from train_lib import watchdog
from train_lib.errors import RunError


class ProcessError(RunError):
    """The processes of a multi-process run do not fit together, or a peer never came."""


def check_args(coordinator_address: str | None, num_processes, process_id) -> None:
    """One-line errors for multi-process flags that cannot work."""
    if coordinator_address is None:
        if num_processes not in (None, 1) or process_id not in (None, 0):
            raise ProcessError(
                "--num_processes/--process_id need --coordinator_address=HOST:PORT "
                "(the address of process 0)."
            )
        return
    host, _, port = coordinator_address.rpartition(":")
    if not host or not port.isdigit():
        raise ProcessError(
            f"--coordinator_address={coordinator_address} must be HOST:PORT (process 0's address)."
        )
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ProcessError(f"--num_processes={num_processes} must be an integer >= 1.")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ProcessError(
            f"--process_id={process_id} must be in 0..{num_processes - 1} "
            f"(--num_processes={num_processes})."
        )


def bind_address(coordinator_address: str, override: str | None = None) -> str:
    """Where process 0's coordinator listens: `override`, else the address peers dial.

    jax's default is every interface (`[::]:port`); binding to the coordinator's
    own address keeps a loopback run on loopback and a LAN run on its LAN.
    """
    if override:
        return override
    host, _, port = coordinator_address.rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        address = host
    except ValueError:
        address = socket.gethostbyname(host)  # a name: bind to what it resolves to here
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


_MAX_MESSAGE = 1 << 20


def _send(conn: socket.socket, obj) -> None:
    data = json.dumps(obj, sort_keys=True, default=str).encode()
    conn.sendall(struct.pack(">I", len(data)) + data)


def _receive(conn: socket.socket):
    def exactly(n):
        chunks = b""
        while len(chunks) < n:
            part = conn.recv(n - len(chunks))
            if not part:
                raise ConnectionError("the peer closed the connection")
            chunks += part
        return chunks

    (size,) = struct.unpack(">I", exactly(4))
    if size > _MAX_MESSAGE:
        raise ConnectionError(f"a {size}-byte message is not an lpdec handshake")
    return json.loads(exactly(size))


def _differences(fields_by_process: dict[int, dict]) -> list[str]:
    ids = sorted(fields_by_process)
    differing = []
    for key in sorted(set().union(*fields_by_process.values())):
        values = [fields_by_process[i].get(key, "(absent)") for i in ids]
        if any(v != values[0] for v in values):
            per_process = ", ".join(f"process {i}: {v!r}" for i, v in zip(ids, values, strict=True))
            differing.append(f"{key} ({per_process})")
    return differing


def _host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _serve_handshake(
    num_processes: int, fields: dict, bind: str, deadline: float, sum_channel: bool = False
) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """Process 0: wait for every other process's hello, check them, answer all.

    Returns the open connection to every other process, by process index, and with
    `sum_channel` each one's second connection, for `lpdec.host_sum` (else {}).
    """
    conns: list[socket.socket] = []
    by_process: dict[int, socket.socket] = {}
    sums: dict[int, socket.socket] = {}
    seen: dict[int, dict] = {0: fields}
    problems: list[str] = []

    def waiting() -> bool:
        if len(seen) < num_processes:
            return True
        # A peer whose config differs may never open its sum channel: say so at once.
        return sum_channel and len(sums) < num_processes - 1 and not _differences(seen)

    with socket.create_server(_host_port(bind)) as server:
        while waiting() and not problems:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(num_processes)) - set(seen))
                problems.append(
                    f"process(es) {', '.join(map(str, missing))} of {num_processes} did not "
                    f"connect to {bind} within the --peer_timeout; check their "
                    "--coordinator_address, --num_processes and --process_id"
                )
                break
            server.settimeout(remaining)
            try:
                conn, _ = server.accept()
                conn.settimeout(max(1.0, deadline - time.monotonic()))
                hello = _receive(conn)
            except (ConnectionError, ValueError, OSError):  # TimeoutError is an OSError
                continue
            pid = hello.get("process_id")
            if hello.get("channel") == "sum":
                # The verdict goes over the hello's connection; this one carries sums only.
                if not sum_channel or pid not in range(1, num_processes) or pid in sums:
                    problems.append(f"an unexpected host-sum connection from process {pid}")
                    conn.close()
                else:
                    sums[pid] = conn
                continue
            conns.append(conn)
            if hello.get("num_processes") != num_processes:
                problems.append(
                    f"--num_processes differs (process 0: {num_processes}, process {pid}: "
                    f"{hello.get('num_processes')})"
                )
            elif pid in seen:
                problems.append(f"two processes were started with --process_id={pid}")
            else:
                seen[pid] = hello.get("fields", {})
                by_process[pid] = conn
        if not problems:
            differing = _differences(seen)
            if differing:
                problems.append(
                    "the processes were started differently: "
                    + "; ".join(differing[:5])
                    + ("; ..." if len(differing) > 5 else "")
                )
        error = "; ".join(problems)
        for conn in conns:
            try:
                _send(conn, {"error": error} if error else {"ok": True})
            except OSError:
                pass
            if error:
                conn.close()
        if error:
            for conn in sums.values():
                conn.close()
    if error:
        raise ProcessError(f"{error}. Start every process with the same config and flags.")
    return by_process, sums


def _join_handshake(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    fields: dict,
    deadline: float,
    sum_channel: bool = False,
) -> tuple[dict[int, socket.socket], dict[int, socket.socket]]:
    """Processes 1..: say hello to process 0 and wait for its verdict.

    Returns, as `_serve_handshake` returns process 0's, the open connection to
    process 0 by its id and, with `sum_channel`, a second one for `lpdec.host_sum`
    (else no sum connection).
    """
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ProcessError(
                f"process {process_id}: no process 0 at {coordinator_address} within the "
                "--peer_timeout; start process 0 with the same --coordinator_address."
            )
        try:
            conn = socket.create_connection(
                _host_port(coordinator_address), timeout=min(2.0, remaining)
            )
        except OSError:
            time.sleep(0.2)
            continue
        conn.settimeout(max(1.0, deadline - time.monotonic()))
        hello = {"process_id": process_id, "num_processes": num_processes, "fields": fields}
        sums, channel_error = None, None
        try:
            _send(conn, hello)
            if sum_channel:
                try:
                    sums = socket.create_connection(
                        _host_port(coordinator_address),
                        timeout=max(1.0, deadline - time.monotonic()),
                    )
                    _send(sums, {"channel": "sum", "process_id": process_id})
                except OSError as error:
                    # Process 0 may have closed its port on a config that differs: its
                    # verdict, read next, names that.
                    channel_error = error
            verdict = _receive(conn)
            if channel_error is not None and "error" not in verdict:
                raise channel_error
        except (TimeoutError, ConnectionError, ValueError, OSError) as error:
            conn.close()
            if sums is not None:
                sums.close()
            raise ProcessError(
                f"process {process_id}: the handshake with process 0 at "
                f"{coordinator_address} failed ({error})."
            ) from None
        if "error" in verdict:
            conn.close()
            if sums is not None:
                sums.close()
            raise ProcessError(
                f"{verdict['error']}. Start every process with the same config and flags."
            )
        return {0: conn}, ({} if sums is None else {0: sums})


def start(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    fields: dict,
    *,
    bind: str | None = None,
    timeout_s: int = 300,
    heartbeat_timeout_s: int = 20,
    peer_lost_status: int,
    process_sum: str = "jax",
    num_nodes: int = 0,
) -> watchdog.PeerWatch:
    """Checks the processes fit together, then starts jax.distributed.

    Before jax's coordinator starts (a peer it waits for in vain aborts the
    process from C++ after its timeout), process 0 listens on the coordinator's
    port for every other process's hello: its `--process_id`, `--num_processes`
    and `fields` (the config). A missing peer, a duplicate or out-of-range id, a
    different process count or a different config ends every process with one
    line naming what differs; then the port is handed to jax's coordinator.

    The handshake's connections stay open for the run: the returned
    `watchdog.PeerWatch` ends this process with `peer_lost_status` when another
    process is lost (its connection closes, or it is silent for
    `heartbeat_timeout_s`). Call its `leave()` when this process ends.

    With `process_sum` (config.process_sum) "host", or "auto" on a CPU run of one
    device and one node (`num_nodes`, the config's) per process, every other process
    also opens a second connection to process 0 in the handshake, and `lpdec.host_sum`
    is installed over them: local_mean's all-reduce across the processes then goes
    through it instead of jax's gloo (for "auto" the connection is opened, and closed
    again when jax's devices show the run does not fit).
    """
    check_args(coordinator_address, num_processes, process_id)
    bind = bind_address(coordinator_address, bind)
    logging.info(
        "process %d: waiting for %d processes at %s (giving up after %d s, --peer_timeout)",
        process_id,
        num_processes,
        coordinator_address,
        timeout_s,
    )
    deadline = time.monotonic() + timeout_s
    channel = process_sum in ("auto", "host")
    join = (coordinator_address, num_processes, process_id, fields, deadline, channel)
    if process_id == 0:
        try:
            connections, sums = _serve_handshake(num_processes, fields, bind, deadline, channel)
        except OSError:
            # The port is taken: most likely by another process started as process 0,
            # whose handshake then names the duplicate id to everyone.
            connections, sums = _join_handshake(*join)
    else:
        connections, sums = _join_handshake(*join)
    peers = watchdog.PeerWatch(
        process_id,
        num_processes,
        connections,
        exit_status=peer_lost_status,
        silence_s=heartbeat_timeout_s,
    )
    import jax  # noqa: PLC0415 - after the handshake (the module's docstring)

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=max(30, int(deadline - time.monotonic())),
        coordinator_bind_address=bind if process_id == 0 else None,
        # jax aborts a process whose peer misses this many seconds of heartbeats;
        # the watch above must speak first, with its one line and exit status.
        heartbeat_timeout_seconds=max(100, heartbeat_timeout_s + 30),
    )
    if channel:
        import lpdec.host_sum  # noqa: PLC0415 - imports jax (the module's docstring)

        if process_sum == "host" or lpdec.host_sum.fits(num_nodes):
            lpdec.host_sum.install(lpdec.host_sum.HostSum(process_id, num_processes, sums))
            logging.info(
                "process %d: local_mean's sums over the %d processes go through "
                "lpdec.host_sum (config.process_sum=%r)",
                process_id,
                num_processes,
                process_sum,
            )
        else:
            for conn in sums.values():
                conn.close()
    return peers


def _gather_strings(text: str) -> list[str]:
    """Every process's `text`, in process order (all processes must call it)."""
    import jax.experimental.multihost_utils  # noqa: PLC0415 - the module's docstring

    data = np.frombuffer(text.encode(), np.uint8)
    lengths = jax.experimental.multihost_utils.process_allgather(np.int32(data.size))
    padded = np.zeros(int(np.max(lengths)), np.uint8)
    padded[: data.size] = data
    gathered = jax.experimental.multihost_utils.process_allgather(padded)
    return [bytes(row[:n]).decode() for row, n in zip(gathered, lengths, strict=True)]


def check_shared_workdir(workdir: str) -> None:
    """Refuses per-machine workdirs: orbax's multi-process checkpoints need one shared
    directory (process 0 finishes a checkpoint once every process's files are in it;
    on separate disks it would wait for ever)."""
    import jax.experimental.multihost_utils  # noqa: PLC0415 - the module's docstring

    if jax.process_count() == 1:
        return
    token = os.path.join(workdir, ".shared-check")
    run_id = _gather_strings(f"{socket.gethostname()}:{os.getpid()}")[0]
    if jax.process_index() == 0:
        with open(token, "w") as f:
            f.write(run_id)
    jax.experimental.multihost_utils.sync_global_devices("lpdec shared workdir written")
    try:
        with open(token) as f:
            seen = f.read() == run_id
    except OSError:
        seen = False
    everyone = _gather_strings("1" if seen else "0")
    jax.experimental.multihost_utils.sync_global_devices("lpdec shared workdir read")
    if jax.process_index() == 0:
        os.remove(token)
    blind = [i for i, s in enumerate(everyone) if s != "1"]
    if blind:
        raise ProcessError(
            f"--workdir={workdir} is not one directory shared by all processes: process(es) "
            f"{', '.join(map(str, blind))} cannot see process 0's files there. Multi-process "
            "checkpoints need a shared file system (e.g. NFS) mounted at the same path."
        )
