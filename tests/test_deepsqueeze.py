"""lpdec.algorithms.deepsqueeze (Deep-Squeeze) against float64 numpy references with an explicit W
(tests/_push_sum_reference.py)."""

import numpy as np
import pytest
from _push_sum_reference import COLUMN_ONLY
from _push_sum_reference import COMPRESSORS
from _push_sum_reference import FACTORIES
from _push_sum_reference import SHAPES
from _push_sum_reference import STEPS
from _push_sum_reference import N
from _push_sum_reference import check_free_running_matches_float64_simulation_without_compression
from _push_sum_reference import check_gamma_outside_unit_interval_raises
from _push_sum_reference import check_non_finite_node_does_not_poison_its_neighbours
from _push_sum_reference import check_non_finite_update_is_dropped_and_counted_on_its_node
from _push_sum_reference import check_not_a_compressor_raises
from _push_sum_reference import check_step
from _push_sum_reference import check_topology_size_must_match_the_axis
from _push_sum_reference import check_update_without_params_raises
from _push_sum_reference import flat
from _push_sum_reference import inputs

import lpdec
from lpdec import topology
from lpdec.algorithms import deepsqueeze
from lpdec.testing import MODES
from lpdec.testing import run
from lpdec.testing import to_numpy


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("compressor_name", COMPRESSORS)
@pytest.mark.parametrize("name", ["deepsqueeze"])
def test_each_step_matches_a_float64_reference(name, compressor_name, mode):
    for step in range(STEPS):
        check_step(name, compressor_name, mode, step)


@pytest.mark.parametrize("name", ["deepsqueeze"])
def test_free_running_matches_float64_simulation_without_compression(name):
    check_free_running_matches_float64_simulation_without_compression(name)


def test_deepsqueeze_preserves_the_node_average():
    params, _ = inputs()
    zeros = {k: np.zeros((N, 50, *s), np.float32) for k, s in SHAPES.items()}
    tx = deepsqueeze.deepsqueeze(
        topology.ring(N), lpdec.minmax(8, rounding="stochastic"), gamma=0.5
    )
    ps, _, _ = to_numpy(run(tx, params, 50, updates=zeros))
    mean0 = flat(params).mean(axis=0)
    means = np.stack([flat(ps, t).mean(axis=0) for t in range(50)])
    np.testing.assert_allclose(means, np.broadcast_to(mean0, means.shape), rtol=0, atol=1e-5)
    # ... while the nodes do move (a no-op would pass the line above).
    assert np.abs(flat(ps, 49) - flat(params)).max() > 0.5


@pytest.mark.parametrize(
    "name, topo, match",
    [
        ("deepsqueeze", COLUMN_ONLY, "column_only is not doubly stochastic: row"),
    ],
)
def test_topology_that_breaks_the_algorithm_raises(name, topo, match):
    with pytest.raises(ValueError, match=match):
        FACTORIES[name](topo, lpdec.minmax(8))


@pytest.mark.parametrize("name", ["deepsqueeze"])
@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5, True, "0.5"])
def test_gamma_outside_unit_interval_raises(name, gamma):
    check_gamma_outside_unit_interval_raises(name, gamma)


@pytest.mark.parametrize("name", ["deepsqueeze"])
def test_update_without_params_raises(name):
    check_update_without_params_raises(name)


@pytest.mark.parametrize("name", ["deepsqueeze"])
def test_not_a_compressor_raises(name):
    check_not_a_compressor_raises(name)


@pytest.mark.parametrize("name", ["deepsqueeze"])
def test_topology_size_must_match_the_axis(name):
    check_topology_size_must_match_the_axis(name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["deepsqueeze"])
def test_non_finite_update_is_dropped_and_counted_on_its_node(name, mode):
    check_non_finite_update_is_dropped_and_counted_on_its_node(name, mode)


@pytest.mark.parametrize("name", ["deepsqueeze"])
def test_non_finite_node_does_not_poison_its_neighbours(name):
    check_non_finite_node_does_not_poison_its_neighbours(name)
