"""Tests of lpdec.topology against dense mixing matrices built from the definitions."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lpdec import topology
from lpdec._edge_coloring import bipartite_edge_coloring

# ---------------------------------------------------------------------------
# Independent dense references, written from each constructor's definition.
# ---------------------------------------------------------------------------


def ref_ring(n):
    if n == 1:
        return np.ones((1, 1))
    if n == 2:
        return np.full((2, 2), 0.5)
    w = np.zeros((n, n))
    i = np.arange(n)
    for j in (i, (i + 1) % n, (i - 1) % n):
        w[i, j] = 1 / 3
    return w


def ref_directed_ring(n):
    if n == 1:
        return np.ones((1, 1))
    w = 0.5 * np.eye(n)
    i = np.arange(n)
    w[(i + 1) % n, i] = 0.5  # node i sends to i + 1
    return w


def ref_torus(rows, cols):
    n = rows * cols
    w = np.zeros((n, n))
    for r in range(rows):
        for c in range(cols):
            me = r * cols + c
            peers = {
                ((r + dr) % rows) * cols + (c + dc) % cols
                for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))
            }
            peers.discard(me)
            for j in peers | {me}:
                w[me, j] = 1 / (len(peers) + 1)
    return w


def ref_exponential(n):
    w = np.zeros((n, n))
    for i in range(n):
        peers = {(i + 2**k) % n for k in range(n) if 2**k < n} - {i}
        w[i, i] = 1 / (len(peers) + 1)
        for p in peers:
            w[p, i] = 1 / (len(peers) + 1)  # i sends to p, so p weighs x_i
    return w


def ref_complete(n):
    return np.full((n, n), 1 / n)


def ref_one_peer_exponential(n, t):
    if n == 1:
        return np.ones((1, 1))
    hop = 2 ** (t % math.ceil(math.log2(n)))
    w = 0.5 * np.eye(n)
    i = np.arange(n)
    w[(i + hop) % n, i] = 0.5
    return w


NS = (1, 2, 3, 8, 16)
TORI = ((1, 1), (1, 2), (2, 1), (1, 5), (2, 2), (2, 3), (3, 3), (4, 4), (3, 5))

CASES = (
    [(f"ring({n})", lambda n=n: topology.ring(n), lambda n=n: [ref_ring(n)], False) for n in NS]
    + [
        (
            f"directed_ring({n})",
            lambda n=n: topology.directed_ring(n),
            lambda n=n: [ref_directed_ring(n)],
            True,
        )
        for n in NS
    ]
    + [
        (
            f"torus({r}, {c})",
            lambda r=r, c=c: topology.torus(r, c),
            lambda r=r, c=c: [ref_torus(r, c)],
            False,
        )
        for r, c in TORI
    ]
    + [
        (
            f"exponential({n})",
            lambda n=n: topology.exponential(n),
            lambda n=n: [ref_exponential(n)],
            True,
        )
        for n in NS + (5, 12)
    ]
    + [
        (f"complete({n})", lambda n=n: topology.complete(n), lambda n=n: [ref_complete(n)], False)
        for n in NS
    ]
    + [
        (
            f"one_peer_exponential({n})",
            lambda n=n: topology.one_peer_exponential(n),
            lambda n=n: [
                ref_one_peer_exponential(n, t) for t in range(max(1, math.ceil(math.log2(n))))
            ],
            True,
        )
        for n in NS + (6,)
    ]
)
CASE_IDS = [c[0] for c in CASES]


def all_topologies():
    tops = [make() for _, make, _, _ in CASES]
    tops += [topology.random_matching(n, seed=s) for n in (1, 2, 3, 8, 9) for s in (0, 1)]
    tops.append(topology.from_matrix(random_sparse(np.random.default_rng(0), 11, 0.3)))
    tops.append(topology.ring(8).with_slack(0.3))
    return tops


def random_sparse(rng, n, density):
    """Random non-negative W whose support is strongly connected (a random Hamiltonian cycle)."""
    w = rng.uniform(0.1, 1.0, (n, n)) * (rng.uniform(size=(n, n)) < density)
    cycle = rng.permutation(n)
    w[cycle, np.roll(cycle, 1)] = rng.uniform(0.1, 1.0, n)
    return w


def simulate_gossip(rnd, x, float32=True):
    """sum_c recv_weight_c * ppermute(x, perm_c) + self_weight * x, with ppermute simulated."""
    self_weight = rnd.self_weight if float32 else np.asarray(rnd.diagonal)
    out = self_weight[:, None] * x
    for c in rnd.edge_classes:
        received = np.zeros_like(x)  # ppermute delivers zeros to non-destinations
        for source, destination in c.perm:
            received[destination] = x[source]
        out = out + (c.recv_weight if float32 else np.asarray(c.weights))[:, None] * received
    return out


def strongly_connected_ref(support):
    n = len(support)
    reach = np.linalg.matrix_power((support | np.eye(n, dtype=bool)).astype(np.int64), n)
    return bool((reach > 0).all())


# ---------------------------------------------------------------------------
# Constructors against their definitions.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "make", "reference", "directed"), CASES, ids=CASE_IDS)
def test_constructor_matches_definition(name, make, reference, directed):
    topo = make()
    refs = reference()
    assert repr(topo) == name
    assert topo.directed is directed
    assert topo.period == topo.num_rounds == len(refs)
    for t, ref in enumerate(refs):
        np.testing.assert_allclose(topo.mixing_matrix(t), ref, rtol=0, atol=1e-15)
        np.testing.assert_allclose(topo.mixing_matrix(t + topo.period), ref, rtol=0, atol=1e-15)
    np.testing.assert_allclose(topology.mixing_matrices(topo), np.stack(refs), rtol=0, atol=1e-15)
    assert all((ref >= 0).all() for ref in refs)
    assert topo.is_doubly_stochastic() and topo.is_row_stochastic() and topo.is_column_stochastic()
    assert topo.is_symmetric() == all(np.array_equal(r, r.T) for r in refs)
    if not directed:
        assert topo.is_symmetric()


def test_expected_symmetry_and_degrees():
    assert not topology.directed_ring(8).is_symmetric()
    assert not topology.exponential(8).is_symmetric()
    assert topology.exponential(3).is_symmetric()  # offsets 1 and 2 make it complete(3)
    assert (
        topology.ring(8).degree == 2
        and topology.ring(2).degree == 1
        and topology.ring(1).degree == 0
    )
    assert topology.torus(4, 4).degree == 4 and topology.torus(2, 2).degree == 2
    assert topology.exponential(16).degree == 4 and topology.exponential(9).degree == 4
    assert topology.complete(5).degree == 4
    assert topology.one_peer_exponential(16).degree == 1
    np.testing.assert_array_equal(topology.directed_ring(5).in_degree(), np.ones(5))
    assert topology.exponential(8).max_in_degree == topology.exponential(8).max_out_degree == 3


def test_torus_with_sides_of_one_and_two():
    assert (
        topology.torus(1, 7).mixing_matrix().tolist() == topology.ring(7).mixing_matrix().tolist()
    )
    np.testing.assert_allclose(
        topology.torus(4, 4).mixing_matrix()[5], np.isin(np.arange(16), [1, 4, 5, 6, 9]) / 5
    )
    np.testing.assert_allclose(topology.torus(2, 2).mixing_matrix()[0], [1 / 3, 1 / 3, 1 / 3, 0])


def test_neighbors():
    assert topology.ring(8).in_neighbors(0) == (1, 7)
    assert topology.directed_ring(8).in_neighbors(0) == (7,)
    assert topology.directed_ring(8).out_neighbors(0) == (1,)
    assert topology.torus(4, 4).in_neighbors(5) == (1, 4, 6, 9)
    assert topology.exponential(8).out_neighbors(0) == (1, 2, 4)
    assert topology.exponential(8).in_neighbors(0) == (4, 6, 7)
    opx = topology.one_peer_exponential(8)
    assert [opx.out_neighbors(0, step=t) for t in range(4)] == [(1,), (2,), (4,), (1,)]
    assert [opx.in_neighbors(0, step=t) for t in range(3)] == [(7,), (6,), (4,)]
    assert topology.ring(1).in_neighbors(0) == ()
    for bad in (-1, 8):
        with pytest.raises(ValueError, match=f"topology ring\\(8\\) has no node {bad}"):
            topology.ring(8).in_neighbors(bad)


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: topology.ring(0), "ring: n"),
        (lambda: topology.ring(2.5), "ring: n"),
        (lambda: topology.directed_ring(-1), "directed_ring: n"),
        (lambda: topology.torus(0, 4), "torus: rows"),
        (lambda: topology.torus(4, 0), "torus: cols"),
        (lambda: topology.exponential(0), "exponential: n"),
        (lambda: topology.complete(True), "complete: n"),
        (lambda: topology.one_peer_exponential(0), "one_peer_exponential: n"),
        (lambda: topology.random_matching(0, seed=0), "random_matching: n"),
        (lambda: topology.random_matching(8, seed=0, period=0), "random_matching: period"),
        (lambda: topology.Topology("empty", 0, False, ()), "num_nodes"),
    ],
)
def test_bad_sizes_name_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg + ".* must be an integer >= 1"):
        make()


# ---------------------------------------------------------------------------
# The gossip contract: edge classes + self weight reproduce W @ x.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("topo", all_topologies(), ids=repr)
def test_edge_classes_reproduce_w(topo):
    rng = np.random.default_rng(1)
    n = topo.num_nodes
    for t in range(topo.period):
        rnd = topo.round(t)
        x = rng.normal(size=(n, 3))
        expected = topo.mixing_matrix(t) @ x
        np.testing.assert_allclose(
            simulate_gossip(rnd, x, float32=False), expected, rtol=1e-13, atol=1e-13
        )
        np.testing.assert_allclose(simulate_gossip(rnd, x), expected, rtol=1e-6, atol=1e-6)
        assert rnd.self_weight.dtype == np.float32 and rnd.self_weight.shape == (n,)
        off = (topo.mixing_matrix(t) > 0) & ~np.eye(n, dtype=bool)
        np.testing.assert_array_equal(topo.in_degree(t), off.sum(axis=1))
        np.testing.assert_array_equal(topo.out_degree(t), off.sum(axis=0))
        for i in range(n):
            assert topo.in_neighbors(i, t) == tuple(np.flatnonzero(off[i]))
            assert topo.out_neighbors(i, t) == tuple(np.flatnonzero(off[:, i]))
        # Minimal schedules: one ppermute per unit of degree (König's bound is tight).
        assert len(rnd.edge_classes) == max(off.sum(axis=0).max(), off.sum(axis=1).max(), 0)
        for c in rnd.edge_classes:
            sources = [s for s, _ in c.perm]
            destinations = [d for _, d in c.perm]
            assert len(set(sources)) == len(sources) and len(set(destinations)) == len(destinations)
            assert all(s != d and 0 <= s < n and 0 <= d < n for s, d in c.perm)
            assert c.recv_weight.dtype == np.float32 and c.recv_weight.shape == (n,)
            assert c.senders.shape == c.receivers.shape == (n,)
            for i in range(n):
                if i in destinations:
                    assert c.perm[sources.index(c.senders[i])] == (c.senders[i], i)
                    assert c.recv_weight[i] == np.float32(topo.mixing_matrix(t)[i, c.senders[i]])
                else:
                    assert c.senders[i] == -1 and c.recv_weight[i] == 0
                if i in sources:
                    assert c.send_weight[i] == c.recv_weight[c.receivers[i]]
                else:
                    assert c.receivers[i] == -1 and c.send_weight[i] == 0


def test_weight_arrays_are_read_only():
    rnd = topology.ring(4).round(0)
    with pytest.raises(ValueError, match="read-only"):
        rnd.self_weight[0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        rnd.edge_classes[0].recv_weight[0] = 1.0


def test_edge_class_rejects_invalid_perms():
    with pytest.raises(ValueError, match="repeats a source"):
        topology.EdgeClass(((0, 1), (0, 2)), (0.0, 0.5, 0.5))
    with pytest.raises(ValueError, match="repeats a source or a destination"):
        topology.EdgeClass(((0, 2), (1, 2)), (0.0, 0.0, 0.5))
    with pytest.raises(ValueError, match="itself"):
        topology.EdgeClass(((1, 1),), (0.0, 0.5))
    with pytest.raises(ValueError, match="outside"):
        topology.EdgeClass(((0, 3),), (0.0, 0.5, 0.5))
    with pytest.raises(ValueError, match="positive exactly at the destinations"):
        topology.EdgeClass(((0, 1),), (0.5, 0.5))
    with pytest.raises(ValueError, match="non-negative"):
        topology.EdgeClass(((0, 1),), (0.0, -0.5))
    with pytest.raises(ValueError, match="integer pairs"):
        topology.EdgeClass(((0.0, 1.0),), (0.0, 0.5))
    with pytest.raises(ValueError, match="two edge classes"):
        c = topology.EdgeClass(((0, 1),), (0.0, 0.25))
        topology.Round((0.5, 0.5), (c, c))


# ---------------------------------------------------------------------------
# from_matrix and the edge colouring.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "density", "seed"), [(5, 0.5, 0), (12, 0.2, 1), (30, 0.1, 2), (30, 0.6, 3), (64, 0.05, 4)]
)
def test_from_matrix_round_trips_with_koenig_many_classes(n, density, seed):
    rng = np.random.default_rng(seed)
    w = random_sparse(rng, n, density)
    topo = topology.from_matrix(w, name="sparse")
    np.testing.assert_array_equal(topo.mixing_matrix(), w)
    off = (w > 0) & ~np.eye(n, dtype=bool)
    max_degree = max(off.sum(axis=0).max(), off.sum(axis=1).max())
    assert len(topo.round(0).edge_classes) == max_degree == topo.degree
    x = rng.normal(size=(n, 2))
    np.testing.assert_allclose(simulate_gossip(topo.round(0), x, float32=False), w @ x, rtol=1e-13)


def test_from_matrix_star_needs_as_many_classes_as_the_hub_has_peers():
    n = 9
    w = np.eye(n) / 2
    w[0, 1:] = w[1:, 0] = 1 / (2 * (n - 1))
    w[0, 0] = 0.5
    topo = topology.from_matrix(w)
    assert not topo.directed
    assert len(topo.round(0).edge_classes) == n - 1
    np.testing.assert_array_equal(topo.mixing_matrix(), w)


@pytest.mark.parametrize("seed", range(6))
def test_bipartite_edge_coloring_uses_max_degree_colours(seed):
    rng = np.random.default_rng(seed)
    num_left, num_right = rng.integers(1, 25, size=2)
    mask = rng.uniform(size=(num_left, num_right)) < rng.uniform(0.1, 0.9)
    edges = [tuple(e) for e in np.argwhere(mask)] + [(0, 0)]  # one parallel edge at most
    colours = bipartite_edge_coloring(edges, num_left, num_right)
    left_degree = np.bincount([u for u, _ in edges], minlength=num_left)
    right_degree = np.bincount([v for _, v in edges], minlength=num_right)
    assert colours.max() + 1 == max(left_degree.max(), right_degree.max())
    for side in (0, 1):
        ends = [(e[side], c) for e, c in zip(edges, colours, strict=True)]
        assert len(set(ends)) == len(ends)  # no two edges of one colour share a node
    assert bipartite_edge_coloring([], 3, 3).shape == (0,)


def test_from_matrix_infers_direction_from_support():
    asymmetric_weights = [[0.2, 0.8, 0.0], [0.3, 0.4, 0.3], [0.0, 0.5, 0.5]]
    assert not topology.from_matrix(asymmetric_weights).directed
    assert topology.from_matrix(topology.directed_ring(5).mixing_matrix()).directed
    assert topology.from_matrix(asymmetric_weights, directed=True).directed
    with pytest.raises(ValueError, match=r"marked undirected but round 0 has the edge"):
        topology.from_matrix(topology.directed_ring(5).mixing_matrix(), directed=False)


@pytest.mark.parametrize(
    ("w", "message"),
    [
        ([[0.5, -0.5], [0.5, 1.0]], r"topology bad: W has negative entries, e.g. W\[0, 1\] = -0.5"),
        ([[0.5, np.nan], [0.5, 0.5]], r"NaN or Inf entries, e.g. W\[0, 1\]"),
        ([[0.5, np.inf], [0.5, 0.5]], "NaN or Inf"),
        (np.ones((2, 3)), r"square .* got shape \(2, 3\)"),
        (np.ones(4), r"got shape \(4,\)"),
        (np.ones((0, 0)), "non-empty"),
        (
            [[1.0, 0.0], [0.0, 1.0]],
            "topology bad is not strongly connected: node 1 cannot be reached from node 0",
        ),
        (
            [[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.3, 0.3, 0.4]],
            "node 0 cannot be reached from node 2",
        ),
        ([[1.0, "x"], [0.0, 1.0]], "numeric"),
    ],
)
def test_from_matrix_rejects_bad_matrices(w, message):
    with pytest.raises(ValueError, match=message):
        topology.from_matrix(w, name="bad")


def test_from_matrix_time_varying_schedule():
    w0 = np.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    w1 = np.array([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.0, 0.5, 0.5]])
    with pytest.raises(ValueError, match="not strongly connected"):
        topology.from_matrix(w0)
    topo = topology.from_matrix([w0, w1], name="pairs")
    assert topo.period == 2 and topo.is_time_varying and not topo.directed
    np.testing.assert_array_equal(topo.mixing_matrix(3), w1)
    np.testing.assert_array_equal(topology.mixing_matrices(topo), np.stack([w0, w1]))
    negative = w1.copy()
    negative[2, 1] = -0.5
    with pytest.raises(ValueError, match=r"round 1, W\[2, 1\] = -0.5"):
        topology.from_matrix([w0, negative])


# ---------------------------------------------------------------------------
# Spectral gap.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(3, 21))
def test_ring_spectral_gap_closed_form(n):
    closed_form = 1 - (1 / 3 + 2 / 3 * np.cos(2 * np.pi / n))
    eigenvalues = np.sort(np.linalg.eigvalsh(ref_ring(n)))[::-1]
    lam2, lam_n = eigenvalues[1], eigenvalues[-1]
    assert topology.ring(n).spectral_gap() == pytest.approx(closed_form, abs=1e-12)
    assert topology.ring(n).spectral_gap() == pytest.approx(
        1 - max(abs(lam2), abs(lam_n)), abs=1e-12
    )
    # λ2 dominates for n >= 5; n = 4 ties (1/3 = |-1/3|) and n = 3 has λ2 = λ3 = 0.
    if n >= 5:
        assert abs(lam_n) < lam2
    elif n == 4:
        assert lam2 == pytest.approx(1 / 3) and lam_n == pytest.approx(-1 / 3)
    else:
        assert lam2 == pytest.approx(0, abs=1e-12) and lam_n == pytest.approx(0, abs=1e-12)


def test_spectral_gap_where_the_smallest_eigenvalue_dominates():
    # A lazy 4-cycle with W_ii = 0.1: eigenvalues 0.1 + 0.9 cos(pi k / 2) = 1, 0.1, -0.8, 0.1.
    w = 0.1 * np.eye(4) + 0.45 * (np.roll(np.eye(4), 1, axis=0) + np.roll(np.eye(4), -1, axis=0))
    assert topology.from_matrix(w).spectral_gap() == pytest.approx(0.2, abs=1e-12)
    # No self loops on a bipartite graph: λn = -1, x never settles.
    assert topology.from_matrix([[0.0, 1.0], [1.0, 0.0]]).spectral_gap() == pytest.approx(
        0, abs=1e-12
    )


def test_time_varying_gap_is_of_the_period_product_in_step_order():
    rng = np.random.default_rng(7)
    mats = [random_sparse(rng, 6, 0.3) for _ in range(3)]
    mats = [m / m.sum(axis=0) for m in mats]  # column stochastic, as push-sum needs
    topo = topology.from_matrix(mats).validate("column_stochastic")
    product = mats[2] @ mats[1] @ mats[0]  # x_3 = W_2 W_1 W_0 x_0
    moduli = np.sort(np.abs(np.linalg.eigvals(product)))
    assert topo.spectral_gap() == pytest.approx(1 - moduli[-2], abs=1e-12)
    reversed_moduli = np.sort(np.abs(np.linalg.eigvals(mats[0] @ mats[1] @ mats[2])))
    assert abs(moduli[-2] - reversed_moduli[-2]) > 1e-6  # the order is observable
    assert topo.spectral_gap(step=4) == pytest.approx(
        1 - np.sort(np.abs(np.linalg.eigvals(mats[1])))[-2], abs=1e-12
    )


@pytest.mark.parametrize("n", [1, 2, 3, 8, 16])
def test_complete_and_directed_ring_gaps(n):
    assert topology.complete(n).spectral_gap() == pytest.approx(1.0, abs=1e-12)
    # W = (I + S) / 2 has eigenvalues (1 + e^{2 pi i k / n}) / 2 of modulus |cos(pi k / n)|.
    expected = 1.0 if n == 1 else 1 - abs(np.cos(np.pi / n))
    assert topology.directed_ring(n).spectral_gap() == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------------------
# Time-varying schedules.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", range(1, 7))
def test_one_peer_exponential_period_product_is_exact_average(k):
    n = 2**k
    topo = topology.one_peer_exponential(n)
    assert topo.period == k
    product = np.eye(n)
    for t in range(topo.period):
        product = topo.mixing_matrix(t) @ product
    np.testing.assert_allclose(product, np.full((n, n), 1 / n), atol=1e-15)
    assert topo.spectral_gap() == pytest.approx(1.0, abs=1e-12)
    assert topo.spectral_gap(step=0) == pytest.approx(1 - abs(np.cos(np.pi / n)), abs=1e-12)


def test_one_peer_exponential_not_power_of_two_is_connected_but_not_exact():
    topo = topology.one_peer_exponential(6)
    assert topo.period == 3
    assert 0 < topo.spectral_gap() < 1


@pytest.mark.parametrize("n", [2, 3, 7, 8, 20])
def test_random_matching_rounds(n):
    topo = topology.random_matching(n, seed=5, period=6)
    assert topo.period == 6 and not topo.directed
    for w in topology.mixing_matrices(topo):
        np.testing.assert_array_equal(w, w.T)
        assert set(np.unique(w)) <= {0.0, 0.5, 1.0}
        np.testing.assert_array_equal(w.sum(axis=0), np.ones(n))
        assert (np.diag(w) == 1.0).sum() == n % 2  # exactly one idle node when n is odd
    support = (topology.mixing_matrices(topo) > 0).any(axis=0)
    assert strongly_connected_ref(support)
    assert topo.spectral_gap() > 0
    if n >= 3:
        assert topo.spectral_gap(step=0) == pytest.approx(0.0, abs=1e-12)  # one matching alone


def test_random_matching_is_deterministic_per_seed():
    a, b = topology.random_matching(8, seed=3), topology.random_matching(8, seed=3)
    assert a == b and hash(a) == hash(b)
    np.testing.assert_array_equal(topology.mixing_matrices(a), topology.mixing_matrices(b))
    assert topology.random_matching(8, seed=4) != a
    assert a.period == 16


def test_random_matching_short_periods():
    for seed in range(4):  # two matchings rarely connect 30 nodes: seeds 2 and 3 need redraws
        topo = topology.random_matching(30, seed=seed, period=2)
        assert strongly_connected_ref((topology.mixing_matrices(topo) > 0).any(axis=0))
    with pytest.raises(ValueError, match="one matching cannot connect 3 nodes"):
        topology.random_matching(3, seed=0, period=1)
    assert topology.random_matching(2, seed=0, period=1).mixing_matrix().tolist() == [
        [0.5, 0.5],
        [0.5, 0.5],
    ]


# ---------------------------------------------------------------------------
# Slack, validation, hashing, axis sizes.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: topology.ring(8),
        lambda: topology.exponential(6),
        lambda: topology.one_peer_exponential(8),
    ],
)
@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.999])
def test_with_slack_is_exact(make, alpha):
    topo = make()
    slack = topo.with_slack(alpha)
    assert repr(slack) == f"{topo!r}.with_slack({alpha:g})"
    for t in range(topo.period):
        expected = alpha * topo.mixing_matrix(t) + (1 - alpha) * np.eye(topo.num_nodes)
        np.testing.assert_array_equal(slack.mixing_matrix(t), expected)
    assert slack.is_doubly_stochastic()
    assert slack.directed == topo.directed


def test_with_slack_scales_the_ring_gap():
    assert topology.ring(8).with_slack(0.5).spectral_gap() == pytest.approx(
        0.5 * topology.ring(8).spectral_gap()
    )
    assert topology.ring(8).with_slack(1.0) == topology.ring(8)
    for alpha in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
            topology.ring(8).with_slack(alpha)


def test_validate_names_topology_index_and_sum():
    lopsided = topology.from_matrix(
        [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.25, 0.25, 0.5]], name="lopsided"
    )
    assert lopsided.validate("row_stochastic") is lopsided
    assert lopsided.is_row_stochastic() and not lopsided.is_column_stochastic()
    with pytest.raises(
        ValueError, match=r"topology lopsided is not column stochastic: column 0 of W sums to 0.75"
    ):
        lopsided.validate("column_stochastic")
    with pytest.raises(ValueError, match=r"not doubly stochastic: column 0 of W sums to 0.75"):
        lopsided.validate(("row_stochastic", "doubly_stochastic"))
    with pytest.raises(ValueError, match=r"not symmetric: W\[0, 1\] = 0.5 but W\[1, 0\] = 0"):
        lopsided.validate("symmetric")
    with pytest.raises(ValueError, match="not row stochastic: row 1 of W sums to 1.5"):
        topology.from_matrix([[0.5, 0.5], [1.0, 0.5]]).validate("row_stochastic")
    with pytest.raises(ValueError, match="require must be among"):
        topology.ring(4).validate("stochastic")
    assert topology.ring(8).validate(("doubly_stochastic", "symmetric")) == topology.ring(8)


def test_validate_reports_the_round_of_a_schedule():
    bad = topology.from_matrix([np.full((2, 2), 0.5), [[0.5, 0.5], [0.25, 0.75]]], name="sched")
    with pytest.raises(ValueError, match=r"column 0 of W sums to 0.75, expected 1 \(round 1\)"):
        bad.validate("column_stochastic")


def test_hash_and_equality():
    assert topology.ring(8) == topology.ring(8)
    assert hash(topology.ring(8)) == hash(topology.ring(8))
    assert topology.ring(8) != topology.ring(9)
    assert topology.ring(8) != topology.directed_ring(8)
    assert len({topology.torus(4, 4), topology.torus(4, 4), topology.complete(4)}) == 2
    assert topology.torus(2, 2).with_slack(0.5) == topology.torus(2, 2).with_slack(0.5)


def test_topology_is_a_jit_static_argument():
    traces = []

    def mix(x, topo):
        traces.append(topo)
        rnd = topo.round(0)
        return rnd.self_weight * x + sum(
            c.recv_weight * x[c.senders] * (c.senders >= 0) for c in rnd.edge_classes
        )

    mix = jax.jit(mix, static_argnums=1)
    x = jnp.arange(8.0)
    out = mix(x, topology.ring(8))
    mix(x, topology.ring(8))  # an equal, freshly built topology must hit the cache
    assert len(traces) == 1
    np.testing.assert_allclose(out, topology.ring(8).mixing_matrix() @ np.arange(8.0), rtol=1e-6)
    mix(x, topology.directed_ring(8))
    assert len(traces) == 2


def test_check_axis_size():
    topology.ring(8).check_axis_size(8)
    with pytest.raises(
        ValueError, match=r"^topology ring\(8\) has 8 nodes but the named axis 'nodes' has size 4$"
    ):
        topology.ring(8).check_axis_size(4, "nodes")

    def per_node(x):
        topology.ring(8).check_axis_size(jax.lax.axis_size("workers"), "workers")
        return x

    with pytest.raises(ValueError, match="the named axis 'workers' has size 4"):
        jax.vmap(per_node, axis_name="workers")(jnp.zeros(4))
    jax.vmap(per_node, axis_name="workers")(jnp.zeros(8))


def test_round_needs_a_static_step():
    topo = topology.one_peer_exponential(8)
    assert topo.round(np.int64(4)) == topo.round(1)
    with pytest.raises(TypeError):
        topo.round(1.5)
