"""The experiments runner's quick mode runs every study end to end (so it cannot rot)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
STUDIES = ("table2", "qgm", "moniqua", "theorem1", "centralized", "tradeoff")


def test_quick_mode_writes_every_study_and_plot(tmp_path):
    output = tmp_path / "EXPERIMENTS.md"
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.experiments",
            "all",
            "--quick",
            f"--output={output}",
            f"--workdir={tmp_path / 'runs'}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = output.read_text()
    for study in STUDIES:
        start, end = f"<!-- study:{study}:start -->", f"<!-- study:{study}:end -->"
        assert start in text and end in text, study
        section = text.split(start)[1].split(end)[0]
        # Every study reports a table of results and states its command and time.
        assert "| --- |" in section.replace("|---|", "| --- |"), study
        assert f"python -m bench.experiments {study} --quick" in section, study
    plots = sorted(os.listdir(tmp_path / "docs"))
    assert plots == sorted(
        [
            "moniqua_bytes.png",
            "table2.png",
            "theorem1.png",
            "tradeoff_bytes.png",
            "tradeoff_wallclock.png",
        ]
    )
    assert all((tmp_path / "docs" / p).stat().st_size > 1000 for p in plots)
