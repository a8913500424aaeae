"""Test set-up: 8 simulated CPU devices (nodes), XLA's quick compile,
float32 numerics, per-test random seeds."""

import os

# Must happen before jax initialises its backends (the README's test command sets it too).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

# XLA's backend optimizations (LLVM -O2 and its expensive passes) off for the tests and the
# processes they start: most of a test's time is compiling programs it runs a few steps of,
# and this cuts the suite's CPU time by about 30 % (103 tests of test_algorithms, test_choco
# and test_dcd: 250 -> 174 CPU-seconds on jax 0.10.2). Every bit-for-bit comparison
# compiles both of its sides the same way, and the references are numpy's.
# `JAX_DISABLE_MOST_OPTIMIZATIONS=0 pytest ...` runs them fully optimized, as .ci/run's
# oldest-jax leg does.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# Every program goes into the run's compilation cache (below), not only those that took
# a second to compile (jax's default): most of the suite's programs compile in 0.1 s, and
# many recur across tests, workers and the processes tests start. 800 tests of
# test_compress, test_mx, test_kernels_pallas, test_nn and test_algorithms: 361-363 -> 337
# CPU-seconds (jax 0.12).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import fcntl
import pickle
import shutil
import tempfile
import traceback

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


# The modules whose tests start processes or train for long, slowest first. They run
# first, so that under xdist (-n 2) the short tests fill the end of the run and no
# worker waits alone on a long test there.
SLOW_FIRST = (
    "test_watchdog.py",
    "test_processes.py",
    "test_link.py",
    "test_overlap.py",
    "test_train.py",
    "test_reliability.py",
    "test_faults.py",
    "test_examples.py",
    "test_experiments.py",
    "test_docs.py",
)


def pytest_collection_modifyitems(items):
    """Collection order with SLOW_FIRST's modules in front (each in its own order)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`shared_run(name, make)`: the directory in which `make(directory)` ran, once per
    test run for every test that names the same run, whichever xdist worker asks first
    (the others wait for it); tests read it and copy it before changing anything in it.

    `make` may return a value (e.g. train_and_evaluate's summary): it comes back with the
    directory, as `(directory, value)`. A `make` that raised fails every test naming it.
    """
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker has its own base temp, in a folder that is the run's own.
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    root.mkdir(exist_ok=True)

    def get(name: str, make):
        directory = root / name
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            result, failure = root / f"{name}.pickle", root / f"{name}.failed"
            if not directory.exists():
                directory.mkdir()
                try:
                    value = make(directory)
                except BaseException:
                    failure.write_text(traceback.format_exc())
                    raise
                result.write_bytes(pickle.dumps(value))
        if failure.exists():
            pytest.fail(f"the shared run {name!r} failed:\n{failure.read_text()[-3000:]}")
        return directory, pickle.loads(result.read_bytes())

    return get
