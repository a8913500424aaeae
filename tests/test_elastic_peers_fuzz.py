"""lpdec.elastic.peers under attack: random and hostile frames, slow senders, a flood.

Three machines (`Peers`, threads of this process on loopback, as in
tests/test_elastic_peers.py) run rounds of `reduce_scatter_gather`, first alone, then
while another process (this file run as a script: `_attack`) attacks every
machine's port for a few seconds:

- random bytes on fresh connections (a seeded `random.Random`);
- hostile frames: headers under a guessed token that announce 4 GiB or 2^63 bytes
  and then stream junk as fast as the receiver takes it; under the run's token, a
  4 GiB length (beyond `max_message_bytes`), a slot outside the run, the receiver's
  own slot, a flipped signature byte, a body that is not the signed one, a
  header or a body cut short;
- slow senders that trickle a header a byte every 0.1 s;
- a flood of idle connections (200 a machine at once, re-opened as the receivers close
  them).

The rounds must end with the same bytes as without the attack (the members' mean,
against numpy's), no attack connection may get an acknowledgement, every slow or
idle connection must be closed by its receiver within `header_s` of its acceptance
(the attacker sees the time from its connect: a margin covers the wait in the listen
queue and the scheduling on two busy cores), and nothing of the attack may stay in an
inbox.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import random
import selectors
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np

TOKEN = b"the run's token"
MEMBERS = [0, 1, 2]
VALUES = 120_000  # float64 a machine: 960 kB; each part a third of it
MAX_MESSAGE = 1 << 20  # what a member may send here: a part (320 kB) fits, twice over
HEADER_S = 1.0  # a header's time to arrive; every slow or idle connection must go by then
MARGIN_S = 8.0  # 2 busy cores: a burst of 600 connections waits to be accepted (up to 4 s)
ATTACK_S = 2.0
FLOOD = 600  # 200 a machine
SLOW = 5  # per machine
JUNK = 64 << 20  # junk each hostile header offers after it
MAC = 32  # a frame header ends with its HMAC-SHA256


# -- the attacker (a process of its own: its memory is not the receivers') ---------------


def _attack(plan_path: str) -> None:
    """Runs the plan's attack and writes its report (JSON) to plan["out"]."""
    with open(plan_path) as f:
        plan = json.load(f)
    rng = random.Random(plan["seed"])
    addresses = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in plan["addresses"])]
    end = time.monotonic() + plan["attack_s"]
    report = {"connections": 0, "acked": 0, "junk_taken": 0, "open_after_s": [], "left_open": 0}
    lock = threading.Lock()

    def count(**kw):
        with lock:
            for k, v in kw.items():
                report[k] += v

    def answered(connection) -> bool:
        """Whether the receiver answered anything before closing (an acknowledgement)."""
        try:
            connection.settimeout(plan["header_s"] + plan["margin_s"])
            return connection.recv(1) != b""
        except OSError:
            return False

    def frames():
        while time.monotonic() < end:
            for item in plan["hostile"]:
                with socket.create_connection(addresses[item["to"]], timeout=10) as c:
                    taken = 0
                    try:
                        c.sendall(bytes.fromhex(item["bytes"]))
                        piece = rng.randbytes(1 << 20)
                        while item["junk"] and taken < plan["junk"]:
                            c.sendall(piece)
                            taken += len(piece)
                        if item["cut"]:
                            c.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    count(connections=1, acked=answered(c), junk_taken=taken)

    def random_bytes():
        while time.monotonic() < end:
            with socket.create_connection(rng.choice(addresses), timeout=10) as c:
                try:
                    c.sendall(rng.randbytes(rng.randrange(1, 400)))
                    c.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                count(connections=1, acked=answered(c))

    # Slow senders and the flood: connections the receiver must close by itself.
    selector = selectors.DefaultSelector()
    opened: dict[socket.socket, float] = {}

    def open_one(address, slow: bool) -> None:
        c = socket.create_connection(address, timeout=10)
        c.setblocking(False)
        opened[c] = time.monotonic()
        selector.register(c, selectors.EVENT_READ, (slow, address))
        count(connections=1)

    for i in range(plan["flood"]):
        open_one(addresses[i % len(addresses)], False)
    for address in addresses:
        for _ in range(plan["slow"]):
            open_one(address, True)
    threads = [threading.Thread(target=t, daemon=True) for t in (frames, random_bytes)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    trickle = bytes.fromhex(plan["hostile"][0]["bytes"])
    stop = end + plan["header_s"] + plan["margin_s"]
    next_trickle = 0.0
    while opened and time.monotonic() < stop:
        now = time.monotonic()
        if now >= next_trickle:  # one more byte of a header on every slow connection
            next_trickle = now + 0.1
            for key in list(selector.get_map().values()):
                if key.data[0]:
                    try:
                        key.fileobj.send(trickle[:1])
                    except OSError:
                        pass
        for key, _ in selector.select(timeout=0.02):
            c = key.fileobj
            try:
                data = c.recv(1)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                count(acked=1)
            report["open_after_s"].append(time.monotonic() - opened.pop(c))
            selector.unregister(c)
            c.close()
            if time.monotonic() < end:  # the flood goes on while the attack does
                open_one(key.data[1], key.data[0])  # the same machine, the same kind
    report["left_open"] = len(opened)
    for t in threads:
        t.join(timeout=30)
    with open(plan["out"], "w") as f:
        json.dump(report, f)


# -- the receivers ----------------------------------------------------------------------


class _Peak:
    """The peak resident memory (VmRSS) and thread count of this process, sampled every 2 ms."""

    def __init__(self):
        self.rss = self.threads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.is_set():
            with open("/proc/self/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            self.rss = max(self.rss, rss * 1024)
            self.threads = max(self.threads, threading.active_count())
            self._stop.wait(0.002)

    def stop(self):
        self._stop.set()
        self._thread.join()


def _machines():
    from lpdec.elastic import peers as p2p

    return {
        m: p2p.Peers(m, TOKEN, machines=3, max_message_bytes=MAX_MESSAGE, header_s=HEADER_S)
        for m in MEMBERS
    }


def _rounds(machines, vectors, first, until):
    """Rounds first, first + 1, ... (at least 4, and until `until()` is False) of the
    same vectors: (machine 0's result of the first, the rounds run, how many members'
    results of them were not the same bytes)."""
    from lpdec.elastic import peers as p2p

    addresses = {m: machines[m].address for m in MEMBERS}
    cuts = p2p.split(VALUES, len(MEMBERS))

    def reduce(chunk, parts):
        return np.mean([np.frombuffer(p, np.float64) for p in parts], axis=0).tobytes()

    first_out, rounds, differ, errors = None, 0, 0, []
    while rounds < 4 or until():
        out = {}

        def run(m, round_=first + rounds, out=out):
            try:
                parts = [vectors[m][a:b].tobytes() for a, b in cuts]
                chunks = p2p.reduce_scatter_gather(
                    machines[m], round_, MEMBERS, addresses, parts, reduce, timeout=20.0
                )
                out[m] = b"".join(chunks)
            except Exception as error:  # noqa: BLE001 - the test reports it
                errors.append(error)

        threads = [threading.Thread(target=run, args=(m,)) for m in MEMBERS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        first_out = first_out or out[0]
        differ += sum(out[m] != first_out for m in MEMBERS)
        rounds += 1
    return first_out, rounds, differ


def _hostile(machines) -> list[dict]:
    """The hostile frames, each for one machine (index into MEMBERS)."""
    from lpdec.elastic import peers as p2p

    stranger = p2p.Peers(1, b"a guessed token")
    insiders = {s: p2p.Peers(s, TOKEN) for s in (0, 1, 7)}
    try:
        body = np.ones(100).tobytes()
        genuine = insiders[1].frame(50, "part", 0, body)  # would be taken by machine 0
        forged = stranger.frame(50, "part", 0, body)

        def huge(key, sender, length):  # a header announcing `length` bytes, signed with key
            fields = bytearray(insiders[sender].frame(50, "part", 0, b"")[:-MAC])
            fields[21:29] = length.to_bytes(8, "big")  # the length field (after 4+1+8+4+4)
            return bytes(fields) + hmac.new(key, bytes(fields), hashlib.sha256).digest()

        bad_mac = bytearray(genuine)
        bad_mac[-1] ^= 1
        items = [
            (0, huge(b"a guessed token", 1, (1 << 32) - 1), True, False),  # 4 GiB, no token
            (1, huge(b"a guessed token", 0, 1 << 63), True, False),
            (0, huge(TOKEN, 1, (1 << 32) - 1), True, False),  # the token, beyond the limit
            (2, insiders[7].frame(50, "part", 0, body) + body, False, False),  # slot 7 of 3
            (0, insiders[0].frame(50, "part", 0, body) + body, False, False),  # its own slot
            (0, bytes(bad_mac) + body, False, False),
            (0, forged + body, False, False),  # machine 1's part, guessed token
            (0, genuine + np.zeros(100).tobytes(), False, False),  # not the signed body
            (0, genuine[:40], False, True),  # a header cut short
            (0, genuine + body[:300], False, True),  # a body cut short
            (2, os.urandom(p2p.FRAME), True, False),
        ]
    finally:
        for peer in (stranger, *insiders.values()):
            peer.close()
    return [{"to": t, "bytes": b.hex(), "junk": j, "cut": c} for t, b, j, c in items]


def test_an_attack_leaves_the_rounds_and_the_memory_as_they_were(tmp_path):
    """Memory: the peaks while the attack runs against the peaks of as many seconds of the
    same rounds without it.

    - Python's allocations (tracemalloc: every bytes and bytearray a receiver reads into)
      may grow by 4 MiB: twice the largest body a receiver reads at once under the run's
      token (a body is assembled, then copied once: 2 `max_message_bytes`, 1 MiB here),
      one at a time in this attack, and headers of 93 bytes. The hostile headers
      announce 4 GiB or 2^63 bytes and offer 64 MiB after each: a receiver that read a
      body before its header's signature and length were checked holds 64 MiB or more.
    - Threads may grow by 3 machines x 2 `max_pending` (32): a thread for each unheard
      connection kept, one for each sender's, and some that were closed to make room
      and have not yet ended; not one a connection (the flood alone opens 200 a machine
      at once, and connections come and go by the thousand).
    - Resident memory may grow by 96 MiB: measured +40 MiB with random bytes alone (no
      flood, no junk; tracemalloc +1 MiB): the thread a connection gets spreads the
      rounds' 1 MB arrays over glibc's per-thread arenas (8 a core), whose freed blocks
      stay resident; a receiver that buffered the hostile junk adds 64 MiB a connection.
    """
    from lpdec.elastic import peers  # (imported before the first measurement)

    del peers
    rng = np.random.default_rng(7)
    vectors = {m: rng.normal(size=VALUES) for m in MEMBERS}
    expected = np.mean([vectors[m] for m in MEMBERS], axis=0)
    tracemalloc.start()
    try:
        # Without an attack.
        tracemalloc.reset_peak()
        peak = _Peak()
        machines = _machines()
        try:
            end = time.monotonic() + ATTACK_S + 1  # as long as the attack, about
            alone = _rounds(machines, vectors, 0, lambda: time.monotonic() < end)
        finally:
            for peer in machines.values():
                peer.close()
        peak.stop()
        calm = (peak.rss, tracemalloc.get_traced_memory()[1], peak.threads)

        # Under attack (fresh machines: their connections are made during the flood).
        tracemalloc.reset_peak()
        peak = _Peak()
        machines = _machines()
        plan = {
            "addresses": [machines[m].address for m in MEMBERS],
            "hostile": _hostile(machines),
            "seed": 11,
            "attack_s": ATTACK_S,
            "header_s": HEADER_S,
            "margin_s": MARGIN_S,
            "flood": FLOOD,
            "slow": SLOW,
            "junk": JUNK,
            "out": str(tmp_path / "report.json"),
        }
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        attacker = subprocess.Popen(
            [sys.executable, __file__, str(tmp_path / "plan.json")],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            assert attacker.stdout is not None
            assert attacker.stdout.readline().strip() == "ready"
            attacked = _rounds(machines, vectors, 100, lambda: attacker.poll() is None)
            attacker.wait(timeout=60)
            held = [machines[m].inbox() for m in MEMBERS]
            counted = {m: (machines[m].rejected, machines[m].evicted) for m in MEMBERS}
        finally:
            attacker.kill()
            for peer in machines.values():
                peer.close()
        peak.stop()
        hit = (peak.rss, tracemalloc.get_traced_memory()[1], peak.threads)
    finally:
        tracemalloc.stop()
    report = json.loads((tmp_path / "report.json").read_text())
    longest = max(report["open_after_s"], default=0)
    print(f"calm (rss, traced, threads): {calm}, attacked: {hit}; (rejected, evicted): {counted}")
    print(f"rounds alone, under attack: {alone[1]}, {attacked[1]}; longest open: {longest:.2f} s")
    print("attack:", {k: v for k, v in report.items() if k != "open_after_s"})

    # Every round, every member, with the attack or without: the same bytes, the mean.
    assert alone[2] == attacked[2] == 0 and attacked[0] == alone[0]
    np.testing.assert_allclose(np.frombuffer(alone[0], np.float64), expected, rtol=1e-12)
    assert report["connections"] > FLOOD + 3 * SLOW
    assert report["acked"] == 0
    assert report["left_open"] == 0
    assert longest <= HEADER_S + MARGIN_S
    assert held == [(0, 0)] * 3
    assert hit[1] - calm[1] <= 4 << 20
    assert hit[2] - calm[2] <= 3 * 2 * 32
    assert hit[0] - calm[0] <= 96 << 20


if __name__ == "__main__":
    _attack(sys.argv[1])
