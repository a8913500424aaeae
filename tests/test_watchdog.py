"""A run that cannot end by itself still ends, soon and in order (issue 14, point 6):
a process of a multi-process run is killed, or a run gets SIGTERM, even while it
waits in a collective that will never return (train_lib/watchdog.py)."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from test_processes import TRAIN
from test_processes import TWO
from test_train import TINY_FLAGS
from test_train import _env

from bench.harness import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402

# Long enough never to end by itself; a checkpoint every log interval, so the first
# save (and its compile) is behind a run by the time a test interrupts it. What is
# trained is not what these tests check: fp32 D-PSGD compiles in about half the time
# of TINY_FLAGS' int8 CHOCO (each process of a test compiles it; in a run of several
# processes, only process 0 finds it in the compilation cache), and it still gossips
# across the processes every step. A constant learning rate makes the programs
# independent of num_steps, so a resumed run with another num_steps finds them cached.
ENDLESS = TINY_FLAGS + [
    "--config.precision=fp32",
    "--config.algorithm=dpsgd",
    "--config.lr_schedule=constant",
    "--config.num_steps=100000",
    "--config.checkpoint_every=10",
]
STARTUP_S = 300  # generous: the test machine may be busy


@pytest.fixture
def launch(tmp_path):
    """Starts train.py processes (stdout/stderr to files); kills any left at the end."""
    started = []

    def start(flags, devices, name):
        out = open(tmp_path / f"{name}.log", "w")
        proc = subprocess.Popen(
            TRAIN + flags, env=_env(devices), stdout=out, stderr=subprocess.STDOUT, cwd=ROOT
        )
        out.close()
        proc.log = tmp_path / f"{name}.log"
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start_two(launch, workdir, extra=()):
    address = f"127.0.0.1:{free_port()}"
    flags = [f"--workdir={workdir}", f"--coordinator_address={address}", *ENDLESS, *extra]
    return [launch(flags + TWO[i], 4, f"process{i}") for i in range(2)]


def _wait_for_steps(workdir, procs, rows=2):
    """Waits until process 0 has logged `rows` metric rows (every process took those steps)."""
    deadline = time.monotonic() + STARTUP_S
    path = workdir / "metrics.csv"
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().strip().splitlines()) > rows:
            return
        for proc in procs:
            assert proc.poll() is None, proc.log.read_text()[-3000:]
        time.sleep(0.2)
    pytest.fail(f"no {rows} metric rows within {STARTUP_S} s")


def _wait(proc, within):
    """(exit status, seconds taken), or a failure if `proc` is still running after `within`."""
    started = time.monotonic()
    try:
        proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {within} s later:\n{proc.log.read_text()[-3000:]}")
    return proc.returncode, time.monotonic() - started


def _last_line(proc):
    return proc.log.read_text().strip().splitlines()[-1]


def _checkpoint_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def test_a_killed_process_ends_its_peers_within_30_s_naming_it(tmp_path, launch):
    workdir = tmp_path / "w"
    procs = _start_two(launch, workdir)
    _wait_for_steps(workdir, procs)
    procs[1].kill()  # kill -9: no goodbye
    status, seconds = _wait(procs[0], within=30)
    assert status == train.EXIT_PEER_LOST, procs[0].log.read_text()[-3000:]
    assert "error: process 1 of 2 was lost (its connection closed" in _last_line(procs[0])
    assert seconds < 30


def test_sigterm_stops_a_run_at_a_step_boundary_and_the_run_resumes(tmp_path, launch):
    workdir = tmp_path / "w"
    flags = [f"--workdir={workdir}", *ENDLESS]
    proc = launch(flags, 8, "run")
    _wait_for_steps(workdir, [proc])
    proc.send_signal(signal.SIGTERM)
    status, _ = _wait(proc, within=60)
    assert status == 128 + signal.SIGTERM, proc.log.read_text()[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["interrupted"] == "SIGTERM" and not summary["diverged"]
    assert summary["stopped"].startswith(f"interrupted: SIGTERM to process 0 at step {stopped_at}")
    assert _checkpoint_steps(workdir)[-1] == stopped_at  # the step it stopped at is saved
    assert not [p for p in (workdir / "checkpoints").iterdir() if "tmp" in p.name]

    # Its programs are the interrupted run's (ENDLESS's constant schedule): cached.
    resumed = launch([*flags, f"--config.num_steps={stopped_at + 10}"], 8, "resumed")
    status, _ = _wait(resumed, within=STARTUP_S)
    assert status == 0, resumed.log.read_text()[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped_at and summary["steps"] == stopped_at + 10
    assert summary["interrupted"] is None


def test_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path, launch):
    workdir = tmp_path / "w"
    procs = _start_two(launch, workdir)
    _wait_for_steps(workdir, procs)
    procs[1].send_signal(signal.SIGTERM)
    statuses = [_wait(proc, within=60)[0] for proc in procs]
    assert statuses == [128 + signal.SIGTERM] * 2, [p.log.read_text()[-2000:] for p in procs]
    summary = json.loads((workdir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["stopped"].startswith(f"interrupted: SIGTERM to process 1 at step {stopped_at}")
    assert _checkpoint_steps(workdir)[-1] == stopped_at
    for proc in procs:
        assert f"SIGTERM to process 1 at step {stopped_at}" in _last_line(proc)


def test_sigterm_ends_a_run_stuck_in_a_collective_after_the_stop_timeout(tmp_path, launch):
    """Process 1 is frozen (SIGSTOP: alive, connected, silent), so process 0 waits in its
    next collective for ever; SIGTERM must still end it, after --stop_timeout."""
    workdir = tmp_path / "w"
    procs = _start_two(launch, workdir, ["--stop_timeout=3"])
    _wait_for_steps(workdir, procs)
    os.kill(procs[1].pid, signal.SIGSTOP)
    time.sleep(2)  # process 0 reaches the collective that process 1 will not join
    procs[0].send_signal(signal.SIGTERM)
    status, seconds = _wait(procs[0], within=20)
    assert status == 128 + signal.SIGTERM, procs[0].log.read_text()[-3000:]
    assert "still running 3 s after SIGTERM" in _last_line(procs[0])
    assert seconds < 20


def test_a_frozen_process_is_lost_after_the_heartbeat_timeout(tmp_path, launch):
    """SIGSTOP keeps process 1's connections open but silences it, as a machine that
    drops off the network would."""
    workdir = tmp_path / "w"
    procs = _start_two(launch, workdir, ["--heartbeat_timeout=8"])
    _wait_for_steps(workdir, procs)
    os.kill(procs[1].pid, signal.SIGSTOP)
    status, seconds = _wait(procs[0], within=30)
    assert status == train.EXIT_PEER_LOST, procs[0].log.read_text()[-3000:]
    assert "error: process 1 of 2 was lost (no heartbeat for 8 s)" in _last_line(procs[0])
    assert seconds > 5  # 8 s from its last heartbeat, sent up to a second before the stop
