"""lpdec.algorithms.quant_sgp (Quant-SGP) against float64 numpy push-sum references with an
explicit W (tests/_push_sum_reference.py)."""

import numpy as np
import pytest
from _push_sum_reference import COMPRESSORS
from _push_sum_reference import CONSENSUS_STEPS
from _push_sum_reference import FACTORIES
from _push_sum_reference import PUSH_SUM_GAMMA
from _push_sum_reference import ROW_ONLY
from _push_sum_reference import STEPS
from _push_sum_reference import N
from _push_sum_reference import check_free_running_matches_float64_simulation_without_compression
from _push_sum_reference import check_gamma_outside_unit_interval_raises
from _push_sum_reference import check_non_finite_node_does_not_poison_its_neighbours
from _push_sum_reference import check_non_finite_update_is_dropped_and_counted_on_its_node
from _push_sum_reference import check_not_a_compressor_raises
from _push_sum_reference import check_push_sum_preserves_mass_and_weight_on_a_directed_graph
from _push_sum_reference import check_push_sum_reaches_the_true_average_where_plain_gossip_is_biased
from _push_sum_reference import check_step
from _push_sum_reference import check_topology_size_must_match_the_axis
from _push_sum_reference import check_update_without_params_raises
from _push_sum_reference import flat
from _push_sum_reference import run_directed
from _push_sum_reference import skewed_column

import lpdec
from lpdec import topology
from lpdec.testing import MODES


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compressor_name", COMPRESSORS)
@pytest.mark.parametrize("name", ["quant_sgp"])
def test_each_step_matches_a_float64_reference(name, compressor_name, mode):
    for step in range(STEPS):
        check_step(name, compressor_name, mode, step)


@pytest.mark.parametrize("name", ["quant_sgp"])
def test_free_running_matches_float64_simulation_without_compression(name):
    check_free_running_matches_float64_simulation_without_compression(name)


@pytest.mark.parametrize("name", ["quant_sgp"])
def test_push_sum_preserves_mass_and_weight_on_a_directed_graph(name):
    check_push_sum_preserves_mass_and_weight_on_a_directed_graph(name)


@pytest.mark.parametrize("name", ["quant_sgp"])
def test_push_sum_reaches_the_true_average_where_plain_gossip_is_biased(name):
    check_push_sum_reaches_the_true_average_where_plain_gossip_is_biased(name)


def literal_quant_sgp_paper_form(w, x0, gamma, steps, mass_conserving):
    """Quant-SGP without compression (x^ = x~ after each step) in float64.

    Seed 002's Algorithm 5: x+ = x~ + gamma sum_j (W_ij - I_ij)(x^_j - x^_i); lpdec's form:
    x+ = x~ + gamma sum_j (W_ij - I_ij) x^_j. Returns (sum_i x_i per step, sum_i w_i, z).
    """
    mix = w - np.eye(N)
    row_sums = w.sum(axis=1, keepdims=True)
    x, pw = x0.copy(), np.ones((N, 1))
    masses, weights = [], []
    for _ in range(steps):
        x_hat = x  # zero updates, exact messages: the public copies catch up with x~ = x
        if mass_conserving:
            x = x + gamma * mix @ x_hat
        else:
            # sum_j (W_ij - I_ij)(x^_j - x^_i) = (W x^)_i - x^_i - (r_i - 1) x^_i
            x = x + gamma * (mix @ x_hat - (row_sums - 1.0) * x_hat)
        pw = pw + gamma * mix @ pw
        masses.append(x.sum(axis=0))
        weights.append(pw.sum())
    return np.stack(masses), np.asarray(weights), x / pw


def test_literal_paper_form_of_quant_sgp_breaks_push_sum_on_a_directed_graph():
    params, _, ss = run_directed("quant_sgp")
    x0 = flat(params)
    mean, mass0 = x0.mean(axis=0), x0.sum(axis=0)
    w = skewed_column()

    masses, weights, z = literal_quant_sgp_paper_form(
        w, x0, PUSH_SUM_GAMMA, CONSENSUS_STEPS, mass_conserving=False
    )
    drift = np.abs(masses[-1] - mass0).max()
    miss = np.abs(z - mean).max()
    assert drift > 1.0 and miss > 0.5, (drift, miss)
    np.testing.assert_allclose(weights, N, atol=1e-9)  # w is fine; x is what drifts

    masses, weights, z = literal_quant_sgp_paper_form(
        w, x0, PUSH_SUM_GAMMA, CONSENSUS_STEPS, mass_conserving=True
    )
    np.testing.assert_allclose(masses, np.broadcast_to(mass0, masses.shape), atol=1e-9)
    np.testing.assert_allclose(weights, N, atol=1e-9)
    np.testing.assert_allclose(z, np.broadcast_to(mean, z.shape), atol=1e-6)

    # lpdec keeps the mass too (with 8-bit messages), where the paper form lost it.
    assert np.abs(flat(ss.x, CONSENSUS_STEPS - 1).sum(axis=0) - mass0).max() < 1e-3 * drift


@pytest.mark.parametrize(
    "name, topo, match",
    [
        ("quant_sgp", ROW_ONLY, "row_only is not column stochastic"),
        ("quant_sgp", topology.one_peer_exponential(N), "needs a static topology"),
    ],
)
def test_topology_that_breaks_the_algorithm_raises(name, topo, match):
    with pytest.raises(ValueError, match=match):
        FACTORIES[name](topo, lpdec.minmax(8))


@pytest.mark.parametrize("name", ["quant_sgp"])
@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5, True, "0.5"])
def test_gamma_outside_unit_interval_raises(name, gamma):
    check_gamma_outside_unit_interval_raises(name, gamma)


@pytest.mark.parametrize("name", ["quant_sgp"])
def test_update_without_params_raises(name):
    check_update_without_params_raises(name)


@pytest.mark.parametrize("name", ["quant_sgp"])
def test_not_a_compressor_raises(name):
    check_not_a_compressor_raises(name)


@pytest.mark.parametrize("name", ["quant_sgp"])
def test_topology_size_must_match_the_axis(name):
    check_topology_size_must_match_the_axis(name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["quant_sgp"])
def test_non_finite_update_is_dropped_and_counted_on_its_node(name, mode):
    check_non_finite_update_is_dropped_and_counted_on_its_node(name, mode)


@pytest.mark.parametrize("name", ["quant_sgp"])
def test_non_finite_node_does_not_poison_its_neighbours(name):
    check_non_finite_node_does_not_poison_its_neighbours(name)
