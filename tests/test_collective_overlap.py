"""bench/collective_overlap.py: the minimal 2-process program at tiny size, and its formula."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import collective_overlap  # noqa: E402


@pytest.mark.parametrize(
    "comp, comm, both, expected",
    [
        (4.0, 1.0, 4.0, 1.0),  # the all-reduce free beside the compute
        (4.0, 1.0, 5.0, 0.0),  # one after the other
        (4.0, 2.0, 5.0, 0.5),  # half of it hidden
        (4.0, 1.0, 6.0, -1.0),  # slower together than apart
    ],
)
def test_hidden_is_the_share_of_the_all_reduce_that_the_compute_covered(comp, comm, both, expected):
    assert collective_overlap.hidden(comp, comm, both) == pytest.approx(expected)
    with pytest.raises(ValueError, match="nothing to hide"):
        collective_overlap.hidden(comp, 0.0, both)


def test_a_tiny_run_sums_across_the_processes_and_prints_every_row(tmp_path):
    """Each worker checks that the all-reduce summed both processes' values (1 + 2) and
    fails otherwise; the table has a row for each of jax's thread settings."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.collective_overlap", "--no-write", "--n", "16",
         "--elements", "1000", "--repeats", "2", "--warmup", "1", "--no-torch",
         f"--workdir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| jax |")]
    assert [r.split("|")[2].strip() for r in rows] == list(collective_overlap.JAX_SETTINGS)
    assert "4 KB" in result.stdout  # 1,000 float32
