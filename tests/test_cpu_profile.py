"""tests/tools/cpu_profile.py: the plugin that says where the suite's CPU goes (os.times
counts CPU in ticks of 10 ms, hence 0.39 for 0.4 s; a difference of two tick counts in
float may land a hair below, hence half a tick of slack)."""

import json
import os
import pathlib
import subprocess
import sys

TOOLS = pathlib.Path(__file__).resolve().parent / "tools"

SAMPLE = """
import subprocess, sys, time

def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass

def test_waits():
    time.sleep(0.4)

def test_burns():
    burn(0.4)

def test_starts_a_process_that_burns():
    code = "import time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass"
    subprocess.run([sys.executable, "-c", code], check=True)
"""


def test_records_each_tests_own_and_its_processes_cpu(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    out = tmp_path / "cpu"
    env = dict(os.environ, PYTHONPATH=str(TOOLS), LPDEC_CPU_PER_TEST=str(out))
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "cpu_profile", "-p", "no:cacheprovider",
         "-p", "no:xdist", "test_sample.py"],
        cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    (path,) = out.glob("cpu-*.json")
    records = {name.split("::")[1]: r for name, r in json.loads(path.read_text()).items()}
    waits, burns, child = (
        records[n] for n in ("test_waits", "test_burns", "test_starts_a_process_that_burns")
    )
    assert waits["wall"] >= 0.4 and waits["cpu"] + waits["children_cpu"] < 0.2, waits
    assert burns["cpu"] >= 0.385 and burns["children_cpu"] < 0.1, burns
    assert child["children_cpu"] >= 0.385, child
    report = subprocess.run(
        [sys.executable, str(TOOLS / "cpu_profile.py"), str(out)],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert report.startswith("3 tests: ")
    assert "test_sample.py::test_starts_a_process_that_burns" in report
