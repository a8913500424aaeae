"""A private network of Linux network namespaces joined by htb-shaped veth links.

`Network(hosts, prefix, subnet)` makes one namespace per host, named
`<prefix>-h<i>`. Two hosts are joined by one veth pair; more hosts each get a
veth pair to a bridge that lives in its own namespace `<prefix>-br`. Host i
has the address 10.77.<subnet>.<i + 1>/24 on its `eth0` and `lo` up; no
namespace has a route anywhere else, so nothing a run sends can leave the
network. `shape(rate)` puts an htb root qdisc with one class of that rate on
every host's `eth0`, so each direction of every flow is shaped at its sender;
`shape(None)` takes it off again.

Both ends of every veth pair are created directly inside the namespaces, so
no interface ever appears in the namespace the harness runs in, and deleting
the namespaces deletes the links. `ip netns exec` bind-mounts
`/etc/netns/<name>/hosts` over `/etc/hosts`: the machine's host name resolves
to the namespace's own address there, which is what gloo binds to and
advertises to its peers.

Everything needs root and iproute2 (`ip`, `tc` with the htb qdisc); see
`unavailable()`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess

from bench import harness

SUBNET = "10.77.{subnet}.{host}"
ETC_NETNS = "/etc/netns"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=60)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not on PATH"
    probe = f"lpdec-probe-{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        htb = _run(
            "ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "handle",
            "1:", "htb", check=False,
        )  # fmt: skip
        if htb.returncode:
            return f"the htb qdisc is not available: {htb.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def namespaces(prefix: str) -> list[str]:
    """Names of the existing network namespaces that start with `prefix`."""
    listed = _run("ip", "netns", "list", check=False).stdout.splitlines()
    names = [line.split()[0] for line in listed if line.strip()]
    return [name for name in names if name.startswith(prefix)]


def cleanup(prefix: str) -> list[str]:
    """Deletes every namespace (and its /etc/netns entry) whose name starts with `prefix`."""
    if not prefix:
        raise ValueError("cleanup: prefix must not be empty (it would match every namespace)")
    removed = []
    for name in namespaces(prefix):
        _kill_inside(name)
        _run("ip", "netns", "del", name, check=False)
        removed.append(name)
    if os.path.isdir(ETC_NETNS):
        for name in os.listdir(ETC_NETNS):
            if name.startswith(prefix):
                shutil.rmtree(os.path.join(ETC_NETNS, name), ignore_errors=True)
    return removed


def _kill_inside(name: str) -> None:
    """SIGKILLs processes left inside namespace `name` (by pid: `ip netns pids`)."""
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


class Network:
    """`hosts` namespaces on one shaped link (see the module docstring)."""

    def __init__(self, hosts: int, prefix: str, subnet: int):
        if hosts < 2:
            raise ValueError(f"hosts={hosts}: a link needs at least 2 hosts")
        if not 0 <= subnet <= 255:
            raise ValueError(f"subnet={subnet}: expected 0..255 (the third octet of 10.77.x.y)")
        self.hosts = hosts
        self.prefix = prefix
        self.subnet = subnet
        self.names = [f"{prefix}-h{i}" for i in range(hosts)]
        self.bridge = f"{prefix}-br" if hosts > 2 else None
        self.rate: str | None = None

    def address(self, host: int) -> str:
        return SUBNET.format(subnet=self.subnet, host=host + 1)

    def exec_prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.names[host]]

    def create(self) -> None:
        """Makes the namespaces and links; on any failure removes what it made and raises."""
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise

    def _create(self) -> None:
        all_names = self.names + ([self.bridge] if self.bridge else [])
        for name in all_names:
            _run("ip", "netns", "add", name)
            _run("ip", "-n", name, "link", "set", "lo", "up")
        if self.bridge is None:
            _run(
                "ip", "link", "add", "eth0", "netns", self.names[0], "type", "veth",
                "peer", "name", "eth0", "netns", self.names[1],
            )  # fmt: skip
        else:
            _run("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.bridge, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                port = f"p{i}"
                _run(
                    "ip", "link", "add", "eth0", "netns", name, "type", "veth",
                    "peer", "name", port, "netns", self.bridge,
                )  # fmt: skip
                _run("ip", "-n", self.bridge, "link", "set", port, "master", "br0")
                _run("ip", "-n", self.bridge, "link", "set", port, "up")
        for i, name in enumerate(self.names):
            _run("ip", "-n", name, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", name, "link", "set", "eth0", "up")
            os.makedirs(os.path.join(ETC_NETNS, name), exist_ok=True)
            with open(os.path.join(ETC_NETNS, name, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost\n{self.address(i)} {socket.gethostname()}\n")

    def shape(self, rate: str | None) -> None:
        """Limits every host's egress to `rate` (tc syntax: "100mbit", "1gbit"); None: unshaped."""
        for name in self.names:
            _run("ip", "netns", "exec", name, "tc", "qdisc", "del", "dev", "eth0", "root",
                 check=False)  # fmt: skip
            if rate is None:
                continue
            tc = ("ip", "netns", "exec", name, "tc")
            _run(*tc, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10")
            _run(
                *tc, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10",
                "htb", "rate", rate, "ceil", rate,
            )  # fmt: skip
        self.rate = rate

    def counters(self, host: int = 0) -> tuple[int, int]:
        """(bytes sent, bytes received) so far on host `host`'s link (its veth's counters)."""
        values = []
        for direction in ("tx_bytes", "rx_bytes"):
            path = f"/sys/class/net/eth0/statistics/{direction}"
            out = _run(*self.exec_prefix(host), "cat", path).stdout
            values.append(int(out.strip()))
        return values[0], values[1]

    def destroy(self) -> None:
        """Removes every namespace of this network; safe to call more than once."""
        cleanup(f"{self.prefix}-")


# ----------------------------------------------------------------------------
# What a harness must clean up on every exit path: its child process groups
# and the networks it made (bench/link.py, bench/overlap.py).
# ----------------------------------------------------------------------------


class Interrupted(BaseException):
    """Raised by the signal handlers so that every `finally` runs."""


CHILDREN: list[subprocess.Popen] = []
NETWORKS: list[Network] = []


def teardown() -> None:
    """Kills every live child process group and destroys every network; idempotent."""
    # A second Ctrl-C must not cut the cleanup short.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    for proc in CHILDREN:
        harness.kill_group(proc)
    CHILDREN.clear()
    for network in NETWORKS:
        network.destroy()
    NETWORKS.clear()


def _on_signal(signum, frame):
    del frame
    raise Interrupted(signal.Signals(signum).name)


def install_cleanup() -> None:
    """SIGINT/SIGTERM/SIGHUP raise `Interrupted`; `teardown` runs at interpreter exit."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _on_signal)
    atexit.register(teardown)
