"""Moniqua, D², naive quantized gossip and the gradient delay (seed 003) against numpy references.

The references are written from the seed's equations with explicit dense W
(float64 for the mixing arithmetic; `Topology.mixing_matrix` of ring, random
matching and one-peer exponential, which test_topology.py checks against their
definitions). Where they need quantized messages they call the same compressor
with the same per-node, per-leaf keys as the algorithms, so the comparison is
exact up to float32 rounding. The compressor is reused because the references
need the sender's exact codes: stochastic rounding needs the sender's random
bits, codes re-derived in float64 would move where a value sits on a float32
rounding tie (one code step, far above the tolerance), and a bit-exact float32
re-derivation is what test_kernels_pallas.py's numpy encode already is. The
compressors are pinned independently instead: `modulo` against numpy from its
formulas in test_compress.py (test_modulo_matches_numpy_from_the_formula) and
test_kernels_pallas.py, `minmax` against numpy in test_compress.py. The keys are not
the library's: `test_references.node_key` derives them from the documented
fold_in chain, which test_references.py pins `_common.node_key` to.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_references import node_key

import lpdec
from lpdec import metrics
from lpdec import testing as harness
from lpdec import topology
from lpdec.algorithms import choco
from lpdec.algorithms import d2
from lpdec.algorithms import delay
from lpdec.algorithms import dpsgd
from lpdec.algorithms import moniqua
from lpdec.algorithms import naive_quantized
from lpdec.compress import base as compress_base
from lpdec.compress import identity
from lpdec.compress import minmax
from lpdec.compress import modulo

N = 8
STEPS = 20
ATOL = 3e-6  # float32 arithmetic of the implementation vs float64 references, values O(1)

# ---------------------------------------------------------------------------
# Reference quantized messages: node j's payload at step t, decoded at node i.
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="comp")
def _decode_all(comp, x, key, t, theta):
    """x_hat[name][i, j] = decode(q_j, reference=x_i): node j's encode of x_j at step t.

    `key` is the shared key, t the step counted by the caller; node j's key for leaf
    k is split from `test_references.node_key(key, t, j)`. The compressor is lpdec's
    (see the module docstring for why, and which tests pin it).
    """
    names = sorted(x)  # jax.tree.flatten order of a dict: one key per leaf in this order
    kwargs = {} if theta is None else {"theta": theta}

    def encode(j):
        keys = jax.random.split(node_key(key, t, j), len(names))
        return [comp.encode(x[name][j], k, **kwargs) for name, k in zip(names, keys, strict=True)]

    payloads = jax.vmap(encode)(jnp.arange(N))

    def decode(i, j):
        return [
            comp.decode(jax.tree.map(lambda a: a[j], p), reference=x[name][i], **kwargs)
            for name, p in zip(names, payloads, strict=True)
        ]

    pairs = jax.vmap(jax.vmap(decode, (None, 0)), (0, None))(jnp.arange(N), jnp.arange(N))
    return dict(zip(names, pairs, strict=True))


def _f64(tree):
    return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def _mix(w, tree):
    """sum_j W_ij v_j for every leaf, in float64."""
    return {k: np.einsum("ij,j...->i...", w, v) for k, v in tree.items()}


def _consensus(w, x_hat):
    """sum_j W_ij (x^_{j|i} - x^_{i|i}) from the [i, j] decodes, in float64."""
    out = {}
    for k, v in _f64(x_hat).items():
        own = v[np.arange(N), np.arange(N)]
        out[k] = np.einsum("ij,ij...->i...", w, v - own[:, None])
    return out


def _add(*trees):
    return {k: sum(np.asarray(t[k], np.float64) for t in trees) for k in trees[0]}


# ---------------------------------------------------------------------------
# 1. Per-step dense check: from the implementation's x_t, recompute x_{t+1}.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One algorithm configuration and its reference step x_t -> x_{t+1}."""

    kind: str  # "moniqua", "naive" or "d2"
    topo: topology.Topology
    comp: compress_base.Compressor
    build: Callable[[], optax.GradientTransformation]
    slack: float = 1.0
    theta: Callable | None = None  # a θ schedule (moniqua), else the compressor's θ
    lossy: bool = True

    def mixing(self, t):
        w = self.topo.mixing_matrix(t)
        return self.slack * w + (1 - self.slack) * np.eye(N)


def _moniqua_case(topo, bits, theta, rounding, slack=1.0):
    schedule = theta if callable(theta) else None
    comp = modulo(bits, 1.0 if schedule else theta, rounding)
    return Case(
        "moniqua",
        topo,
        comp,
        lambda: moniqua.moniqua(
            topo, modulo(bits, 1.0, rounding), theta=theta, slack=slack, seed=3
        ),
        slack=slack,
        theta=schedule,
    )


RING = topology.ring(N)
LAZY_RING = RING.with_slack(0.5)
CASES = {
    "moniqua-8bit-nearest": _moniqua_case(RING, 8, 1.0, "nearest"),
    # θ halves at step 8: exercises a schedule evaluated on the traced step count.
    "moniqua-8bit-stochastic-schedule": _moniqua_case(
        RING, 8, optax.piecewise_constant_schedule(1.0, {8: 0.5}), "stochastic"
    ),
    "moniqua-2bit-nearest": _moniqua_case(RING, 2, 1.0, "nearest"),
    "moniqua-2bit-stochastic": _moniqua_case(RING, 2, 1.0, "stochastic"),
    # B = 4 theta = 1: models spread ~0.2 cross the code boundaries at +-0.25.
    "moniqua-1bit-slack": _moniqua_case(RING, 1, 0.25, "nearest", slack=0.5),
    "moniqua-random-matching": _moniqua_case(
        topology.random_matching(N, seed=5), 4, 0.8, "stochastic"
    ),
    "moniqua-one-peer-exponential": _moniqua_case(
        topology.one_peer_exponential(N), 8, 1.0, "nearest", slack=0.7
    ),
    "naive-minmax": Case(
        "naive",
        RING,
        minmax(8, "stochastic"),
        lambda: naive_quantized.naive_quantized(RING, minmax(8, "stochastic"), seed=1),
    ),
    "naive-identity": Case(
        "naive",
        RING,
        identity(),
        lambda: naive_quantized.naive_quantized(RING, identity()),
        lossy=False,
    ),
    "d2": Case("d2", LAZY_RING, identity(), lambda: d2.d2(LAZY_RING), lossy=False),
    "d2-modulo": Case(
        "d2",
        LAZY_RING,
        modulo(8, 0.5, "stochastic"),
        lambda: d2.d2(LAZY_RING, modulo(8, 0.5, "stochastic"), seed=2),
    ),
}


def _reference_step(case, t, x, x_prev, u, u_prev, key):
    """x_{t+1} from the seed's equations; returns (float64 tree, decodes or None)."""
    w = case.mixing(t)
    if case.kind == "moniqua":
        theta = None if case.theta is None else jnp.float32(case.theta(jnp.int32(t)))
        x_hat = _decode_all(case.comp, x, key, t, theta)
        return _add(x, _consensus(w, x_hat), u), x_hat
    if case.kind == "naive":
        # W_ii x_i + sum_{j != i} W_ij dec(Q(x_j)) + u_i (seed 003, eq. 4).
        x_hat = _decode_all(case.comp, x, key, t, None)
        off = w - np.diag(np.diag(w))
        new = {
            k: np.diag(w)[(...,) + (None,) * (x[k].ndim - 1)] * np.asarray(x[k], np.float64)
            + np.einsum("ij,ij...->i...", off, np.asarray(v, np.float64))
            for k, v in x_hat.items()
        }
        return _add(new, u), x_hat
    # D²: the half step is formed in float32 exactly as the implementation does, so
    # the quantizer sees the same input; the mixing is float64.
    half = {k: np.float32(2) * x[k] - x_prev[k] + u[k] - u_prev[k] for k in x}
    if case.comp == identity():
        return _mix(w, _f64(half)), None
    x_hat = _decode_all(case.comp, half, key, t, None)
    return _add(half, _consensus(w, x_hat)), x_hat


def _random_tree(rng, scale, lead=()):
    shapes = {"a": (3, 7), "b": (5,)}
    return {
        k: jnp.asarray(rng.normal(0.0, scale, (N, *lead, *s)), jnp.float32)
        for k, s in shapes.items()
    }


@pytest.mark.parametrize("mode", harness.MODES)
@pytest.mark.parametrize("name", list(CASES))
def test_each_step_matches_dense_reference(name, mode, rng):
    case = CASES[name]
    params = _random_tree(rng, 0.2)
    updates = _random_tree(rng, 0.02, lead=(STEPS,))
    ps, states, state0 = harness.run(case.build(), params, STEPS, updates=updates, mode=mode)
    ps, updates = harness.to_numpy(ps), harness.to_numpy(updates)
    key = jnp.asarray(np.asarray(state0.key)[0])  # shared by all nodes
    x_prev = x = harness.to_numpy(params)
    u_prev = {k: np.zeros_like(v) for k, v in x.items()}
    quantization_error = consensus = 0.0
    for t in range(STEPS):
        u = {k: v[:, t] for k, v in updates.items()}
        expected, x_hat = _reference_step(case, t, x, x_prev, u, u_prev, key)
        got = {k: v[:, t] for k, v in ps.items()}
        for k in got:
            np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=ATOL, err_msg=f"{k} t={t}")
            consensus = max(consensus, float(np.abs(expected[k] - x[k] - u[k]).max()))
        if x_hat is not None:
            sent = x
            if case.kind == "d2":
                sent = {k: 2 * x[k] - x_prev[k] + u[k] - u_prev[k] for k in x}
            for k, v in x_hat.items():
                err = np.abs(np.asarray(v) - np.asarray(sent[k])[None]).max()
                quantization_error = max(quantization_error, float(err))
        x_prev, x, u_prev = x, got, u
    assert np.all(np.asarray(states.count)[:, -1] == STEPS)
    # The mixing moved the models far beyond the tolerance, so W (slack, round) matters.
    assert consensus > 100 * ATOL
    if case.lossy:
        # The quantization is visible far above the tolerance: a reference (or an
        # implementation) that skipped it could not pass.
        assert quantization_error > 100 * ATOL


# ---------------------------------------------------------------------------
# 2. Free-running float64 simulations: D², and D² / D-PSGD with stale gradients.
# ---------------------------------------------------------------------------


def _quadratics(rng, d):
    """f_i(x) = a_i ||x - b_i||^2 / 2 with a different curvature and optimum per node."""
    a = rng.uniform(0.5, 1.5, (N, 1)).astype(np.float32)
    b = rng.uniform(-1.0, 1.0, (N, d)).astype(np.float32)
    a_j, b_j = jnp.asarray(a), jnp.asarray(b)

    def grad_fn(params, node, t):
        del t
        return {"w": a_j[node] * (params["w"] - b_j[node])}

    optimum = (a.astype(np.float64) * b).sum(0) / a.sum()
    return a.astype(np.float64), b.astype(np.float64), grad_fn, optimum


def _simulate(kind, w, a, b, x0, lr, steps, staleness=0):
    """float64 D² or D-PSGD whose update at step k is -lr * grad f_i(x_{k - staleness})."""
    xs, grads = [], []
    x = x_prev = x0.copy()
    u_prev = np.zeros_like(x0)
    for k in range(steps):
        grads.append(a * (x - b))
        u = -lr * grads[k - staleness] if k >= staleness else np.zeros_like(x)
        if kind == "d2":
            half = 2 * x - x_prev + u - u_prev
            x_prev, u_prev, x = x, u, w @ half
        else:
            x = w @ x + u
        xs.append(x)
    return np.stack(xs, axis=1)


@pytest.mark.parametrize(
    ("kind", "staleness", "mode"),
    [("d2", 0, "shard_map"), ("d2", 2, "vmap"), ("dpsgd", 2, "shard_map")],
)
def test_free_running_matches_float64_simulation(kind, staleness, mode, rng):
    a, b, grad_fn, _ = _quadratics(rng, 6)
    x0 = rng.normal(0.0, 0.5, (N, 6)).astype(np.float32)
    lr = 0.1
    alg = d2.d2(LAZY_RING) if kind == "d2" else dpsgd.dpsgd(LAZY_RING)
    tx = optax.chain(optax.sgd(lr), delay.delay(staleness), alg)
    ps, _, _ = harness.run(tx, {"w": jnp.asarray(x0)}, STEPS, grad_fn=grad_fn, mode=mode)
    expected = _simulate(
        kind, LAZY_RING.mixing_matrix(), a, b, x0.astype(np.float64), lr, STEPS, staleness
    )
    np.testing.assert_allclose(np.asarray(ps["w"]), expected, rtol=0, atol=2e-5)
    if staleness:
        fresh = _simulate(kind, LAZY_RING.mixing_matrix(), a, b, x0.astype(np.float64), lr, STEPS)
        assert np.abs(fresh - expected).max() > 1e-2  # the delay is visible


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


# ---------------------------------------------------------------------------
# 3. Theorem 1: naive quantization stalls above a floor; Moniqua and CHOCO do not.
# ---------------------------------------------------------------------------


@compress_base.payload_dataclass(data=("codes",))
class LatticePayload:
    codes: jax.Array
    shape: tuple[int, ...]
    dtype: jnp.dtype


@dataclasses.dataclass(frozen=True)
class Lattice(compress_base.Compressor):
    """Theorem 1's premise: an unbiased linear quantizer on the fixed points {delta n}.

    `lpdec.minmax` does not realise it: its grid spans each chunk's [min, max],
    so it shrinks as the models agree and naive gossip with it converges (on
    this problem it reaches E||grad||^2 < 1e-7). Stochastic rounding to delta Z:
    floor, plus delta with probability equal to the fraction.
    """

    delta: float = 1.0

    @property
    def needs_key(self):
        return True

    def encode(self, x, key=None):
        scaled = x.astype(jnp.float32) / self.delta
        low = jnp.floor(scaled)
        up = jax.random.uniform(key, x.shape) < scaled - low
        return LatticePayload((low + up).astype(jnp.int32), tuple(x.shape), x.dtype)

    def decode(self, payload, *, reference=None, key=None):
        del reference, key
        return (payload.codes.astype(jnp.float32) * self.delta).astype(payload.dtype)

    def wire_bytes(self, num_elements, dtype=jnp.float32):
        del dtype
        return 4 * num_elements

    def is_finite(self, payload):
        del payload
        return jnp.bool_(True)


def test_theorem1_naive_quantization_stays_above_the_floor():
    # Seed 003, Theorem 1 (the text extraction drops symbols; reconstructed as):
    # with an unbiased linear quantizer of representable points {delta n} on
    # f(x) = (x - (delta/2) 1)^T (x - (delta/2) 1) / 2 (the extraction's
    # "x - - 1/2" is "x - delta 1/2": the optimum sits midway between two grid
    # points), for every step size, iteration k and node i,
    #   E ||grad f(x_{k,i})||^2 >= delta^2 rho^2 / (8 (1 + rho^2)),
    # rho the smallest non-zero entry of W (1/3 on ring(8)). The mechanism is per
    # coordinate: node i's next model carries W_ij^2 Var(Q(x_j)) >= rho^2 (delta^2/4
    # - (x_j - delta/2)^2) of rounding noise from each neighbour j, large unless x_j
    # is far from the optimum. The coordinates evolve independently and alike (the
    # lattice rounds each one independently), so they are d copies of the 1-D
    # problem, and their mean estimates E (df/dx)^2 of one copy; checking it against
    # the floor is stronger than checking E ||grad f||^2 (d times larger). delta = 1
    # gives f(x) = ||x - 1/2||^2 / 2. One leaf per step size, each with gradient
    # lr * (x - 1/2) under sgd(1): independent experiments in one run.
    delta, rho = 1.0, 1.0 / 3.0
    floor = delta**2 * rho**2 / (8 * (1 + rho**2))
    lrs = (0.5, 0.2, 0.05, 0.02)
    d, steps = 128, 400
    params = {f"lr{i}": jnp.zeros((N, d), jnp.float32) for i in range(len(lrs))}

    def grad_fn(p, node, t):
        del node, t
        return {f"lr{i}": lr * (p[f"lr{i}"] - delta / 2) for i, lr in enumerate(lrs)}

    def mean_sq_grad(alg):
        ps, _, _ = harness.run(
            optax.chain(optax.sgd(1.0), alg), params, steps, grad_fn=grad_fn, mode="vmap"
        )
        # [leaf, node, step]: mean over coordinates.
        return np.stack([np.mean((np.asarray(ps[k], np.float64) - delta / 2) ** 2, -1) for k in ps])

    naive = mean_sq_grad(naive_quantized.naive_quantized(RING, Lattice(delta)))
    assert naive.min() > floor, (naive.min(), floor)  # every step size, node and step
    for alg in (
        moniqua.moniqua(RING, modulo(8, 0.5, "stochastic")),
        choco.choco(RING, minmax(8, "stochastic"), gamma=1.0),
    ):
        tail = mean_sq_grad(alg)[:, :, -50:].mean(-1)
        assert tail.max() < floor / 100, (tail.max(), floor)


# ---------------------------------------------------------------------------
# 4. Lemma 2: |x_i - x_j| < theta is what makes the modulo decode right.
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# 5. One bit per parameter with the slack matrix of Theorem 3.
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# 6. D²: the eigenvalue condition, and exact convergence under heterogeneous data.
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Non-finite neighbours and bad inputs.
# ---------------------------------------------------------------------------


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
        (lambda: delay.delay(-1), ValueError, "steps"),
        (lambda: delay.delay(1.5), TypeError, "steps"),
        (lambda: d2.d2(topology.directed_ring(N)), ValueError, "symmetric"),
        (lambda: d2.d2(topology.random_matching(N, seed=0)), ValueError, "static"),
        (lambda: d2.d2(LAZY_RING, "modulo"), TypeError, "compressor"),
        (
            lambda: naive_quantized.naive_quantized(RING, modulo(8)),
            TypeError,
            "moniqua",
        ),
        (lambda: naive_quantized.naive_quantized(RING, "minmax"), TypeError, "compressor"),
    ],
)
def test_bad_arguments_raise_clear_errors(build, error, message):
    with pytest.raises(error, match=message):
        build()


@pytest.mark.parametrize(
    "tx",
    [
        moniqua.moniqua(RING, modulo(8)),
        d2.d2(LAZY_RING),
        naive_quantized.naive_quantized(RING, identity()),
    ],
)
def test_missing_params_raise(tx):
    params = {"w": jnp.zeros((N, 3))}
    with pytest.raises(ValueError, match="parameters"):
        jax.vmap(lambda p: tx.update(p, tx.init(p)), axis_name="nodes")(params)


# ---------------------------------------------------------------------------
# 6. θ warnings in Health, and suggest_theta.
# ---------------------------------------------------------------------------


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
