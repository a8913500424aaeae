"""bench/overlap.py: the two-process overlap experiment at tiny size, its formula, its clean-up."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import netns  # noqa: E402
from bench import overlap  # noqa: E402

REASON = netns.unavailable()
needs_namespaces = pytest.mark.skipif(
    REASON is not None, reason=f"bench/overlap.py cannot make network namespaces: {REASON}"
)


def _harness(tmp_path, prefix, *flags):
    return [
        sys.executable,
        "-m",
        "bench.overlap",
        f"--prefix={prefix}",
        f"--output={tmp_path / 'BENCHMARKS.md'}",
        f"--results={tmp_path / 'results.json'}",
        *flags,
    ]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.parametrize(
    "t_inner, t_exchange, t_both, expected",
    [
        (1.0, 1.0, 1.0, 1.0),  # the exchange entirely hidden behind equal compute
        (1.0, 1.0, 2.0, 0.0),  # one after the other
        (2.0, 1.0, 2.5, 0.5),  # half of the shorter (the exchange) hidden
        (1.0, 3.0, 3.5, 0.5),  # half of the shorter (inner) hidden
        (1.0, 1.0, 2.5, -0.5),  # slower together than apart
    ],
)
def test_efficiency_is_the_hidden_fraction_of_the_shorter_program(
    t_inner, t_exchange, t_both, expected
):
    assert overlap.efficiency(t_inner, t_exchange, t_both) == pytest.approx(expected)


def test_efficiency_rejects_a_zero_time():
    with pytest.raises(ValueError, match="times must be positive"):
        overlap.efficiency(0.0, 1.0, 1.0)


def test_summaries_take_the_slower_process_of_each_repetition():
    def worker(exchange, inner, both):
        times = {"exchange": exchange, "inner": inner}
        times |= {mode: both for mode in overlap.BOTH}
        first = {mode: [0.1, 0.1, 0.1] for mode in overlap.BOTH}
        at = {"h": 3, "times": times, "first_ready_s": first, "dispatch_s": [0.001]}
        return {"layouts": {"shared": at}, "correct": True, "exchanges_checked": 4}

    # Repetition by repetition, the slower process: exchange [2, 2, 3], inner [2, 1, 3],
    # both [4, 3, 2]; medians 2, 2 and 3: efficiency (2 + 2 - 3) / 2.
    workers = [
        worker([1.0, 2.0, 3.0], [2.0, 1.0, 1.0], [4.0, 1.0, 2.0]),
        worker([2.0, 1.0, 1.0], [1.0, 1.0, 3.0], [1.0, 3.0, 1.0]),
    ]
    summary = overlap.summarize(workers)
    at = summary["layouts"]["shared"]
    assert at["medians"] == {"exchange": 2.0, "inner": 2.0} | {m: 3.0 for m in overlap.BOTH}
    assert at["efficiency"] == {m: 0.5 for m in overlap.BOTH}
    assert summary["correct"] and summary["exchanges_checked"] == 8


def test_expected_sum_adds_every_process_payload():
    # Device d of process p sends (i mod 13) + 16 p + 3 d at element i.
    i = np.arange(50)
    for device in range(3):
        want = 2 * (i % 13) + 16 * (0 + 1) + 2 * 3 * device
        np.testing.assert_array_equal(overlap.expected_sum(2, device, 50), want)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--devices=0"], "--devices=0: expected >= 1"),
        (["--repeats=0"], "--repeats=0: expected >= 1"),
        (["--timeout=0"], "--timeout=0.0: expected a positive"),
        (["--subnet=300"], "--subnet=300: expected 0..255"),
    ],
)
def test_bad_flags_are_one_line_errors_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit):
        overlap.parse_args(flags)
    assert message in capsys.readouterr().err


@needs_namespaces
def test_tiny_run_checks_its_sums_writes_the_section_and_leaves_no_namespace(tmp_path):
    """2 processes x 2 devices, a small vector, the unshaped link only, 2 repetitions."""
    prefix = f"lpdecovtest-{os.getpid()}"
    proc = subprocess.run(
        _harness(
            tmp_path,
            prefix,
            "--rate=unshaped",
            "--devices=2",
            "--repeats=2",
            "--elements=3000",
            "--width=32",
            "--batch=16",
            "--timeout=120",
        ),  # fmt: skip
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    (summary,) = results["summaries"].values()
    assert summary["correct"] is True
    # Each process checks, per repetition, four exchanges (alone, and in the three modes):
    # 2 local blocks each in the shared layout, 1 in the split one.
    assert summary["exchanges_checked"] >= 2 * 2 * 4 * (2 + 1), summary
    assert set(summary["layouts"]) == {"shared", "split"}
    for at in summary["layouts"].values():
        m = at["medians"]
        assert all(t > 0 for t in m.values()), m
        for mode in overlap.BOTH:
            hidden = m["inner"] + m["exchange"] - m[mode]
            assert at["efficiency"][mode] == pytest.approx(hidden / min(m["inner"], m["exchange"]))
    for worker in results["workers"]["unshaped"]:
        assert worker["correct"] is True
        for at in worker["layouts"].values():
            assert all(len(ts) == 2 for ts in at["times"].values()), at["times"]
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "<!-- bench/overlap.py:start -->" in text and "<!-- bench/overlap.py:end -->" in text
    rows = [line for line in text.splitlines() if line.startswith("| unshaped |")]
    assert len(rows) == 6, text  # 2 layouts x 3 modes
    assert all(row.count("|") == 11 and "| yes (" in row for row in rows), rows
    assert netns.namespaces(prefix) == []
    assert not [n for n in os.listdir(netns.ETC_NETNS) if n.startswith(prefix)]


@needs_namespaces
def test_a_signal_mid_run_removes_namespaces_and_workers(tmp_path):
    # SIGINT takes the same path: bench/overlap.py installs netns.install_cleanup, whose
    # one handler for both is checked in tests/test_link.py.
    signum = signal.SIGTERM
    prefix = f"lpdecovtest-{os.getpid()}-{signum}"
    harness = subprocess.Popen(
        _harness(tmp_path, prefix, "--rate=unshaped", "--devices=1", "--timeout=120"),
        env=_env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Wait until both workers run inside their namespaces.
    deadline, pids = time.time() + 60, []
    while time.time() < deadline and len(pids) < 2:
        pids = [
            pid
            for host in (0, 1)
            for pid in subprocess.run(
                ["ip", "netns", "pids", f"{prefix}-h{host}"], capture_output=True, text=True
            ).stdout.split()
        ]
        time.sleep(0.1)
    assert len(pids) == 2, "the workers never started"
    time.sleep(1.0)
    harness.send_signal(signum)
    out, _ = harness.communicate(timeout=60)
    assert harness.returncode == 130, out[-2000:]
    assert "removing namespaces" in out
    assert netns.namespaces(prefix) == []
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), f"worker {pid} outlived the harness"
    assert not (tmp_path / "BENCHMARKS.md").exists()


@needs_namespaces
def test_cleanup_flag_removes_leftovers_with_its_prefix(tmp_path):
    prefix = f"lpdecovtest-{os.getpid()}-left"
    network = netns.Network(2, prefix, 7)
    network.create()
    try:
        assert len(netns.namespaces(prefix)) == 2
        proc = subprocess.run(
            [sys.executable, "-m", "bench.overlap", "--cleanup", f"--prefix={prefix}"],
            env=_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert "removed 2 namespaces" in proc.stdout
        assert netns.namespaces(prefix) == []
    finally:
        network.destroy()
