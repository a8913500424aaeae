"""What the tests of Moniqua, D², naive quantized gossip and the gradient delay share
(tests/test_moniqua.py, test_d2.py, test_naive_quantized.py, test_delay.py): the
numpy references of seed 003 and the checks they go through.

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
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from test_references import node_key

from lpdec import testing as harness
from lpdec import topology
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


def check_each_step_matches_dense_reference(name, mode, rng):
    """Case `name` step by step: x_{t+1} recomputed from the implementation's x_t."""
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


def check_free_running_matches_float64_simulation(kind, staleness, mode, rng):
    """D² or D-PSGD (`kind`) on updates `staleness` steps old against `_simulate`."""
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
