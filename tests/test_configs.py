"""Every file in configs/ sets only fields that configs/default.py defines, with valid values."""

import collections
import importlib
import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from configs import default  # noqa: E402
from configs import lm_tiny  # noqa: E402
from train_lib import setup  # noqa: E402

NAMES = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", NAMES)
def test_config_fields_are_the_defaults_and_pass_the_checks(name, tmp_path):
    config = importlib.import_module(f"configs.{name}").get_config()
    # A misspelt field would be a new key that train.py never reads.
    assert set(config.keys()) == set(default.get_config().keys()), name
    if config.dataset == "cifar10":
        pytest.skip("needs the user's CIFAR-10 files (config.data_dir)")
    if config.dataset == "token_file":
        config.data_dir = str(tmp_path)  # the user's train.bin and val.bin (not read here)
    setup.check_values(config)


def _lm_tiny(run: dict) -> bool:
    """Whether `run` is of the study's own model and budget (lm_tiny's, 2,000 steps; the
    headline's model is lm_small's, the field-budget runs train 600 steps)."""
    from configs import lm_study

    tiny = dict(lm_tiny.get_config().model_kwargs)
    # Records from before model_kwargs named the vocabulary were of bytes (256).
    model = {"vocab_size": 256, **run["config"].get("model_kwargs", {})}
    return model == tiny and run["config"]["num_steps"] == lm_study.get_config().num_steps


def _study_groups() -> dict[str, list[dict]]:
    """docs/experiments.json's language-model runs of lm_tiny's model, one per (method,
    seed), by method."""
    runs = json.loads((ROOT / "docs" / "experiments.json").read_text())["runs"]
    groups: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for run in runs:
        if run["study"] == "lm" and not run["diverged"] and _lm_tiny(run):
            groups[run["method"]][run["seed"]] = run
    return {method: list(by_seed.values()) for method, by_seed in groups.items()}


def test_lm_study_config_is_the_published_studys_best_setting():
    """configs/lm_study.py (the link benchmark's language model) carries the winners of
    the study in docs/experiments.json: the all-reduce's tuned rate, and the fields of
    the 2-machine 4-bit DiLoCo setting with the lowest mean over 3 seeds."""
    from configs import lm_study

    groups = _study_groups()
    config = lm_study.get_config()
    diloco = {
        method: runs
        for method, runs in groups.items()
        if len(runs) >= 3
        and all(r["config"]["algorithm"] == "diloco" for r in runs)
        and all(r["config"].get("machines", 2) == 2 for r in runs)
        and all(r["config"].get("exchange") == "compressed_mean" for r in runs)
        and all(r["config"].get("bits") == 4 for r in runs)
    }
    best = min(diloco, key=lambda m: np.mean([r["final_val_bits_per_byte"] for r in diloco[m]]))
    fields = ("learning_rate", "local_steps", "outer_lr", "outer_momentum",
              "outer_warmup_rounds", "error_feedback", "compressor", "sync_steps")  # fmt: skip
    published = diloco[best][0]["config"]
    for field in fields:
        assert config[field] == published.get(field, default.get_config()[field]), (field, best)
    runs = json.loads((ROOT / "docs" / "experiments.json").read_text())["runs"]
    allreduce = [
        r for r in runs
        if r["study"] == "lm" and r["config"]["algorithm"] == "allreduce"
        and r.get("sweep_winner") and _lm_tiny(r)
    ]  # fmt: skip
    assert [r["config"]["learning_rate"] for r in allreduce] == [lm_study.ALLREDUCE_LEARNING_RATE]
    # The study's recipe is the config's.
    for field in ("text_bytes", "validation_windows", "num_steps", "log_every", "warmup_steps"):
        assert config[field] == published[field], field


def test_lm_scale_config_is_the_published_4_machine_winner():
    """configs/lm_scale.py carries the 'scale' study's best 4-machine DiLoCo over 3 seeds
    in docs/experiments.json, among the runs of lm_tiny's model at the study's tokens
    (its batch swept at equal tokens): its H, outer step, inner optimizer and batch."""
    from configs import lm_scale
    from configs import lm_study

    study = lm_study.get_config()
    tiny = dict(lm_tiny.get_config().model_kwargs)
    runs = json.loads((ROOT / "docs" / "experiments.json").read_text())["runs"]
    groups: dict[str, dict[int, dict]] = collections.defaultdict(dict)
    for run in runs:
        c = run["config"]
        if (
            run["study"] == "scale"
            and c.get("algorithm") == "diloco"
            and c.get("machines") == 4
            and not run["diverged"]
            and {"vocab_size": 256, **c.get("model_kwargs", {})} == tiny
            and c["num_steps"] * c["batch_size"] == study.num_steps * study.batch_size
        ):
            groups[run["method"]][run["seed"]] = run
    tuned = {m: list(s.values()) for m, s in groups.items() if len(s) >= 3}
    if not tuned:
        pytest.skip("the scale study has no 4-machine setting over 3 seeds published yet")
    best = min(tuned, key=lambda m: np.mean([r["final_val_bits_per_byte"] for r in tuned[m]]))
    published = tuned[best][0]["config"]
    config = lm_scale.get_config()
    fields = ("machines", "local_steps", "outer_lr", "outer_momentum", "outer_warmup_rounds",
              "outer_decay_rounds", "optimizer", "learning_rate", "muon_adam_lr", "bits",
              "error_feedback", "shard_model", "muon_beta", "batch_size", "num_steps",
              "warmup_steps", "log_every")  # fmt: skip
    for field in fields:
        assert config[field] == published.get(field, default.get_config()[field]), (field, best)
