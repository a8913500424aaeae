"""bench/gpu_kernels.py (issue 26's GPU measurement) runs end to end; on CPU, tiny sizes."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_mode_measures_every_candidate_and_writes_its_table(tmp_path):
    out = tmp_path / "gpu_kernels.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_kernels.py", "--quick", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    fields = {"copy_s", "minmax8_s", "minmax4_s", "feedback8_s", "feedback8_unfused_s", "mxfp4_s"}
    fields |= {"copy_loop_s", "minmax8_loop_s", "minmax4_loop_s"}
    assert results["arrays"] and all(fields <= set(r) for r in results["arrays"])
    assert all(r["minmax8_s"] > 0 for r in results["arrays"])
    tree = results["trees"][0]
    assert tree["leaves"] > 10 and tree["minmax4_s"] > 0
    assert tree["packed8_s"] > 0 and tree["packed4_s"] > 0
    assert tree["packed8_exact"] is True and tree["packed4_exact"] is True
    assert "| 8-bit packed tree | 4-bit packed tree |" in proc.stdout
    assert "| elements | looped copy GB/s | 8-bit | 4-bit |" in proc.stdout
    assert "| 4,096 |" in proc.stdout and "| d=32, 2 blocks |" in proc.stdout
