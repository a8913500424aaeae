"""The fault-injection bench in small (issue 14, point 13): one try of its quick faults,
so the runner cannot rot. The full table comes from `python -m bench.faults`."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import faults  # noqa: E402


def test_the_quick_faults_lose_nothing(tmp_path):
    output = tmp_path / "faults.md"
    status = faults.main(["--quick", "--seed", "1", "--timeout", "600", "--output", str(output)])
    text = output.read_text()
    print(text)
    assert status == 0
    for name in faults.QUICK:
        what = faults.FAULTS[name][0]
        assert f"| {what} | 1 | 1 | nothing |" in text, name
