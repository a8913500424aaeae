"""train_lib.loop.Chunks: a convolutional model on CPU trains one step per program
(XLA:CPU runs convolutions inside the chunk's scan several times slower); it must land
where the one-program chunk lands, and other models keep the one program."""

import csv
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from configs import default  # noqa: E402
from train_lib import loop  # noqa: E402


def _config(model):
    """fp32, an exact mean every step: two ways of running the same steps agree to
    float32 rounding (no stochastic rounding to turn an ulp into another code)."""
    config = default.get_config()
    config.model = model
    if model == "mlp":
        config.dataset = "synthetic"
        config.num_samples = 1200
        config.model_kwargs.hidden_sizes = (32,)
    config.precision = "fp32"
    config.algorithm = "allreduce"
    config.num_steps = 8
    config.log_every = 4
    config.checkpoint_every = 8
    config.save_final_params = True
    return config


def _train(config, workdir, monkeypatch, force=None):
    """Trains `config`; returns (the runs' Chunks, final params, train losses logged)."""
    made = []
    original = loop.Chunks.__init__

    def init(self, *args):
        original(self, *args)
        if force is not None:
            self.step_by_step = force
        made.append(self)

    monkeypatch.setattr(loop.Chunks, "__init__", init)
    loop.train_and_evaluate(config, str(workdir))
    monkeypatch.undo()
    params = dict(np.load(workdir / "final_params.npz"))
    with open(workdir / "metrics.csv") as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f)]
    return made, params, losses


def test_a_convolutional_model_on_cpu_trains_step_by_step_where_one_program_lands(
    tmp_path, monkeypatch
):
    config = _config("cnn1d")
    (chunks,), stepped, stepped_losses = _train(config, tmp_path / "a", monkeypatch)
    assert chunks.step_by_step is True and sorted(chunks.compiled) == [1]
    (chunks,), scanned, scanned_losses = _train(config, tmp_path / "b", monkeypatch, False)
    assert sorted(chunks.compiled) == [4]
    assert len(stepped_losses) == len(scanned_losses) == 2
    np.testing.assert_allclose(stepped_losses, scanned_losses, rtol=1e-5)
    assert sorted(stepped) == sorted(scanned)
    for name in scanned:
        np.testing.assert_allclose(stepped[name], scanned[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("model", ["mlp"])
def test_a_model_without_convolutions_keeps_one_program_per_chunk(tmp_path, monkeypatch, model):
    (chunks,), _, losses = _train(_config(model), tmp_path, monkeypatch)
    assert chunks.step_by_step is False and sorted(chunks.compiled) == [4]
    assert len(losses) == 2
