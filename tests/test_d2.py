"""lpdec.algorithms.d2 (D²) against numpy references of seed 003 with an explicit W
(tests/_moniqua_reference.py) and a free-running float64 simulation; its eigenvalue condition
and its exact convergence under heterogeneous data."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _moniqua_reference import CASES
from _moniqua_reference import LAZY_RING
from _moniqua_reference import RING
from _moniqua_reference import N
from _moniqua_reference import _quadratics
from _moniqua_reference import check_each_step_matches_dense_reference
from _moniqua_reference import check_free_running_matches_float64_simulation

from lpdec import testing as harness
from lpdec import topology
from lpdec.algorithms import d2
from lpdec.algorithms import dpsgd
from lpdec.compress import modulo


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].kind == "d2"])
def test_each_step_matches_dense_reference(name, mode, rng):
    check_each_step_matches_dense_reference(name, mode, rng)


@pytest.mark.parametrize(
    ("kind", "staleness", "mode"),
    [("d2", 0, "shard_map")],
)
def test_free_running_matches_float64_simulation(kind, staleness, mode, rng):
    check_free_running_matches_float64_simulation(kind, staleness, mode, rng)


def test_d2_rejects_lambda_min_at_minus_one_third():
    with pytest.raises(ValueError, match=r"ring\(8\).*-0\.333333.*with_slack\(0\.5\)"):
        d2.d2(RING)
    assert np.isclose(np.linalg.eigvalsh(RING.mixing_matrix()).min(), -1 / 3)
    d2.d2(LAZY_RING)


def test_d2_reaches_the_exact_optimum_where_dpsgd_is_biased():
    a, b, grad_fn, optimum = _quadratics(np.random.default_rng(3), 10)
    params = {"w": jnp.zeros((N, 10), jnp.float32)}

    def final_error(alg, lr, steps=300):
        tx = optax.chain(optax.sgd(lr), alg)
        ps, _, _ = harness.run(tx, params, steps, grad_fn=grad_fn, mode="vmap")
        return np.abs(np.asarray(ps["w"][:, -1], np.float64) - optimum).max()

    # 2000 steps: mixing computed as sum_j W_ij x_j in float32 would have drifted
    # by ~2e-4 by then (D²'s node average integrates any rounding bias twice).
    assert final_error(d2.d2(LAZY_RING), 0.1, steps=2000) < 1e-5
    # Moniqua on D²: down to the 8-bit quantization error instead.
    comp = modulo(8, 0.5)
    assert final_error(d2.d2(LAZY_RING, comp), 0.1) < 4 * comp.delta * comp.modulus()
    # D-PSGD's fixed point is off by O(step size): halving the step roughly halves it.
    bias = final_error(dpsgd.dpsgd(LAZY_RING), 0.1)
    half_bias = final_error(dpsgd.dpsgd(LAZY_RING), 0.05)
    assert bias > 0.1
    assert 1.3 < bias / half_bias < 2.1


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: d2.d2(topology.directed_ring(N)), ValueError, "symmetric"),
        (lambda: d2.d2(topology.random_matching(N, seed=0)), ValueError, "static"),
        (lambda: d2.d2(LAZY_RING, "modulo"), TypeError, "compressor"),
    ],
)
def test_bad_arguments_raise_clear_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize(
    "tx",
    [
        d2.d2(LAZY_RING),
    ],
)
def test_missing_params_raise(tx):
    params = {"w": jnp.zeros((N, 3))}
    with pytest.raises(ValueError, match="parameters"):
        jax.vmap(lambda p: tx.update(p, tx.init(p)), axis_name="nodes")(params)
