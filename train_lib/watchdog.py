"""Ending a run that cannot end by itself: a lost peer process, and SIGTERM/SIGINT.

When one process of a multi-process run dies, the others wait in their next
collective for ever: gloo does not notice, and jax's coordination service only
aborts them after its heartbeat timeout ("Fatal Python error: Aborted", exit
134, 75 s and more). Once the processes are connected, jax also takes SIGTERM
for its preemption service, so `timeout` cannot stop a run; and a Python signal
handler runs only when the main thread runs Python, never while it waits in a
collective.

Both watchers here are daemon threads, which run while the main thread waits
inside a collective (jax releases the GIL there). A thread cannot unwind a main
thread stuck in C++, so when one of them has to end the process it writes one
line to stderr and calls `os._exit`; everything else ends the run at a step
boundary, in order.

- `PeerWatch` keeps the connections of the start's handshake (process 0 to
  every other process) open for the whole run and sends a heartbeat on them
  every second. A peer whose connection closes without a goodbye (killed,
  crashed), that says it stopped with an error, or that is silent for
  `silence_s`, is lost: process 0 tells the others which one, and every process
  exits with the status given, naming it.
- `StopSignals` takes SIGTERM and SIGINT: the run stops at its next step
  boundary, where all processes agree on the stop (`agreed`), saves a
  checkpoint and its summary, and exits with 128 + the signal's number. If it
  is still running `timeout_s` after the signal (a long step, a collective
  that never returns, a slow checkpoint write), it exits then: the newest
  complete checkpoint stays, one being written is abandoned (orbax writes into
  a temporary directory and renames it only when complete). A second signal
  exits at once.

The module imports jax only where a stop is agreed on (in the training loop): the
handshake's watch starts before jax is imported (`train_lib.processes`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time
from typing import NamedTuple

import numpy as np

_BEAT_S = 1.0  # how often a heartbeat is sent
# How long a peer that said it stopped with an error is given before this process
# ends too: the same bad input usually stops every process by itself, a moment later.
_GRACE_S = 5.0


def _exit_now(message: str, status: int) -> None:
    """One line on stderr and the end of the process, whatever the main thread is doing."""
    try:
        os.write(2, f"error: {message}\n".encode())
    finally:
        os._exit(status)


class PeerWatch:
    """Ends this process when another process of the run is lost.

    Process 0 holds a connection to every other process; each of those holds
    one to process 0 and learns from it which other process was lost.

    Args:
      process_id: this process's index.
      num_processes: the number of processes in the run.
      connections: peer index -> the handshake's open connection to it.
      exit_status: the process's exit status when a peer is lost.
      silence_s: seconds without a heartbeat after which a peer counts as lost.
    """

    def __init__(
        self,
        process_id: int,
        num_processes: int,
        connections: dict[int, socket.socket],
        *,
        exit_status: int,
        silence_s: float,
    ):
        self._me, self._n = process_id, num_processes
        self._connections = dict(connections)
        self._exit_status, self._silence_s = exit_status, silence_s
        self._buffers = {peer: b"" for peer in connections}
        self._heard = {peer: time.monotonic() for peer in connections}
        self._failing: dict[int, tuple[float, str]] = {}  # peer -> (deadline, why)
        self._send_lock = threading.Lock()
        self._left = threading.Event()
        for conn in connections.values():
            conn.settimeout(5.0)  # a send to a frozen peer must not block the heartbeat for long
        threading.Thread(target=self._run, name="lpdec-peer-watch", daemon=True).start()

    def leave(self, error: str | None = None) -> None:
        """Tells the peers this process ends: after its last collective, or with `error`.

        From then on a peer's departure no longer ends this process.
        """
        self._left.set()
        self._send_all({"failed": error} if error else {"left": True})
        for conn in list(self._connections.values()):
            conn.close()

    def _send_all(self, message: dict) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            for conn in list(self._connections.values()):
                try:
                    conn.sendall(data)
                except OSError:
                    pass  # a closed connection is found by the reader

    def _lost(self, peer: int, why: str) -> None:
        if self._left.is_set():
            return
        if self._me == 0:
            self._send_all({"lost": peer, "why": why})
        _exit_now(
            f"process {peer} of {self._n} was lost ({why}); process {self._me} stops too, "
            "as the run cannot go on without it. Restart every process with the same "
            "command to resume from the newest checkpoint.",
            self._exit_status,
        )

    def _on_message(self, peer: int, message: dict) -> None:
        if "left" in message:
            self._connections.pop(peer).close()
        elif "failed" in message:
            self._failing[peer] = (
                time.monotonic() + _GRACE_S,
                f"it stopped with: {message['failed']}",
            )
        elif "lost" in message:
            self._lost(int(message["lost"]), f"{message['why']}; seen by process 0")

    def _read(self, peer: int, conn: socket.socket) -> None:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            self._connections.pop(peer).close()
            if peer not in self._failing:
                self._lost(peer, "its connection closed without a goodbye: killed or crashed")
            return
        self._heard[peer] = time.monotonic()
        self._buffers[peer] += data
        *lines, self._buffers[peer] = self._buffers[peer].split(b"\n")
        for line in lines:
            if line.strip():
                self._on_message(peer, json.loads(line))

    def _run(self) -> None:
        next_beat = 0.0
        while not self._left.is_set():
            connections = dict(self._connections)
            try:
                readable, _, _ = select.select(list(connections.values()), [], [], _BEAT_S / 4)
            except (OSError, ValueError):
                continue  # a connection closed by leave() in the main thread
            for peer, conn in connections.items():
                if conn in readable and not self._left.is_set():
                    self._read(peer, conn)
            # Deadlines after reading: a heartbeat waiting in the socket is not silence.
            now = time.monotonic()
            if now >= next_beat:
                self._send_all({"beat": True})
                next_beat = now + _BEAT_S
            for peer, (deadline, why) in list(self._failing.items()):
                if now >= deadline:
                    self._lost(peer, why)
            for peer, heard in self._heard.items():
                if peer in self._connections and now - heard > self._silence_s:
                    self._lost(peer, f"no heartbeat for {self._silence_s:g} s")


class Stop(NamedTuple):
    """A stop every process agreed on: the first signal and the process it came to."""

    signum: int
    process: int

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_status(self) -> int:
        return 128 + self.signum  # the shell's status for a death by this signal


class StopSignals:
    """SIGTERM and SIGINT stop the run at its next step boundary, or after `timeout_s`.

    `install` it in the main thread, after `jax.distributed.initialize` (which
    puts jax's own SIGTERM handler in place). Every process calls `agreed` at
    every step boundary.

    Args:
      timeout_s: seconds after the first signal at which the process exits,
        wherever it is.
      peers: the run's `PeerWatch`, told before such an exit.
    """

    def __init__(self, timeout_s: float, peers: PeerWatch | None = None):
        self._timeout_s, self._peers = timeout_s, peers
        self._signum: int | None = None
        self._armed = False
        # Reentrant: the Python-level handler runs in the main thread, which may hold it.
        self._lock = threading.RLock()

    def install(self) -> StopSignals:
        # The C-level handler writes each signal's number to this socket, whether or
        # not the main thread gets to run Python; a thread reads it.
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer  # kept open for the process's life
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._handler)
        threading.Thread(target=self._read_signals, name="lpdec-stop-signals", daemon=True).start()
        return self

    def _handler(self, signum, frame) -> None:
        del frame
        # Only a fallback: the reader thread has normally seen this signal already.
        with self._lock:
            if self._signum is None:
                self._first(signum)

    def _read_signals(self) -> None:
        deliveries = 0
        while True:
            for signum in self._reader.recv(64):
                if signum not in (signal.SIGTERM, signal.SIGINT):
                    continue
                deliveries += 1
                with self._lock:
                    if deliveries > 1:
                        self._exit(signum, f"a second {signal.Signals(signum).name}: exiting now")
                    if self._signum is None:
                        self._first(signum)

    def _first(self, signum: int) -> None:
        self._signum = signum
        os.write(
            2,
            f"{signal.Signals(signum).name}: stopping at the next step boundary "
            f"(or in {self._timeout_s:g} s, --stop_timeout)\n".encode(),
        )
        self._arm(signum)

    def _arm(self, signum: int) -> None:
        if self._armed:
            return
        self._armed = True
        name = signal.Signals(signum).name
        timer = threading.Timer(
            self._timeout_s,
            self._exit,
            (
                signum,
                f"still running {self._timeout_s:g} s after {name} (--stop_timeout): exiting "
                "now; the newest complete checkpoint is kept, one being written is abandoned",
            ),
        )
        timer.daemon = True
        timer.start()

    def _exit(self, signum: int, message: str) -> None:
        if self._peers is not None:
            self._peers.leave(error=message)
        _exit_now(message, 128 + signum)

    def agreed(self) -> Stop | None:
        """The stop all processes agree on at this step boundary, or None.

        Every process must call it at the same boundaries (in a multi-process
        run it is a collective): a signal to any one process stops them all.
        """
        import jax.experimental.multihost_utils  # noqa: PLC0415 - the module's docstring

        local = self._signum or 0
        if jax.process_count() == 1:
            signums = np.array([local])
        else:
            signums = jax.experimental.multihost_utils.process_allgather(np.int32(local))
        first = np.flatnonzero(np.asarray(signums))
        if first.size == 0:
            return None
        stop = Stop(int(signums[first[0]]), int(first[0]))
        with self._lock:
            self._arm(stop.signum)  # the processes that got no signal end in time too
        return stop
