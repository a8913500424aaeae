"""lpdec.async_sim (AD-PSGD and Moniqua on AD-PSGD, seed 003 section 5) against a dense
float64 numpy simulation of the paper's recursion, run on the same numpy schedule:

  X_{k+1} = X_k W_k + (X^_k - X_k)(W_k - I) - alpha_k G~_k(X_{k - tau_k}),

with the workers' models as the columns of X, W_k = I - (e_i - e_j)(e_i - e_j)^T / 2
built as a dense matrix, and the stale gradient read from the reference's own list of
past X. For Moniqua the reference takes the simulator's X_k at every iteration (as
tests/_moniqua_reference.py does) and calls lpdec.modulo for the codes, whose encode
and decode test_compress.py pins to numpy from their formulas; column c's X^ is every
model decoded against x_c. Also: the schedule's statistics, the one-line errors, and
the mixing-time quantities against brute force on tiny graphs.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpdec
from lpdec import async_sim

N = 8
D = {"a": (3,), "b": (2, 2)}  # two leaves: one key split per leaf


def _problem(rng):
    """Per-worker quadratics f_i(x) = a_i ||x - b_i||^2 / 2 on every leaf."""
    a = rng.uniform(0.5, 1.5, N)
    b = {k: rng.uniform(-1.0, 1.0, (N, *s)) for k, s in D.items()}
    a32, b32 = jnp.asarray(a, jnp.float32), {k: jnp.asarray(v, jnp.float32) for k, v in b.items()}

    def grad_fn(x, i, k):
        del k
        return {name: a32[i] * (x[name] - b32[name][i]) for name in x}

    x0 = {k: rng.normal(0.0, 0.3, (N, *s)).astype(np.float32) for k, s in D.items()}
    return a, b, grad_fn, x0


def _edge_matrix(i, j):
    w = np.eye(N)
    w[[i, i, j, j], [i, j, i, j]] = 0.5
    return w


def _columns(tree):
    """The models as the columns of a [d, n] float64 matrix, leaves concatenated."""
    return np.concatenate([np.asarray(tree[k], np.float64).reshape(N, -1) for k in D], 1).T


def _reference(schedule, x0, a, b, lr, steps, momentum=0.0, decay=0.0):
    """Full-precision AD-PSGD in float64: returns X_steps ([d, n])."""
    bcol = _columns(b)
    xs = [_columns(x0)]
    m = np.zeros_like(xs[0])
    for k in range(steps):
        i, j, tau = schedule.worker[k], schedule.peer[k], schedule.delay[k]
        stale = xs[k - tau][:, i]
        g = a[i] * (stale - bcol[:, i]) + decay * stale
        m[:, i] = momentum * m[:, i] + g
        update = np.zeros_like(xs[k])
        update[:, i] = lr(k) * m[:, i]
        xs.append(xs[k] @ _edge_matrix(i, j) - update)
    return xs[-1]


def _lr(k):
    return 0.1 if k < 30 else 0.05


LR = optax.piecewise_constant_schedule(0.1, {30: 0.5})


@pytest.mark.parametrize(
    "topology,speeds,delays,local",
    [
        ("ring", (1.0,) * 4 + (0.25,) * 4, "speeds", False),
        ("complete", None, "uniform", True),
    ],
)
def test_full_precision_matches_dense_float64_recursion(topology, speeds, delays, local, rng):
    topo = lpdec.ring(N) if topology == "ring" else lpdec.complete(N)
    a, b, grad_fn, x0 = _problem(rng)
    steps, tau_max = 60, 6
    schedule = async_sim.ad_psgd_schedule(
        topo, steps, max_delay=tau_max, speeds=speeds, delays=delays, seed=4
    )
    momentum, decay = (0.9, 0.01) if local else (0.0, 0.0)
    transform = (
        optax.chain(optax.add_decayed_weights(decay), optax.trace(momentum)) if local else None
    )
    params = {k: jnp.asarray(v) for k, v in x0.items()}
    state = async_sim.init(params, max_delay=tau_max, local_transform=transform)
    got, state = async_sim.run(params, state, schedule, grad_fn, LR, local_transform=transform)
    expected = _reference(schedule, x0, a, b, _lr, steps, momentum, decay)
    np.testing.assert_allclose(_columns(got), expected, rtol=0, atol=2e-6)
    assert int(state.iteration) == steps
    assert schedule.delay.max() > 1
    # The delay is visible: the same schedule with fresh gradients ends elsewhere, far
    # beyond the tolerance (500x; the schedule's draws differ between numpy versions).
    fresh = async_sim.Schedule(
        schedule.worker, schedule.peer, 0 * schedule.delay, tau_max, schedule.num_workers
    )
    fresh_x = _reference(fresh, x0, a, b, _lr, steps, momentum, decay)
    assert np.abs(fresh_x - expected).max() > 1e-3


def _decode_matrix(comp, x, key, k, workers):
    """xhat[c, src]: worker src's model encoded at iteration k, decoded against x_c, for src, c
    in `workers`; keys fold_in(fold_in(key, k), src), one split per leaf (sorted names)."""
    out = {}
    for src in workers:
        keys = jax.random.split(jax.random.fold_in(jax.random.fold_in(key, k), src), len(D))
        payloads = [
            comp.encode(jnp.asarray(x[n][src]), kk) for n, kk in zip(sorted(D), keys, strict=True)
        ]
        for c in workers:
            out[c, src] = np.concatenate(
                [
                    np.asarray(comp.decode(p, reference=jnp.asarray(x[n][c])), np.float64).ravel()
                    for n, p in zip(sorted(D), payloads, strict=True)
                ]
            )
    return out


@pytest.mark.parametrize("bits,rounding", [(8, "nearest"), (4, "stochastic")])
def test_moniqua_matches_dense_float64_recursion_step_by_step(bits, rounding, rng):
    topo = lpdec.ring(N)
    comp = lpdec.modulo(bits, 1.0, rounding)
    a, b, grad_fn, x0 = _problem(rng)
    bcol = _columns(b)
    steps, tau_max = 40, 4
    schedule = async_sim.ad_psgd_schedule(
        topo, steps, max_delay=tau_max, speeds=np.arange(1.0, N + 1), delays="speeds", seed=2
    )
    params = {k: jnp.asarray(v) for k, v in x0.items()}
    state = async_sim.init(params, max_delay=tau_max, seed=7)
    key = jnp.asarray(state.key)
    history = [_columns(params)]
    noise = moved = skipped_correction = 0.0
    for k in range(steps):
        i, j, tau = int(schedule.worker[k]), int(schedule.peer[k]), int(schedule.delay[k])
        x = {n: np.asarray(v) for n, v in params.items()}
        params, state = async_sim.run(
            params, state, schedule.chunk(k, k + 1), grad_fn, LR, compressor=comp
        )
        xk = history[k]
        xhat = _decode_matrix(comp, x, key, k, (i, j))
        w_minus_i = _edge_matrix(i, j) - np.eye(N)
        expected = xk.copy()
        for c in (i, j):  # columns of X^(W - I), each decoded against x_c
            expected[:, c] += sum(xhat[c, src] * w_minus_i[src, c] for src in (i, j))
        expected[:, i] -= _lr(k) * a[i] * (history[k - tau][:, i] - bcol[:, i])
        got = _columns(params)
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, err_msg=f"k={k}")
        history.append(got)
        noise = max(noise, np.abs(xhat[i, j] - xk[:, j]).max())
        moved = max(moved, np.abs(got[:, j] - xk[:, j]).max())
        # Without the correction term (x_i in place of x^_(i|i)) the step would differ.
        uncorrected = xk[:, j] + (xhat[j, i] - xk[:, j]) / 2
        skipped_correction = max(skipped_correction, np.abs(uncorrected - got[:, j]).max())
    assert noise > 1e-4 and moved > 1e-2 and skipped_correction > 1e-4


@pytest.mark.parametrize("compressed", [False, True])
def test_cpu_iteration_programs_agree_with_one_scan_and_leave_the_callers_arrays(compressed, rng):
    """On CPU `run` calls one program per iteration (XLA:CPU runs loops' convolutions
    slowly); elsewhere one scan (`_scan`, called here directly). The two agree, and the
    caller's params and state (the per-iteration programs donate theirs) stay usable."""
    a, b, grad_fn, x0 = _problem(rng)
    del a, b
    comp = lpdec.modulo(8, 1.0, "stochastic") if compressed else None
    schedule = async_sim.ad_psgd_schedule(lpdec.ring(N), 30, max_delay=3, seed=4)
    params = {k: jnp.asarray(v) for k, v in x0.items()}
    state = async_sim.init(params, max_delay=3, seed=5)
    looped, looped_state = async_sim.run(params, state, schedule, grad_fn, LR, compressor=comp)
    rows = [jnp.asarray(r, jnp.int32) for r in (schedule.worker, schedule.peer, schedule.delay)]
    scanned, scanned_state = async_sim._scan(params, state, *rows, grad_fn, LR, comp, None)
    for name in D:
        np.testing.assert_allclose(looped[name], scanned[name], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(params[name], x0[name])  # not donated
    assert int(looped_state.iteration) == int(scanned_state.iteration) == 30
    assert int(state.iteration) == 0
    assert not np.array_equal(looped["a"], x0["a"])


def test_schedule_follows_speeds_neighbours_and_delay_bounds():
    speeds = (1.0,) * 4 + (0.25,) * 4
    total = 40000
    s = async_sim.ad_psgd_schedule(lpdec.ring(N), total, max_delay=30, speeds=speeds, seed=1)
    p = np.asarray(speeds) / sum(speeds)
    freq = np.bincount(s.worker, minlength=N) / total
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(p.max() / total))
    assert set(np.unique((s.peer - s.worker) % N)) == {1, N - 1}
    assert abs(np.mean((s.peer - s.worker) % N == 1) - 0.5) < 0.01
    k = np.arange(total)
    assert np.all(s.delay >= 0) and np.all(s.delay <= np.minimum(k, 30))
    assert np.unique(s.delay[100:]).tolist() == list(range(31))  # uniform on 0..30
    assert abs(s.delay[100:].mean() - 15) < 0.3

    # Delays from the speeds: iterations since the worker's previous update, capped.
    d = async_sim.ad_psgd_schedule(
        lpdec.complete(N), 5000, max_delay=25, speeds=speeds, delays="speeds", seed=3
    )
    last, expected = {}, []
    for step, i in enumerate(d.worker):
        expected.append(min(step - last.get(i, -1) - 1, 25))
        last[i] = step
    np.testing.assert_array_equal(d.delay, expected)
    slow, fast = d.delay[d.worker >= 4], d.delay[d.worker < 4]
    assert slow.mean() > 2.5 * fast.mean()  # slow workers apply staler gradients
    np.testing.assert_array_equal(
        d.worker,
        async_sim.ad_psgd_schedule(
            lpdec.complete(N), 5000, max_delay=25, speeds=speeds, delays="speeds", seed=3
        ).worker,
    )


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: async_sim.ad_psgd_schedule(lpdec.ring(4), 10, max_delay=-1), "max_delay"),
        (lambda: async_sim.ad_psgd_schedule(lpdec.ring(4), 10, max_delay=1.5), "max_delay"),
        (lambda: async_sim.ad_psgd_schedule(lpdec.ring(4), 0, max_delay=1), "num_iterations"),
        (
            lambda: async_sim.ad_psgd_schedule(lpdec.ring(4), 10, max_delay=1, speeds=(1, 0, 1, 1)),
            "speeds",
        ),
        (
            lambda: async_sim.ad_psgd_schedule(lpdec.ring(4), 10, max_delay=1, speeds=(1, 1)),
            "speeds",
        ),
        (lambda: async_sim.ad_psgd_schedule(lpdec.complete(1), 10, max_delay=1), "no edges"),
        (
            lambda: async_sim.ad_psgd_schedule(lpdec.random_matching(4, 0), 10, max_delay=1),
            "static",
        ),
        (lambda: async_sim.ad_psgd_schedule(lpdec.directed_ring(4), 10, max_delay=1), "directed"),
        (
            lambda: async_sim.ad_psgd_schedule(lpdec.ring(4), 10, max_delay=1, delays="poisson"),
            "delays",
        ),
        (lambda: async_sim.mixing_time(np.eye(2), eps=2.0), "eps"),
        (lambda: async_sim.init({"w": jnp.zeros((4, 2))}, max_delay=-2), "max_delay"),
    ],
)
def test_bad_inputs_raise_one_line(call, match):
    with pytest.raises(ValueError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_run_rejects_a_schedule_that_does_not_fit_the_state():
    params = {"w": jnp.zeros((4, 2))}
    state = async_sim.init(params, max_delay=2)
    other = async_sim.ad_psgd_schedule(lpdec.ring(5), 3, max_delay=1)
    with pytest.raises(ValueError, match="5 workers"):
        async_sim.run(params, state, other, lambda x, i, k: x, 0.1)
    deeper = async_sim.ad_psgd_schedule(lpdec.ring(4), 3, max_delay=3)
    with pytest.raises(ValueError, match="max_delay 3"):
        async_sim.run(params, state, deeper, lambda x, i, k: x, 0.1)
    fitting = async_sim.ad_psgd_schedule(lpdec.ring(4), 3, max_delay=2)
    with pytest.raises(TypeError, match="modulo"):
        async_sim.run(params, state, fitting, lambda x, i, k: x, 0.1, compressor=lpdec.minmax(8))


def _choices(topology, speeds):
    """Every (probability, W) an iteration can draw, enumerated from the definitions."""
    n = topology.num_nodes
    w = topology.mixing_matrix()
    p = np.asarray(speeds, np.float64) / np.sum(speeds)
    out = []
    for i in range(n):
        nbrs = [j for j in range(n) if j != i and w[i, j] > 0]
        for j in nbrs:
            e = np.zeros(n)
            e[i], e[j] = 1.0, -1.0
            out.append((p[i] / len(nbrs), np.eye(n) - np.outer(e, e) / 2))
    return out


def _worst_l1_on_grid(m):
    """max over a grid of the 3-simplex (vertices included) of ||M mu - 1/3||_1."""
    grid = [(u / 40, v / 40, 1 - (u + v) / 40) for u in range(41) for v in range(41 - u)]
    return max(np.abs(m @ np.asarray(mu) - 1 / 3).sum() for mu in grid)


@pytest.mark.parametrize("eps", [0.5, 0.25])
def test_mixing_time_of_expected_w_matches_brute_force(eps):
    topo, speeds = lpdec.complete(3), (1.0, 2.0, 4.0)
    choices = _choices(topo, speeds)
    t_brute = None
    for t in range(1, 7):
        expected = np.zeros((3, 3))
        for seq in itertools.product(choices, repeat=t):  # E[W_t ... W_1], every sequence
            prob, product = 1.0, np.eye(3)
            for q, w in seq:
                prob, product = prob * q, w @ product
            expected += prob * product
        np.testing.assert_allclose(
            np.linalg.matrix_power(async_sim.expected_mixing_matrix(topo, speeds), t),
            expected,
            atol=1e-12,
        )
        if t_brute is None and _worst_l1_on_grid(expected) <= eps:
            t_brute = t
    assert t_brute is not None and t_brute > 1
    assert async_sim.mixing_time(async_sim.expected_mixing_matrix(topo, speeds), eps) == t_brute


def test_window_mixing_times_match_dense_products():
    topo = lpdec.ring(6)
    s = async_sim.ad_psgd_schedule(topo, 400, max_delay=0, speeds=(1, 2, 3, 1, 2, 3), seed=5)
    starts = np.arange(0, 200, 17)
    got = async_sim.window_mixing_times(s, starts=starts)
    for start, t_got in zip(starts, got, strict=True):
        product, t_brute = np.eye(6), -1
        for t in range(1, 400 - start + 1):
            i, j = s.worker[start + t - 1], s.peer[start + t - 1]
            e = np.zeros(6)
            e[i], e[j] = 1.0, -1.0
            product = (np.eye(6) - np.outer(e, e) / 2) @ product
            if np.abs(product - 1 / 6).sum(axis=0).max() <= 0.5:
                t_brute = t
                break
        assert t_got == t_brute
    assert got.min() > 5
    w = async_sim.expected_mixing_matrix(topo, (1, 2, 3, 1, 2, 3))
    assert async_sim.mixing_time(w) <= np.median(got)  # Jensen: E[W] mixes no slower
    assert async_sim.mixing_time(w) <= async_sim.mixing_time_bound(async_sim.spectral_gap(w), 6)
