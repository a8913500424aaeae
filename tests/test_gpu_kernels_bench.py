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
    assert tree["packed8_diff_s"] > 0 and tree["per_leaf8_diff_s"] > 0
    assert tree["packed8_exact"] is True and tree["packed4_exact"] is True
    assert "| 8-bit packed tree | 4-bit packed tree |" in proc.stdout
    assert "| elements | looped copy GB/s | 8-bit | 4-bit |" in proc.stdout
    assert "| 4,096 |" in proc.stdout and "| d=32, 2 blocks |" in proc.stdout


def test_quick_tune_times_every_kernel_block_size_and_warp_count(tmp_path):
    """`--parts tune`: each flat GPU kernel at each grid step size (interpreted here)."""
    out = tmp_path / "tune.json"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_kernels.py", "--quick", "--parts", "tune", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads(out.read_text())["tune"]
    assert not [k for k in row if k.endswith("|error")], row
    # 8-bit and EF at chunk 2048, 4-bit packed at 4096; 1 and 2 chunks per step; 4 warps.
    want = {f"{k}|{s}|4" for k in ("8-bit", "8-bit EF") for s in (2048, 4096)}
    want |= {f"4-bit packed|{s}|4" for s in (4096, 8192)}
    assert want <= set(row) and all(row[k] > 0 for k in want)
    assert "| 10,037 | 4-bit packed | 8192 |" in proc.stdout

    # --merge: the section from several runs' JSON (one per part, as the GPU session
    # script writes them), measuring nothing; each part from the last file that has it.
    other = tmp_path / "arrays.json"
    other.write_text(
        json.dumps(
            {
                "device": "a merged device",
                "versions": "jax from the JSON",
                "arrays": [{"elements": 4096, "copy_s": 1e-6, "minmax8_s": 1.25e-6}],
                "tune": [],
            }
        )
    )
    merged = subprocess.run(
        [sys.executable, "bench/gpu_kernels.py", "--merge", str(out), str(other)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert merged.returncode == 0, merged.stderr[-3000:]
    assert "Device: a merged device; jax from the JSON." in merged.stdout
    assert "| 4,096 | 33 | 50% |" in merged.stdout  # 5 B in 1.25 µs against 8 B in 1 µs
    assert "| 10,037 | 4-bit packed | 8192 |" in merged.stdout  # kept: the second is empty
