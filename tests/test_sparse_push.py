"""lpdec.algorithms.sparse_push (Sparse-Push) against float64 numpy push-sum references with an
explicit W (tests/_push_sum_reference.py)."""

import pytest
from _push_sum_reference import COMPRESSORS
from _push_sum_reference import FACTORIES
from _push_sum_reference import ROW_ONLY
from _push_sum_reference import STEPS
from _push_sum_reference import WEIGHTED_0
from _push_sum_reference import WEIGHTED_1
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
from _push_sum_reference import skewed_column
from _push_sum_reference import skewed_row

import lpdec
from lpdec import topology
from lpdec.testing import MODES


def test_graphs_have_the_properties_the_tests_rely_on():
    skewed = topology.from_matrix(skewed_column())
    assert skewed.is_column_stochastic() and not skewed.is_row_stochastic()
    assert len(set(skewed.out_degree())) > 1
    assert topology.from_matrix(skewed_row()).is_row_stochastic()
    for w in (WEIGHTED_0, WEIGHTED_1):
        t = topology.from_matrix(w)
        assert t.is_column_stochastic() and not t.is_row_stochastic()
        assert all(len(c.perm) == N for c in t.rounds[0].edge_classes)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compressor_name", COMPRESSORS)
@pytest.mark.parametrize("name", ["sparse_push"])
def test_each_step_matches_a_float64_reference(name, compressor_name, mode):
    for step in range(STEPS):
        check_step(name, compressor_name, mode, step)


@pytest.mark.parametrize("name", ["sparse_push"])
def test_free_running_matches_float64_simulation_without_compression(name):
    check_free_running_matches_float64_simulation_without_compression(name)


@pytest.mark.parametrize("name", ["sparse_push"])
def test_push_sum_preserves_mass_and_weight_on_a_directed_graph(name):
    check_push_sum_preserves_mass_and_weight_on_a_directed_graph(name)


@pytest.mark.parametrize("name", ["sparse_push"])
def test_push_sum_reaches_the_true_average_where_plain_gossip_is_biased(name):
    check_push_sum_reaches_the_true_average_where_plain_gossip_is_biased(name)


@pytest.mark.parametrize(
    "name, topo, match",
    [
        ("sparse_push", ROW_ONLY, "row_only is not column stochastic"),
    ],
)
def test_topology_that_breaks_the_algorithm_raises(name, topo, match):
    with pytest.raises(ValueError, match=match):
        FACTORIES[name](topo, lpdec.minmax(8))


@pytest.mark.parametrize("name", ["sparse_push"])
@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5, True, "0.5"])
def test_gamma_outside_unit_interval_raises(name, gamma):
    check_gamma_outside_unit_interval_raises(name, gamma)


@pytest.mark.parametrize("name", ["sparse_push"])
def test_update_without_params_raises(name):
    check_update_without_params_raises(name)


@pytest.mark.parametrize("name", ["sparse_push"])
def test_not_a_compressor_raises(name):
    check_not_a_compressor_raises(name)


@pytest.mark.parametrize("name", ["sparse_push"])
def test_topology_size_must_match_the_axis(name):
    check_topology_size_must_match_the_axis(name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["sparse_push"])
def test_non_finite_update_is_dropped_and_counted_on_its_node(name, mode):
    check_non_finite_update_is_dropped_and_counted_on_its_node(name, mode)


@pytest.mark.parametrize("name", ["sparse_push"])
def test_non_finite_node_does_not_poison_its_neighbours(name):
    check_non_finite_node_does_not_poison_its_neighbours(name)
