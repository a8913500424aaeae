"""Test set-up: 8 simulated CPU devices (nodes), float32 numerics, per-test random seeds."""

import os

# Must happen before jax initialises its backends (the README's test command sets it too).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh numpy Generator per test; its seed is printed when the test fails.

    `LPDEC_TEST_SEED=<seed> pytest ...` replays a failure: every test that uses
    this fixture then draws from that seed.
    """
    override = os.environ.get("LPDEC_TEST_SEED")
    seed = int(override) if override else int.from_bytes(os.urandom(4), "little")
    request.node.user_properties.append(("seed", seed))
    print(f"random seed: {seed}")
    return np.random.default_rng(seed)
