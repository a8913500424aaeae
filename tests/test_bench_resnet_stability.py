"""bench/resnet_stability.py (issue 26's divergence table) at tiny size."""

import jax
import numpy as np

from bench import resnet_stability
from lpdec.nn import norms


def test_a_tiny_run_trains_and_undoes_its_patches():
    mean_range, hard_sigmoid = norms.mean_range, jax.nn.hard_sigmoid
    run = resnet_stability.Run(
        precision="fp32",
        depth=8,
        batch=4,
        steps=2,
        labels="brightness",
        classifier="authors",
        range_stop_gradient=True,
        range_sigmoid=True,
    )
    losses = resnet_stability.train(run)
    assert losses.shape == (2,) and np.isfinite(losses).all()
    assert norms.mean_range is mean_range and jax.nn.hard_sigmoid is hard_sigmoid
    assert resnet_stability.summary(np.array([2.0, np.nan])) == (
        "1: 2 2: nan | max 2, first non-finite at step 2"
    )


def test_the_command_line_builds_the_run(capsys, monkeypatch):
    runs = []
    monkeypatch.setattr(resnet_stability, "train", lambda run: runs.append(run) or np.ones(1))
    resnet_stability.main(["--zero_init_residual=false", "--lr=0.03", "--range_sigmoid"])
    assert runs == [resnet_stability.Run(zero_init_residual=False, lr=0.03, range_sigmoid=True)]
    assert "| int8, range_evonorm, zero_init_residual=False, lr 0.03" in capsys.readouterr().out


def test_init_statistics_row():
    row = resnet_stability.init_statistics("fp32", "range_evonorm", None, depth=8)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["fp32", "range_evonorm", "None"]
    assert float(cells[3]) > 0 and float(cells[4]) > 0 and len(cells[5].split()) == 3
