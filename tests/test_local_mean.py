"""lpdec.algorithms.local_mean against the exact float64 mean of the nodes' finite updates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _mean_harness import AXIS
from _mean_harness import N
from _mean_harness import _gradients
from _mean_harness import _run_mean

from lpdec.algorithms.local_mean import local_mean


def test_local_mean_averages_finite_updates(rng):
    bad = 2
    grads = _gradients(rng)
    means, state = _run_mean(local_mean(axis_name=AXIS), grads, mode="vmap")
    for name, g in grads.items():
        tol = 1e-2 if name == "d" else 1e-6
        exact = np.asarray(g, np.float64).mean(axis=0)
        np.testing.assert_allclose(
            np.asarray(means[name][:, 0], np.float64),
            np.broadcast_to(exact, (N,) + exact.shape),
            atol=tol,
        )
    grads["c"][bad, 0] = np.inf
    means, state = _run_mean(local_mean(axis_name=AXIS), grads, mode="shard_map")
    exact = np.delete(np.asarray(grads["a"], np.float64), bad, axis=0).mean(axis=0)
    np.testing.assert_allclose(
        np.asarray(means["a"])[:, 0], np.broadcast_to(exact, (N, 1000)), atol=1e-6
    )
    np.testing.assert_array_equal(state.health.nonfinite_updates, np.eye(N, dtype=int)[bad])
    np.testing.assert_array_equal(state.health.nonfinite_received, 1 - np.eye(N, dtype=int)[bad])


def test_local_mean_bad_inputs_raise_clear_errors():
    params = {"v": jnp.ones((N, 4))}
    for bad in (("nodes", "nodes"), (), ("nodes", 1), ["nodes"], 3):
        with pytest.raises(TypeError, match="local_mean: axis_name must be an axis name"):
            local_mean(axis_name=bad)
    lm = local_mean(axis_name="local")
    with pytest.raises(ValueError, match="not bound here"):
        jax.vmap(lambda g: lm.update(g, lm.init(g)), axis_name=AXIS)(params)
