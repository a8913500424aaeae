"""Where the test suite's CPU goes: a pytest plugin, and a report of what it recorded.

CI's time on 2 cores is the suite's CPU time over 2 (the workers keep both cores busy),
and a test's duration says little about its CPU: a test that waits on a heartbeat takes
seconds and no CPU, one that starts three training processes takes a core of them each.
This plugin records, per test, the CPU seconds of the pytest process (an xdist worker)
and of the child processes it reaped during the test (train.py runs, bench scripts):

    PYTHONPATH=tests/tools LPDEC_CPU_PER_TEST=/tmp/cpu \\
        python -m pytest -p cpu_profile -n 2 tests
    python tests/tools/cpu_profile.py /tmp/cpu

The first writes one JSON file per worker into the folder; the second prints the CPU
seconds by test file and by test function (all its parametrized cases together), the
largest first. A child process still running when its test ends (a shared run that
outlives it) is counted in the test that reaps it.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import sys
import time

import pytest

_FOLDER = "LPDEC_CPU_PER_TEST"
_records: dict[str, dict[str, float]] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Times the test's setup, call and teardown."""
    del nextitem
    before, start = os.times(), time.monotonic()
    yield
    after, end = os.times(), time.monotonic()
    _records[item.nodeid] = {
        "cpu": after.user - before.user + after.system - before.system,
        "children_cpu": (after.children_user - before.children_user)
        + (after.children_system - before.children_system),
        "wall": end - start,
    }


def pytest_sessionfinish(session):
    """Writes this process's records (each xdist worker its own file)."""
    del session
    folder = os.environ.get(_FOLDER)
    if not folder or not _records:
        return
    path = pathlib.Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (path / f"cpu-{worker}.json").write_text(json.dumps(_records, indent=0))


def report(folder: str, top: int = 40) -> str:
    """The recorded CPU seconds by file and by test function, largest first."""
    records = {}
    for path in sorted(pathlib.Path(folder).glob("cpu-*.json")):
        records.update(json.loads(path.read_text()))
    if not records:
        raise SystemExit(f"error: no cpu-*.json in {folder} (run pytest with -p cpu_profile)")
    totals = {name: r["cpu"] + r["children_cpu"] for name, r in records.items()}
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    by_function: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for name, total in totals.items():
        for table, key in ((by_file, name.split("::")[0]), (by_function, name.split("[")[0])):
            table[key][0] += total
            table[key][1] += records[name]["wall"]
            table[key][2] += 1
    lines = [
        f"{len(records)} tests: {sum(totals.values()):.0f} CPU-s "
        f"({sum(r['children_cpu'] for r in records.values()):.0f} in child processes), "
        f"{sum(r['wall'] for r in records.values()):.0f} s of worker time"
    ]
    for title, table in (("file", by_file), ("test function", by_function)):
        lines += ["", f"{'CPU-s':>8} {'wall s':>8} {'tests':>6}  {title}"]
        ranked = sorted(table.items(), key=lambda item: -item[1][0])[:top]
        lines += [f"{c:8.1f} {w:8.1f} {n:6d}  {key}" for key, (c, w, n) in ranked]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/tools/cpu_profile.py FOLDER")
    print(report(sys.argv[1]))
