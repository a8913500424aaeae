"""What the benchmarks and the tests that start processes share: ports, process groups,
timers and provenance, written once.

- `free_port()`: a TCP port free on loopback now.
- `start(command, log_path)`: a child in a process group of its own, logged to a file.
- `kill_group(proc)`: SIGKILL to a child started with ``start_new_session=True`` and
  everything it started; waits for it. `wait_all(procs, timeout)`: until all end, one
  fails or the time is up, then the rest killed.
- `median_seconds(fn, *args)`: the median time per call of a jitted function, each
  sample synchronised on its result (`jax.block_until_ready`).
- `commit()`: the checkout's commit, "+dirty" with uncommitted changes, for a result's
  provenance (`bench._sections.versions()` gives the versions).
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port that nothing listens on at 127.0.0.1 now (the OS's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p and p + 1 both free at 127.0.0.1 now: an elastic service with
    credentials listens on both (its gate on p, jax's service on p + 1). A lone free
    port's neighbour is often taken by some process's outgoing connection."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as low, socket.socket() as high:
            try:
                low.bind(("127.0.0.1", port))
                high.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports at 127.0.0.1 in 100 tries")


def start(command: Sequence[str], log_path: str, env: dict | None = None) -> subprocess.Popen:
    """`command` in a process group of its own (so `kill_group` ends all it starts), from
    the repository root, its stdout and stderr to `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            list(command),
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_group(proc: subprocess.Popen) -> None:
    """Kills `proc`'s process group (it was started in a session of its own) and reaps it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_all(procs: Sequence[subprocess.Popen], timeout: float, poll_s: float = 0.2) -> bool:
    """Waits until every process has ended or one has failed (a process that failed
    leaves the others waiting for it); kills what still runs. False: `timeout` seconds
    passed first.

    (The loops this replaces in bench/link.py and bench/overlap.py polled with
    ``any(p.poll() is None ...)``, which stops at the first live process: a later one
    that failed went unseen until the timeout.)"""
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in procs]  # every one polled: `any` would stop early
            if all(c is not None for c in codes) or any(codes):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(poll_s)
    finally:
        for proc in procs:
            kill_group(proc)


def median_seconds(fn: Callable, *args, repeats: int, inner: int = 1) -> float:
    """Median seconds per call of `fn(*args)` after a warm-up call.

    Each of the `repeats` samples queues `inner` calls and synchronises once on the
    last result, so with ``inner > 1`` a small array's figure is the device's time per
    call, not the host's launch-and-wait round trip.
    """
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def commit(root: pathlib.Path = ROOT) -> str:
    """The checkout's short commit, with "+dirty" for uncommitted changes to tracked
    files ("unknown" outside a git checkout)."""
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")
