"""The fault-injection bench in small (issue 14, point 13): one try of its quick faults,
so the runner cannot rot. The full table comes from `python -m bench.faults`."""

import pathlib
import sys

from test_train import PROCESS_FLAGS
from test_train import straight_process_run

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import faults  # noqa: E402


def test_the_quick_faults_lose_nothing(tmp_path, shared_run, monkeypatch):
    # The uninterrupted run the faults are measured against is tests/test_train.py's
    # (the same train.py command), trained once for both.
    assert sorted(faults.TRAIN_FLAGS[1:]) == sorted(PROCESS_FLAGS)
    straight = straight_process_run(shared_run)
    monkeypatch.setattr(faults.Context, "straight", lambda self: straight)
    output = tmp_path / "faults.md"
    status = faults.main(["--quick", "--seed", "1", "--timeout", "600", "--output", str(output)])
    text = output.read_text()
    print(text)
    assert status == 0
    for name in faults.QUICK:
        what = faults.FAULTS[name][0]
        assert f"| {what} | 1 | 1 | nothing |" in text, name
