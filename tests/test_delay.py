"""lpdec.algorithms.delay (stale gradients) under D² and D-PSGD against free-running float64
simulations (tests/_moniqua_reference.py), and on its own."""

import jax.numpy as jnp
import numpy as np
import pytest
from _moniqua_reference import check_free_running_matches_float64_simulation

from lpdec.algorithms import delay


@pytest.mark.parametrize(
    ("kind", "staleness", "mode"),
    [("d2", 2, "vmap"), ("dpsgd", 2, "shard_map")],
)
def test_free_running_matches_float64_simulation(kind, staleness, mode, rng):
    check_free_running_matches_float64_simulation(kind, staleness, mode, rng)


def test_delay_returns_the_update_from_tau_steps_ago():
    tx = delay.delay(3)
    state = tx.init({"w": jnp.zeros(2)})
    for k in range(8):
        out, state = tx.update({"w": jnp.full(2, k + 1.0)}, state)
        np.testing.assert_array_equal(out["w"], np.full(2, k - 2.0 if k >= 3 else 0.0))
    same = delay.delay(0)
    u = {"w": jnp.arange(3.0)}
    out, _ = same.update(u, same.init(u))
    np.testing.assert_array_equal(out["w"], u["w"])


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: delay.delay(-1), ValueError, "steps"),
        (lambda: delay.delay(1.5), TypeError, "steps"),
    ],
)
def test_bad_arguments_raise_clear_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()
