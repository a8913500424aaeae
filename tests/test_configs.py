"""Every file in configs/ sets only fields that configs/default.py defines, with valid values."""

import importlib
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from configs import default  # noqa: E402
from train_lib import setup  # noqa: E402

NAMES = sorted(p.stem for p in (ROOT / "configs").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", NAMES)
def test_config_fields_are_the_defaults_and_pass_the_checks(name):
    config = importlib.import_module(f"configs.{name}").get_config()
    # A misspelt field would be a new key that train.py never reads.
    assert set(config.keys()) == set(default.get_config().keys()), name
    if config.dataset == "cifar10":
        pytest.skip("needs the user's CIFAR-10 files (config.data_dir)")
    setup.check_values(config)
