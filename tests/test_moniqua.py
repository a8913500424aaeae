"""lpdec.algorithms.moniqua against numpy references of seed 003 with an explicit W
(tests/_moniqua_reference.py), Lemma 2 and Theorem 3 on small problems, its θ warnings and
suggest_theta."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _moniqua_reference import CASES
from _moniqua_reference import RING
from _moniqua_reference import N
from _moniqua_reference import check_each_step_matches_dense_reference

import lpdec
from lpdec import metrics
from lpdec import testing as harness
from lpdec import topology
from lpdec.algorithms import dpsgd
from lpdec.algorithms import moniqua
from lpdec.compress import base as compress_base
from lpdec.compress import modulo


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].kind == "moniqua"])
def test_each_step_matches_dense_reference(name, mode, rng):
    check_each_step_matches_dense_reference(name, mode, rng)


def _models_in_the_unit_box(alg):
    """30 steps of sgd(0.05) then `alg` from models in [-1, 1] pulled to targets in [-1, 1]
    (every model stays in [-1, 1], neighbours within 2): (params, states) per step."""
    rng = np.random.default_rng(7)
    d, steps, lr = 16, 30, 0.05
    x0 = rng.uniform(-1.0, 1.0, (N, d)).astype(np.float32)
    b = jnp.asarray(rng.uniform(-1.0, 1.0, (N, d)), jnp.float32)

    def grad_fn(p, node, t):
        return {"w": p["w"] - b[node]}

    tx = optax.chain(optax.sgd(lr), alg)
    ps, states, _ = harness.run(tx, {"w": jnp.asarray(x0)}, steps, grad_fn=grad_fn, mode="vmap")
    return ps, states, x0


def test_theta_below_the_disagreement_breaks_moniqua_and_above_it_tracks_dpsgd():
    def run(alg):
        ps, _, _ = _models_in_the_unit_box(alg)
        return np.asarray(ps["w"], np.float64)

    reference_ps, _, x0 = _models_in_the_unit_box(dpsgd.dpsgd(RING))
    reference = np.asarray(reference_ps["w"], np.float64)
    neighbor_gap = np.abs(x0 - np.roll(x0, 1, axis=0)).max()

    # Every model stays a convex combination of values in [-1, 1] (up to the
    # quantization error), so theta = 2.5 bounds all disagreements at all steps.
    good = modulo(8, 2.5)
    deviation = np.abs(run(moniqua.moniqua(RING, modulo(8, 2.5))) - reference)
    error = good.delta * good.modulus()  # Lemma 2: |x^ - x| <= delta B
    # One step: sum_j W_ij (eps_j - eps_i) with |eps| <= delta B, two neighbours of weight 1/3.
    assert deviation[:, 0].max() <= 4 / 3 * error + 1e-6
    assert deviation.max() <= 3 * error

    small = modulo(8, 0.25)
    assert neighbor_gap >= 0.25  # the premise of Lemma 2 is violated
    modulus = small.modulus()
    jumped = run(moniqua.moniqua(RING, modulo(8, 0.25))) - reference
    # After one step each neighbour's decode is off by a multiple of B (plus at
    # most delta B) and enters with weight 1/3: jumps by multiples of B / 3.
    multiples = jumped[:, 0] * 3 / modulus
    residual = np.abs(multiples - np.round(multiples)) * modulus / 3
    assert np.abs(np.round(multiples)).max() >= 1
    assert residual.max() <= 4 / 3 * small.delta * modulus + 1e-6
    assert np.abs(jumped).max(axis=(0, 2)).min() >= modulus / 3 * 0.9  # never recovers


def test_one_bit_moniqua_with_slack_converges_and_without_it_does_not():
    # Strongly convex f_i(x) = ||x - b_i||^2 / 2, a different optimum b_i per node
    # (spread 0.05 around a common point ~1 away), x* = mean b_i; models start at 0.
    rng = np.random.default_rng(11)
    d, steps, lr, theta = 20, 600, 0.05, 0.2
    common = rng.uniform(-1.0, 1.0, (1, d))
    b = (common + 0.05 * rng.uniform(-1.0, 1.0, (N, d))).astype(np.float32)
    optimum = b.astype(np.float64).mean(0)
    b_j = jnp.asarray(b)

    def grad_fn(p, node, t):
        return {"w": p["w"] - b_j[node]}

    def run(slack):
        tx = optax.chain(optax.sgd(lr), moniqua.moniqua(RING, modulo(1, theta), slack=slack))
        params = {"w": jnp.zeros((N, d), jnp.float32)}
        ps, _, _ = harness.run(tx, params, steps, grad_fn=grad_fn, mode="vmap")
        x = np.asarray(ps["w"], np.float64)
        gap = np.abs(x - np.roll(x, 1, axis=0)).max()  # over every step
        return gap, np.abs(x[:, -1].mean(0) - optimum).max(), np.abs(x[:, -1] - optimum).max()

    assert np.abs(optimum).max() > 4 * theta
    # With W' = 0.2 W + 0.8 I, neighbours stay within theta at every step (Lemma 2's
    # premise), so every decode is exact up to delta B and receiver-independent: the
    # exchange keeps the node average exactly, which reaches x*, and every node ends
    # in x*'s neighbourhood. One-bit nearest codes have a dead zone: nodes in the same
    # code cell (2 theta wide) do not pull each other, so the nodes end near their own
    # optima, not in exact consensus.
    gap, average_error, node_error = run(slack=0.2)
    assert gap < theta
    assert average_error < 1e-5
    assert node_error < theta / 2
    # With W itself each 1-bit jump (2 theta / 3 per neighbour) overshoots: decodes
    # wrap by B and the models never settle.
    gap, average_error, node_error = run(slack=1.0)
    assert gap > theta
    assert average_error > 1e-2
    assert node_error > theta


def test_one_bit_wire_bytes_per_edge_are_d_over_8_plus_a_flag_byte():
    params = {"a": jnp.zeros((N, 3, 7)), "b": jnp.zeros((N, 5)), "c": jnp.zeros((N, 64))}
    per_edge = sum(math.ceil(math.prod(v.shape[1:]) / 8) + 1 for v in params.values())
    assert per_edge == (3 + 1) + (1 + 1) + (8 + 1)
    comp = modulo(1, 0.5)
    assert sum(comp.wire_bytes(v[0].size) for v in params.values()) == per_edge
    payload = [comp.encode(v[0]) for v in params.values()]
    assert compress_base.payload_nbytes(payload) == per_edge

    tx = moniqua.moniqua(RING, modulo(1, 0.5), slack=0.5)
    mesh = jax.make_mesh((N,), (harness.AXIS,))
    spec = jax.P(harness.AXIS)

    def one_step(p):
        p = jax.tree.map(lambda x: x[0], p)
        updates, _ = tx.update(p, tx.init(p), p)
        return jax.tree.map(lambda x: x[None], updates)

    fn = jax.shard_map(one_step, mesh=mesh, in_specs=spec, out_specs=spec)
    placed = jax.device_put(params, jax.NamedSharding(mesh, spec))
    traffic = metrics.compiled_traffic(fn, placed)
    # A ring has two edge classes: every node sends its payload to two peers.
    assert traffic.ops() == {"collective-permute"}
    assert traffic.bytes_by_dtype == {("collective-permute", "u8"): 2 * per_edge}


def test_moniqua_ignores_a_non_finite_neighbor():
    x = np.full((N, 4), 0.25, np.float32)
    x[3, 1] = np.nan
    tx = moniqua.moniqua(RING, modulo(8, 1.0))
    ps, states, _ = harness.run(
        tx, {"w": jnp.asarray(x)}, 1, updates={"w": jnp.zeros((N, 1, 4))}, mode="vmap"
    )
    out = np.asarray(ps["w"][:, 0])
    others = np.arange(N) != 3
    # Node 3's neighbours take nothing from it: all their other inputs agree.
    np.testing.assert_allclose(out[others], 0.25, atol=1e-6)
    received = np.asarray(states.health.nonfinite_received[:, 0])
    np.testing.assert_array_equal(received, [0, 0, 1, 0, 1, 0, 0, 0])


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: moniqua.moniqua(RING, modulo(8), slack=0.0), ValueError, "slack"),
        (lambda: moniqua.moniqua(RING, modulo(8), slack=1.5), ValueError, "slack"),
        (lambda: moniqua.moniqua(RING, modulo(8), slack=True), ValueError, "slack"),
        (lambda: moniqua.moniqua(RING, modulo(8), theta=0.0), ValueError, "theta"),
        (lambda: moniqua.moniqua(RING, modulo(8), theta=-1.0), ValueError, "theta"),
        (lambda: moniqua.moniqua(RING, modulo(8), theta="1"), TypeError, "theta"),
        (lambda: moniqua.moniqua(RING, modulo(0)), ValueError, "bits"),
        (lambda: moniqua.moniqua(RING, modulo(9)), ValueError, "bits"),
        (
            lambda: moniqua.moniqua(
                topology.from_matrix([[0.5, 0.5, 0.0], [0.25, 0.5, 0.25], [0.0, 0.5, 0.5]]),
                modulo(8),
            ),
            ValueError,
            "doubly stochastic",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize(
    "tx",
    [
        moniqua.moniqua(RING, modulo(8)),
    ],
)
def test_missing_params_raise(tx):
    params = {"w": jnp.zeros((N, 3))}
    with pytest.raises(ValueError, match="parameters"):
        jax.vmap(lambda p: tx.update(p, tx.init(p)), axis_name="nodes")(params)


def _ring_neighbours_beyond(x, limit):
    """numpy: for each node, how many ring neighbours differ from it by more than `limit`."""
    gaps = [np.abs(x - np.roll(x, shift, axis=0)).max(axis=1) for shift in (1, -1)]
    return sum((g > limit).astype(int) for g in gaps)


def _one_moniqua_step(x, theta):
    tx = moniqua.moniqua(RING, modulo(8), theta=theta)
    zero = {"w": jnp.zeros((N, 1, x.shape[1]), jnp.float32)}
    _, states, _ = harness.run(tx, {"w": jnp.asarray(x)}, 1, updates=zero, mode="vmap")
    return np.asarray(states.health.theta_warnings[:, 0])


def test_theta_warnings_count_neighbours_further_than_half_theta(rng):
    theta, d = 1.0, 12
    # Node offsets along the ring: neighbour gaps of 0.1 or 0.7 theta (never near 0.5,
    # so Lemma 2's decode error, delta B < 0.004 theta at 8 bits, cannot move a count).
    offsets = np.array([0.0, 0.1, 0.8, 0.7, 0.8, 0.1, 0.0, 0.1]) * theta
    x = (rng.uniform(-3, 3, (1, d)) + offsets[:, None] * np.ones((N, d))).astype(np.float32)
    got = _one_moniqua_step(x, theta)
    expected = _ring_neighbours_beyond(x.astype(np.float64), theta / 2)
    print("warnings per node:", got, "expected:", expected)
    np.testing.assert_array_equal(got, expected)
    assert expected.sum() > 0 and (expected == 0).any()


def test_theta_warnings_stay_zero_with_a_margin_and_fire_when_theta_is_too_small():
    def warnings(theta):
        _, states, _ = _models_in_the_unit_box(moniqua.moniqua(RING, modulo(8), theta=theta))
        return int(np.asarray(states[1].health.theta_warnings[:, -1]).sum())

    # Models stay in [-1, 1], neighbours within 2: theta = 5 keeps a 2x margin throughout.
    assert warnings(5.0) == 0
    # theta = 0.25 is below the disagreement (the decodes wrap, see above): it shows.
    assert warnings(0.25) > N


def test_suggest_theta_is_twice_the_widest_neighbour_gap_and_silences_the_warnings(rng):
    d = 12
    x = rng.normal(0, 1, (N, d)).astype(np.float32)
    x64 = x.astype(np.float64)
    widest = max(np.abs(x64[i] - x64[(i + 1) % N]).max() for i in range(N))  # ring edges
    theta = lpdec.suggest_theta({"w": x}, RING)
    np.testing.assert_allclose(theta, 2 * widest, rtol=1e-12)
    np.testing.assert_allclose(lpdec.suggest_theta({"w": x}, RING, margin=3.0), 3 * widest)
    assert _one_moniqua_step(x, theta * 1.001).sum() == 0
    assert _one_moniqua_step(x, 0.9 * theta).sum() > 0
    # Time-varying topologies: the edges of every round count.
    pairs = lpdec.one_peer_exponential(N)
    widest_all = max(np.abs(x[i] - x[j]).max() for r in pairs.rounds for i, j in r.edges if i != j)
    np.testing.assert_allclose(lpdec.suggest_theta({"w": x}, pairs), 2 * widest_all)
    with pytest.raises(ValueError, match="margin"):
        lpdec.suggest_theta({"w": x}, RING, margin=1.0)
    with pytest.raises(ValueError, match="leading node axis of 8"):
        lpdec.suggest_theta({"w": x[:4]}, RING)
