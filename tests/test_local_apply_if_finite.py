"""lpdec.algorithms.local_apply_if_finite (the guard lpdec.chain puts around the local
optimizer) against a clean run, optax's unguarded chain and plain optax: one NaN gradient on
one node costs that node one step, not the rest of the run (issue 14, points 8 and 9)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpdec
from lpdec import testing as harness

N, D, STEPS, BAD_NODE, BAD_STEP = 8, 16, 120, 2, 5


def _problem(rng):
    """f_i(x) = |x - b_i|^2 / 2; node BAD_NODE's gradient is NaN at step BAD_STEP only."""
    b = rng.uniform(-1, 1, (N, D)).astype(np.float32)

    def grads(nan):
        def grad_fn(params, node, step):
            g = params["w"] - jnp.asarray(b)[node]
            poisoned = nan & (node == BAD_NODE) & (step == BAD_STEP)
            return {"w": jnp.where(poisoned, jnp.nan, g)}

        return grad_fn

    return b, grads


def _local():
    return optax.sgd(0.05, momentum=0.9)


def _choco():
    return lpdec.choco(lpdec.ring(N), lpdec.minmax(8), gamma=0.5)


@pytest.mark.parametrize("mode", ["vmap", "shard_map"])
def test_one_nan_step_costs_one_step_not_the_run(rng, mode):
    b, grads = _problem(rng)
    x0 = {"w": np.zeros((N, D), np.float32)}
    optimum = b.mean(axis=0)

    def final(tx, nan):
        params, states, _ = harness.run(tx, x0, STEPS, grad_fn=grads(nan), mode=mode)
        return np.asarray(params["w"][:, -1]), states

    clean, _ = final(lpdec.chain(_local(), _choco()), nan=False)
    guarded, states = final(lpdec.chain(_local(), _choco()), nan=True)
    unguarded, _ = final(optax.chain(_local(), _choco()), nan=True)
    off = lambda x: float(np.abs(x.mean(axis=0) - optimum).max())  # noqa: E731
    apart = lambda x: float(np.abs(x - clean).max())  # noqa: E731
    print(
        f"average off the optimum: clean {off(clean):.2e}, guarded {off(guarded):.2e}, "
        f"unguarded {off(unguarded):.2e}; from the clean run: guarded {apart(guarded):.2e}, "
        f"unguarded {apart(unguarded):.2e}"
    )
    # The nodes' average reaches the optimum of the average; one skipped step is forgotten.
    assert off(clean) < 0.02
    assert apart(guarded) < 2e-3, apart(guarded)
    # Without the guard the momentum holds the NaN: that node's every later update is
    # dropped, it only gossips, and the whole run drifts from the clean one.
    assert apart(unguarded) > 10 * apart(guarded) and apart(unguarded) > 0.05
    # The guard counted exactly one skipped step, on the bad node only.
    skipped = np.asarray(states[0].health.nonfinite_updates[:, -1])
    np.testing.assert_array_equal(skipped, np.eye(N, dtype=np.int32)[BAD_NODE])


def test_the_state_of_the_last_good_step_is_kept():
    tx = lpdec.local_apply_if_finite(optax.sgd(0.1, momentum=0.9))
    ref = optax.sgd(0.1, momentum=0.9)
    params = {"w": jnp.arange(4.0)}
    g1 = {"w": jnp.array([1.0, -2.0, 0.5, 3.0])}
    bad = {"w": jnp.array([1.0, jnp.inf, 0.5, 3.0])}
    g2 = {"w": jnp.array([0.25, 0.5, -1.0, 2.0])}
    state, ref_state = tx.init(params), ref.init(params)
    u, state = tx.update(g1, state, params)
    ref_u, ref_state = ref.update(g1, ref_state, params)
    np.testing.assert_array_equal(u["w"], ref_u["w"])
    before = state.inner_state
    u, state = tx.update(bad, state, params)
    np.testing.assert_array_equal(u["w"], np.zeros(4, np.float32))
    for kept, old in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(kept, old)
    assert int(state.health.nonfinite_updates) == 1
    # The next good step continues from the state before the bad one.
    u, state = tx.update(g2, state, params)
    ref_u, ref_state = ref.update(g2, ref_state, params)
    np.testing.assert_array_equal(u["w"], ref_u["w"])


def test_a_finite_input_whose_update_is_not_finite_is_skipped_too():
    # Momentum then a huge scale: a finite gradient of 1e10 becomes 1e40 = Inf in float32.
    inner = optax.chain(optax.trace(0.9), optax.scale(1e30))
    tx = lpdec.local_apply_if_finite(inner)
    params = {"w": jnp.zeros(2)}
    state = tx.init(params)
    u, state = tx.update({"w": jnp.array([1e10, 1.0])}, state, params)
    np.testing.assert_array_equal(u["w"], np.zeros(2, np.float32))
    assert int(state.health.nonfinite_updates) == 1
    # The momentum buffer did not take the step (it is still all zeros).
    np.testing.assert_array_equal(state.inner_state[0].trace["w"], np.zeros(2, np.float32))


def test_train_py_guards_the_local_optimizer():
    """train.py's chain holds the guard around the local optimizer (every position)."""
    import pathlib  # noqa: PLC0415
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    from test_train import tiny_config  # noqa: PLC0415

    import train_lib  # noqa: PLC0415

    for algorithm in ("choco", "compressed_mean", "none"):
        exp = train_lib.build(tiny_config(algorithm=algorithm))
        state = jax.vmap(exp.tx.init, axis_name="nodes")({"w": jnp.zeros((8, 3))})
        found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, lpdec.LocalIfFiniteState))
        assert any(isinstance(x, lpdec.LocalIfFiniteState) for x in found), algorithm
