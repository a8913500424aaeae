"""bfloat16 parameters train like float32 on a float32 master copy (issue 14, point 7)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpdec
from lpdec import testing as harness

N, D = 8, 64

ALGORITHMS = {
    "choco": lambda: lpdec.choco(lpdec.ring(N), lpdec.minmax(8), gamma=0.5),
    "dcd": lambda: lpdec.dcd(lpdec.ring(N), lpdec.minmax(8)),
    "dpsgd": lambda: lpdec.dpsgd(lpdec.ring(N)),
}


def _ulp(x):
    """One bfloat16 unit in the last place at |x| (8 significant bits), elementwise."""
    exponent = np.floor(np.log2(np.maximum(np.abs(x), 1e-30)))
    return 2.0 ** (exponent - 7)


def _zero_grads(params, node, step):
    return {"w": jnp.zeros_like(params["w"])}


def _final(ps):
    return np.asarray(ps["w"][:, -1], np.float64)


def _spread(x):
    return float(np.abs(x - x.mean(axis=0)).max())


def _spread_ulps(x):
    """The nodes' largest distance from their average, in bfloat16 units at that element."""
    mean = x.mean(axis=0)
    return float((np.abs(x - mean) / _ulp(mean)).max())


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_bfloat16_gossip_reaches_consensus(rng, name):
    """Pure gossip from different bfloat16 models: the nodes agree to the last bit."""
    # Models that bfloat16 holds exactly, so both runs start from the same point.
    x0 = np.asarray(jnp.asarray(rng.normal(1.0, 1.0, (N, D)), jnp.bfloat16), np.float32)

    def final(tx, dtype):
        ps, states, _ = harness.run(
            tx, {"w": jnp.asarray(x0, dtype)}, 300, grad_fn=_zero_grads, mode="vmap"
        )
        return _final(ps), states

    f32, _ = final(lpdec.chain(optax.sgd(0.02, momentum=0.9), ALGORITHMS[name]()), jnp.float32)
    bf16, states = final(
        lpdec.chain(optax.sgd(0.02, momentum=0.9), ALGORITHMS[name]()), jnp.bfloat16
    )
    plain, _ = final(optax.chain(optax.sgd(0.02, momentum=0.9), ALGORITHMS[name]()), jnp.bfloat16)
    print(
        f"{name}: spread in bfloat16 units: float32 {_spread_ulps(f32):.2e}, bfloat16 with "
        f"master {_spread_ulps(bf16):.2f}, without {_spread_ulps(plain):.2f}"
    )
    # With no gradient the algorithm sees the same float32 model as the float32 run: the
    # master copies follow it bit for bit ...
    master = np.asarray(states.master["w"][:, -1], np.float64)
    np.testing.assert_array_equal(master, f32)
    # ... and the bfloat16 parameters are them rounded: they agree to within one unit.
    assert np.all(np.abs(bf16 - master) <= _ulp(master))
    assert _spread_ulps(bf16) <= 1
    # Without the master copy the same run stalls units apart.
    assert _spread_ulps(plain) > 1


def test_bfloat16_training_converges_like_float32(rng):
    """Heterogeneous least squares with a decaying step: bfloat16 lands where float32 does."""
    a = rng.uniform(0.5, 2.0, (N, D)).astype(np.float32)
    b = rng.uniform(0.5, 3.0, (N, D)).astype(np.float32)
    optimum = (a * b).sum(axis=0) / a.sum(axis=0)  # of the average of the f_i

    def grad_fn(params, node, step):
        w = params["w"].astype(jnp.float32)
        return {"w": (jnp.asarray(a)[node] * (w - jnp.asarray(b)[node])).astype(params["w"].dtype)}

    schedule = optax.exponential_decay(0.05, transition_steps=100, decay_rate=0.5)

    def final(dtype, chain=lpdec.chain):
        tx = chain(optax.sgd(schedule, momentum=0.9), ALGORITHMS["choco"]())
        ps, _, _ = harness.run(
            tx, {"w": jnp.zeros((N, D), dtype)}, 800, grad_fn=grad_fn, mode="vmap"
        )
        return _final(ps)

    f32, bf16 = final(jnp.float32), final(jnp.bfloat16)
    plain = final(jnp.bfloat16, chain=optax.chain)
    off = lambda x: float(np.abs(x.mean(axis=0) - optimum).max())  # noqa: E731
    ulps_from_f32 = lambda x: float((np.abs(x - f32) / _ulp(f32)).max())  # noqa: E731
    print(
        f"average off the optimum: float32 {off(f32):.2e}, bfloat16 {off(bf16):.2e}, without "
        f"master {off(plain):.2e}; largest node difference from float32: "
        f"{ulps_from_f32(bf16):.2f} bfloat16 units, without master {ulps_from_f32(plain):.2f}"
    )
    assert off(f32) < 2e-2  # it learned: the start is 1.8 away
    # Stated tolerance: every bfloat16 parameter within one bfloat16 unit of the float32
    # run's (the rounding of a float32 model that follows the float32 run's closely).
    assert ulps_from_f32(bf16) <= 1
    assert ulps_from_f32(plain) > 1


def test_float32_parameters_are_passed_through(rng):
    """With float32 parameters master_weights is the wrapped transform, state and updates."""
    inner = optax.sgd(0.1, momentum=0.9)
    tx = lpdec.master_weights(inner)
    params = {"w": jnp.asarray(rng.normal(size=5), jnp.float32)}
    grads = {"w": jnp.asarray(rng.normal(size=5), jnp.float32)}
    state, ref_state = tx.init(params), inner.init(params)
    assert jax.tree.structure(state) == jax.tree.structure(ref_state)
    u, _ = tx.update(grads, state, params)
    ref_u, _ = inner.update(grads, ref_state, params)
    np.testing.assert_array_equal(u["w"], ref_u["w"])


def test_the_master_takes_the_float32_step_and_params_follow_it(rng):
    """One sgd step in float64 by hand: master = m - lr g; params = master rounded."""
    w = rng.normal(size=64).astype(np.float32)
    tx = lpdec.master_weights(optax.sgd(1e-3))
    params = {"w": jnp.asarray(w, jnp.bfloat16)}
    state = tx.init(params)
    master = np.asarray(params["w"], np.float64)
    for _ in range(20):
        g = rng.normal(size=64).astype(np.float32)
        u, state = tx.update({"w": jnp.asarray(g, jnp.bfloat16)}, state, params)
        params = optax.apply_updates(params, u)
        master = master - 1e-3 * np.asarray(jnp.asarray(g, jnp.bfloat16), np.float64)
    assert params["w"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(state.master["w"], np.float64), master, atol=1e-6)
    # 20 steps of 1e-3 move w by ~0.1: plain bfloat16 would lose most of them; here the
    # parameters are the master rounded (within one unit).
    got = np.asarray(params["w"], np.float64)
    assert np.all(np.abs(got - master) <= _ulp(master))


def test_integer_parameters_are_refused():
    with pytest.raises(TypeError, match="master_weights"):
        lpdec.master_weights(optax.sgd(0.1)).init({"w": jnp.zeros(3, jnp.int32)})
