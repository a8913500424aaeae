"""Test set-up: 8 simulated CPU devices (nodes), float32 numerics, per-test random seeds."""

import os

# Must happen before jax initialises its backends (the README's test command sets it too).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import shutil
import tempfile

import numpy as np
import pytest

_JAX_CACHE = pytest.StashKey[str]()


def pytest_configure(config):
    """One JAX compilation cache for the whole run, shared by the xdist workers and the
    train.py processes tests start, so a program they share compiles once (a quarter
    off tests/test_reliability.py on jax 0.12). It is new for each run and removed at the
    end; a cache the user named (JAX_COMPILATION_CACHE_DIR) is used and left alone."""
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = tempfile.mkdtemp(prefix="lpdec-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    config.stash[_JAX_CACHE] = path


def pytest_unconfigure(config):
    path = config.stash.get(_JAX_CACHE, None)
    if path:
        del os.environ["JAX_COMPILATION_CACHE_DIR"]
        shutil.rmtree(path, ignore_errors=True)


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
