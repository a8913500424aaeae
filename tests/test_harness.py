"""bench.harness: the process groups, ports and timers that benchmarks and tests share."""

import os
import socket
import time

from bench import harness


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but for its parent's wait: read its state.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_kill_group_ends_the_child_and_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild"
    proc = harness.start(
        ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], str(tmp_path / "log")
    )
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    grandchild = int(pid_file.read_text())
    harness.kill_group(proc)
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(grandchild)


def test_wait_all_stops_at_a_failure_or_the_timeout_and_kills_the_rest(tmp_path):
    log = str(tmp_path / "log")
    sleeper = harness.start(["sleep", "60"], log)
    failing = harness.start(["sh", "-c", "exit 3"], log)
    started = time.monotonic()
    assert harness.wait_all([sleeper, failing], timeout=30)
    assert time.monotonic() - started < 20
    assert failing.returncode == 3 and sleeper.returncode is not None
    hung = harness.start(["sleep", "60"], log)
    assert not harness.wait_all([hung], timeout=0.5)
    assert hung.returncode is not None


def test_free_port_can_be_bound_and_the_commit_is_named():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", harness.free_port()))
    assert harness.commit() != ""


def test_median_seconds_is_the_median_of_the_samples():
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.05 if len(calls) % 2 else 0.0)
        return 0

    # Warm-up (slept), then 3 samples of 2 calls each: one slept, one not.
    seconds = harness.median_seconds(fn, repeats=3, inner=2)
    assert len(calls) == 7
    assert 0.02 < seconds < 0.05
