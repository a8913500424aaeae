"""A sum across processes over plain TCP, beside jax's own CPU collectives (issue 51).

jax's cross-process all-reduce on CPU (gloo) waits for a buffer of more than about
256 KB by spinning a thread on the core that the transfer needs: with one core per
process a 482 KB all-reduce takes 4 ms where torch.distributed's takes 0.28 ms
(BENCHMARKS.md, "bench/collective_overlap.py"). `HostSum` sums a numpy buffer over
the processes through a star of blocking sockets (process 0 receives every other
process's buffer, adds them in process order and sends the total back, chunk by
chunk and pipelined, so that a link carries both directions at once), whose
waiting threads sleep in the kernel; `psum` calls it from inside a jitted program
through `jax.experimental.buffer_callback` (on XLA's own buffers, in place).

The total is the same on every process and is the left fold x_0 + x_1 + ... +
x_{P-1} in process order: for 2 processes the same bits as gloo's sum (a + b = b +
a in floating point); for more, another order of the same sum.

Scope: a run of P processes with ONE device each, the summed axis spanning them
(train.py's layout of one process per machine holding the whole model). It is
installed for the process (`install`); `lpdec.gossip.local_sum`, the all-reduce of
`local_mean` (data parallelism, DiLoCo's full-precision mean), routes through it
when the axis it sums over is exactly the processes (`routes`). Every other
collective stays jax's.

Each call carries a sequence number and the buffer's size in a 16-byte header that
the other side checks, so two processes that ever disagree on which sum they are in
fail with one line instead of adding the wrong buffers.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import buffer_callback

_HEADER = struct.Struct(">QQ")  # sequence number, payload bytes
#: Bytes a pipelined step moves (a multiple of every dtype's size).
CHUNK = 1 << 16


class HostSumError(RuntimeError):
    """The processes' sums went out of step, or a peer's connection closed."""


class HostSum:
    """Sums of numpy buffers over P processes through a star of TCP connections.

    Args:
      process_id: this process's index, 0..P-1.
      num_processes: P.
      connections: process 0: the connection to every other process, by index;
        the others: {0: the connection to process 0}.
    """

    def __init__(self, process_id: int, num_processes: int, connections: dict[int, socket.socket]):
        expected = set(range(1, num_processes)) if process_id == 0 else {0}
        if set(connections) != expected:
            raise ValueError(
                f"HostSum: process {process_id} of {num_processes} needs connections to "
                f"{sorted(expected)}, got {sorted(connections)}."
            )
        self.process_id = process_id
        self.num_processes = num_processes
        self._connections = connections
        self._calls = 0
        for conn in connections.values():
            conn.settimeout(None)
            if conn.family in (socket.AF_INET, socket.AF_INET6):
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __call__(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The sum of every process's `x` (same shape and dtype everywhere), in process order.

        Written into `out` (a C-contiguous array of x's shape and dtype) when given.
        The buffer moves in chunks of `CHUNK` bytes, pipelined: process 0 sends chunk k
        of the total back while chunk k + 1 still arrives, and each other process sends
        from a thread while it receives, so the link carries both directions at once
        (about one buffer's time on the wire, where a send then a receive takes two).
        """
        x = np.ascontiguousarray(x)
        total = np.empty_like(x) if out is None else out
        self._calls += 1
        header = _HEADER.pack(self._calls, x.nbytes)
        mine = memoryview(x.reshape(-1)).cast("B")
        into = memoryview(total.reshape(-1)).cast("B")
        if self.process_id != 0:
            conn = self._connections[0]
            failed: list[HostSumError] = []

            def send() -> None:
                try:
                    _send(conn, 0, header, mine)
                except HostSumError as error:
                    failed.append(error)

            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            try:
                self._check_header(conn, 0, x.nbytes)
                _read_exactly(conn, into, 0)
            finally:
                sender.join()
            if failed:
                raise failed[0]
            return total
        peers = range(1, self.num_processes)
        for peer in peers:
            self._check_header(self._connections[peer], peer, x.nbytes)
            _send(self._connections[peer], peer, header)
        incoming = bytearray(min(CHUNK, x.nbytes))
        step = CHUNK - CHUNK % x.itemsize
        for at in range(0, x.nbytes, step):
            end = min(at + step, x.nbytes)
            part = np.frombuffer(into[at:end], x.dtype)  # a view of `total`
            part[...] = np.frombuffer(mine[at:end], x.dtype)
            view = memoryview(incoming)[: end - at]
            for peer in peers:
                _read_exactly(self._connections[peer], view, peer)
                part += np.frombuffer(view, x.dtype)
            for peer in peers:
                _send(self._connections[peer], peer, into[at:end])
        return total

    def _check_header(self, conn: socket.socket, peer: int, nbytes: int) -> None:
        head = bytearray(_HEADER.size)
        _read_exactly(conn, memoryview(head), peer)
        calls, size = _HEADER.unpack(head)
        if (calls, size) != (self._calls, nbytes):
            raise HostSumError(
                f"process {self.process_id}: sum {self._calls} of {nbytes} bytes met "
                f"process {peer}'s sum {calls} of {size} bytes: the processes ran different "
                "programs."
            )

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()


def _send(conn: socket.socket, peer: int, *parts) -> None:
    try:
        for part in parts:
            conn.sendall(part)
    except OSError as error:
        raise HostSumError(f"the host-sum connection to process {peer} failed: {error}.") from None


def _read_exactly(conn: socket.socket, view: memoryview, peer: int) -> None:
    got = 0
    while got < view.nbytes:
        try:
            n = conn.recv_into(view[got:])
        except OSError as error:  # a reset: the peer closed with our bytes unread
            raise HostSumError(
                f"the host-sum connection to process {peer} failed: {error}."
            ) from None
        if n == 0:
            raise HostSumError(f"process {peer} closed its host-sum connection mid-sum.")
        got += n


_installed: HostSum | None = None


def install(group: HostSum | None) -> None:
    """Makes `group` this process's host sum (None: jax's collectives again)."""
    global _installed
    _installed = group


def installed() -> HostSum | None:
    """The installed `HostSum`, or None."""
    return _installed


def fits(num_nodes: int) -> bool:
    """Whether a run of `num_nodes` nodes suits the host sum by default ("auto"): a CPU
    run of several processes, each one device holding one node (measured faster than
    jax's gloo there with a core a process, and level or faster without pinning and on
    a 1 Gbit link: BENCHMARKS.md, "bench/step_parity.py")."""
    return (
        jax.process_count() > 1
        and jax.local_device_count() == 1
        and jax.local_devices()[0].platform == "cpu"
        and num_nodes == jax.process_count()
    )


def routes(axis_name: str | Sequence[str]) -> bool:
    """Whether a sum over `axis_name`, traced now, goes through the installed host sum.

    Yes when a `HostSum` is installed, this process has one device, and every named
    axis is a manual mesh axis (`jax.shard_map`, not `vmap`) whose sizes multiply to
    the process count: the axis is then exactly the processes.
    """
    if _installed is None or jax.local_device_count() != 1:
        return False
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    mesh = jax.sharding.get_abstract_mesh()
    if not names or not all(n in mesh.manual_axes for n in names):
        return False
    size = int(np.prod([mesh.shape[n] for n in names]))
    return size == _installed.num_processes


def psum(x: jax.Array) -> jax.Array:
    """The installed host sum of `x` over the processes, from inside a jitted program.

    Call only where `routes(axis_name)` holds: every process must make the same
    calls in the same order (one per execution of the traced sum). The sum runs in
    a `buffer_callback` (XLA's buffers, written in place: no copy onto a jax array
    and back, which `pure_callback` makes and which can wait on the very program
    that is running), marked as having a side effect so that XLA neither drops nor
    repeats it.
    """
    group = _installed
    if group is None:
        raise HostSumError("lpdec.host_sum.psum: no HostSum is installed (`install`).")

    def sum_in_place(ctx, out, x):
        del ctx
        group(np.asarray(x), np.asarray(out))

    return buffer_callback.buffer_callback(
        sum_in_place, jax.ShapeDtypeStruct(x.shape, x.dtype), has_side_effect=True
    )(x)
