"""lpdec.diloco against a dense numpy simulation of H local steps and the outer step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpdec
from lpdec import testing

N, D = 8, 6
INNER_LR, INNER_MU = 0.05, 0.9
OUTER_LR, OUTER_MU = 0.7, 0.9


@pytest.fixture
def problem(rng):
    """Per-node quadratics f_i(x) = 0.5 x^T A_i x - b_i^T x (gradients A_i x - b_i)."""
    q = rng.normal(size=(N, D, D))
    a = np.einsum("nij,nkj->nik", q, q) / D + np.eye(D)
    b = rng.normal(size=(N, D))
    x0 = rng.normal(size=(N, D)).astype(np.float32)
    return a.astype(np.float32), b.astype(np.float32), x0


def _grad_fn(a, b):
    a, b = jnp.asarray(a), jnp.asarray(b)

    def grad_fn(params, node, step):
        del step
        return {"w": a[node] @ params["w"] - b[node]}

    return grad_fn


class _Momentum:
    """optax.sgd(lr, momentum=mu, nesterov=...) in numpy float64, one row per node."""

    def __init__(self, lr, mu, nesterov, shape):
        self.lr, self.mu, self.nesterov = lr, mu, nesterov
        self.v = np.zeros(shape)

    def __call__(self, g):
        self.v = g + self.mu * self.v
        direction = g + self.mu * self.v if self.nesterov else self.v
        return -self.lr * direction


def _reference(a, b, x0, steps, h, *, exchange="mean", w=None, overlap=False, sync=0):
    """Parameters after every step [N, steps, D], float64.

    sync: the first `sync` steps each end with every node on the exact mean of the
    nodes' parameters (a synchronous warm-up); the rounds of h steps begin after them.

    exchange="mean": Δ averaged over the nodes, then one outer Nesterov step on
    the shared anchor. exchange="gossip": each node's outer step with its own
    Δ_i, then its anchor replaced by sum_j W_ij (its neighbours' anchors after
    their outer steps), as D-PSGD applies: x_i+ = sum_j W_ij x_j + u_i.
    """
    a, b = a.astype(np.float64), b.astype(np.float64)
    x = x0.astype(np.float64).copy()
    anchor = x.copy()
    start = x.copy()
    pending = np.zeros_like(x)
    inner = _Momentum(INNER_LR, INNER_MU, False, x.shape)
    outer = _Momentum(OUTER_LR, OUTER_MU, True, x.shape)
    out, rounds = [], 0
    mixing = w if callable(w) else (lambda r: w)
    for t in range(steps):
        g = np.einsum("nij,nj->ni", a, x) - b
        x = x + inner(g)
        if t < sync:
            x = np.broadcast_to(x.mean(axis=0), x.shape).copy()
            anchor, start = x.copy(), x.copy()
        elif (t + 1 - sync) % h == 0:
            delta = (start if overlap else anchor) - x
            if exchange == "mean":
                o = outer(np.broadcast_to(delta.mean(axis=0), delta.shape))
            else:  # gossip: D-PSGD mixes the anchors, then adds the outer update
                o = mixing(rounds) @ anchor + outer(delta) - anchor
            rounds += 1
            if overlap:
                anchor = anchor + pending
                x = anchor + (x - start)
                start, pending = x.copy(), o
            else:
                anchor = anchor + o
                x = anchor.copy()
        out.append(x.copy())
    return np.stack(out, axis=1)


def _tx(h, exchange, overlap=False, axis=testing.AXIS):
    inner = optax.sgd(INNER_LR, momentum=INNER_MU)
    outer_opt = optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True)
    if exchange == "mean":
        outer = optax.chain(lpdec.local_mean(axis_name=axis), outer_opt)
    elif exchange == "cmean_identity":
        outer = optax.chain(lpdec.compressed_mean(lpdec.identity(), axis_name=axis), outer_opt)
    else:
        outer = optax.chain(outer_opt, lpdec.dpsgd(lpdec.ring(N), axis_name=axis))
    return lpdec.diloco(inner, outer, local_steps=h, overlap=overlap, axis_name=axis)


@pytest.mark.parametrize("mode", testing.MODES)
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("exchange", ["mean", "cmean_identity", "gossip"])
def test_diloco_matches_numpy_simulation(problem, mode, overlap, exchange):
    a, b, x0 = problem
    h, steps = 3, 13  # 4 exchanges and one step into the fifth round
    tx = _tx(h, exchange, overlap)
    ps, _, _ = testing.run(tx, {"w": x0}, steps, grad_fn=_grad_fn(a, b), mode=mode)
    # ring(8)'s W is checked against its definition in test_topology.py.
    w = np.asarray(lpdec.ring(N).mixing_matrix(0), np.float64)
    ref = _reference(
        a,
        b,
        x0,
        steps,
        h,
        exchange="gossip" if exchange == "gossip" else "mean",
        w=w,
        overlap=overlap,
    )
    np.testing.assert_allclose(np.asarray(ps["w"]), ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_synchronous_warm_up_averages_every_step_then_rounds_begin(problem, overlap):
    a, b, x0 = problem
    x0 = np.broadcast_to(x0[:1], x0.shape).copy()  # one model, as training starts
    sync, h, steps = 4, 3, 14  # 4 warm-up steps, 3 rounds, one step into the fourth
    axis = testing.AXIS
    outer = optax.chain(
        lpdec.local_mean(axis_name=axis), optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True)
    )
    tx = lpdec.diloco(
        optax.sgd(INNER_LR, momentum=INNER_MU),
        outer,
        local_steps=h,
        overlap=overlap,
        sync_steps=sync,
        sync=optax.chain(lpdec.local_mean(axis_name=axis), optax.sgd(1.0)),
        axis_name=axis,
    )
    ps, _, _ = testing.run(tx, {"w": x0}, steps, grad_fn=_grad_fn(a, b), mode="shard_map")
    ref = _reference(a, b, x0, steps, h, overlap=overlap, sync=sync)
    np.testing.assert_allclose(np.asarray(ps["w"]), ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sync_steps": 3}, "sync .* is needed exactly when sync_steps > 0"),
        ({"sync": optax.sgd(1.0)}, "sync .* is needed exactly when sync_steps > 0"),
        ({"sync_steps": -1, "sync": optax.sgd(1.0)}, "sync_steps must be an int >= 0"),
    ],
)
def test_a_warm_up_needs_its_steps_and_its_exchange(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lpdec.diloco(optax.sgd(0.1), optax.sgd(0.7), local_steps=2, **kwargs)


def test_diloco_gossips_with_a_new_random_peer_every_round(problem):
    """With a time-varying topology the gossip uses W of the exchange round, not of the step."""
    a, b, x0 = problem
    topology = lpdec.random_matching(N, seed=3)
    outer = optax.chain(
        optax.sgd(OUTER_LR, momentum=OUTER_MU, nesterov=True),
        lpdec.dpsgd(topology, axis_name=testing.AXIS),
    )
    tx = lpdec.diloco(
        optax.sgd(INNER_LR, momentum=INNER_MU), outer, local_steps=2, axis_name=testing.AXIS
    )
    ps, _, _ = testing.run(tx, {"w": x0}, 12, grad_fn=_grad_fn(a, b), mode="shard_map")

    def w(round_):
        # Random matchings are checked to be symmetric, doubly stochastic perfect
        # matchings with the ppermute schedules they describe in test_topology.py.
        return np.asarray(topology.mixing_matrix(round_), np.float64)

    ref = _reference(a, b, x0, 12, 2, exchange="gossip", w=w)
    np.testing.assert_allclose(np.asarray(ps["w"]), ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bad", ["nan_gradient", "overflow"])
def test_a_nonfinite_inner_step_is_skipped(problem, overlap, bad):
    """Node 3 gets a NaN gradient at step 4, or gradients of 3.4e38 at steps 3 and 4 (its
    momentum, then its parameters, would overflow at step 4). It skips that one step
    (its parameters stay where they were), no model ever holds NaN/Inf, and the skip is
    counted on node 3 only."""
    a, b, x0 = problem
    grad = _grad_fn(a, b)
    first = 4 if bad == "nan_gradient" else 3
    value = jnp.nan if bad == "nan_gradient" else jnp.float32(3.4e38)

    def grad_fn(params, node, step):
        g = grad(params, node, step)
        hit = (node == 3) & (step >= first) & (step <= 4)
        return jax.tree.map(lambda x: jnp.where(hit, value, x), g)

    ps, states, _ = testing.run(_tx(3, "mean", overlap), {"w": x0}, 9, grad_fn=grad_fn)
    w = np.asarray(ps["w"])
    assert np.isfinite(w).all()
    # Node 3 did not move at step 4 (overflow: step 3 went through, with a huge step).
    np.testing.assert_array_equal(w[3, 4], w[3, 3])
    skipped = np.asarray(states.health.nonfinite_updates)[:, -1]
    np.testing.assert_array_equal(skipped, np.where(np.arange(N) == 3, 1, 0))


def test_diloco_one_local_step_is_data_parallel_sgd(problem):
    """H = 1, exact mean, outer sgd(1): every node takes the step of the mean gradient."""
    a, b, x0 = problem
    x0 = np.broadcast_to(x0[:1], x0.shape).copy()
    tx = lpdec.diloco(
        optax.sgd(0.1),
        optax.chain(lpdec.local_mean(axis_name=testing.AXIS), optax.sgd(1.0)),
        local_steps=1,
        axis_name=testing.AXIS,
    )
    ps, _, _ = testing.run(tx, {"w": x0}, 5, grad_fn=_grad_fn(a, b), mode="vmap")
    x = x0[0].astype(np.float64)
    for t in range(5):
        g = np.mean(np.einsum("nij,j->ni", a, x) - b, axis=0)
        x = x - 0.1 * g
        np.testing.assert_allclose(
            np.asarray(ps["w"])[:, t], np.broadcast_to(x, (N, D)), rtol=1e-5, atol=1e-6
        )


def test_diloco_nested_layout_matches_one_node_per_device(problem):
    a, b, x0 = problem
    x0 = np.concatenate([x0, x0[::-1]])  # 16 nodes: 2 per device
    a, b = np.concatenate([a, a[::-1]]), np.concatenate([b, b[::-1]])

    def tx(axis):
        return lpdec.diloco(
            optax.sgd(INNER_LR),
            optax.chain(
                optax.sgd(OUTER_LR, momentum=0.9), lpdec.dpsgd(lpdec.ring(16), axis_name=axis)
            ),
            local_steps=2,
            axis_name=axis,
        )

    run = lambda m, ax: testing.run(tx(ax), {"w": x0}, 6, grad_fn=_grad_fn(a, b), mode=m)  # noqa: E731
    nested, _, _ = run("nested", testing.NESTED_AXIS)
    flat, _, _ = run("vmap", testing.AXIS)
    np.testing.assert_allclose(np.asarray(nested["w"]), np.asarray(flat["w"]), 1e-5, 1e-6)


def _computations(hlo: str) -> dict[str, str]:
    """Splits compiled HLO text into {computation name: body}; ENTRY is named 'ENTRY'."""
    comps, name, lines = {}, None, []
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if head and not line.startswith(" "):
            name, lines = ("ENTRY" if head.group(1) else head.group(2)), []
        elif line.startswith("}") and name is not None:
            comps[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return comps


_COLLECTIVE = re.compile(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)")


def _collectives_outside_conditionals(hlo: str) -> tuple[int, list[str]]:
    """(collectives in the program, the computations holding one that run without a conditional).

    Walks the call graph from ENTRY, following every edge (fusions, loops,
    reductions) except a conditional's branches.
    """
    comps = _computations(hlo)
    total = sum(len(_COLLECTIVE.findall(body)) for body in comps.values())
    seen, todo = set(), ["ENTRY"]
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        body = re.sub(r"branch_computations=\{[^}]*\}", "", comps[name])
        body = re.sub(r"(true|false)_computation=%?[\w.\-]+", "", body)
        todo += re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", body)
    return total, sorted(n for n in seen if _COLLECTIVE.search(comps[n]))


@pytest.mark.parametrize("exchange", ["mean", "cmean8", "gossip"])
def test_diloco_communicates_only_inside_the_exchange_branch(exchange):
    """The compiled step's collectives all sit in a conditional's branch (item 5 of the issue)."""
    axis = testing.AXIS
    if exchange == "cmean8":
        outer = optax.chain(
            lpdec.compressed_mean(lpdec.minmax(8), axis_name=axis),
            optax.sgd(0.7, momentum=0.9, nesterov=True),
        )
        tx = lpdec.diloco(optax.adam(1e-3), outer, local_steps=4, axis_name=axis)
    else:
        tx = _tx(4, exchange)
    mesh = jax.make_mesh((N,), (axis,))
    spec = jax.P(axis)

    def one_step(params, grads):
        params, grads = jax.tree.map(lambda x: x[0], (params, grads))
        state = tx.init(params)
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda x: x[None], optax.apply_updates(params, updates))

    fn = jax.jit(jax.shard_map(one_step, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    sharding = jax.NamedSharding(mesh, spec)
    shape = lambda *s: jax.ShapeDtypeStruct((N, *s), jnp.float32, sharding=sharding)  # noqa: E731
    params = {"w": shape(64, 32), "b": shape(32)}
    hlo = fn.lower(params, params).compile().as_text()
    total, outside = _collectives_outside_conditionals(hlo)
    assert total > 0
    assert outside == []


def test_diloco_meters_one_exchange_per_round():
    """The trace-time wire meter counts the outer transform's bytes once per H steps."""
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
    outer = optax.chain(lpdec.compressed_mean(lpdec.minmax(4), axis_name="nodes"), optax.sgd(1.0))

    def metered(tx):
        def one_step(p):
            updates, _ = tx.update(p, tx.init(p), p)
            return updates

        with lpdec.wire.traffic_meter() as meter:
            jax.jit(jax.vmap(one_step, axis_name="nodes")).lower(
                jax.tree.map(lambda x: jnp.zeros((N, *x.shape)), params)
            )
        return meter.bytes

    alone = metered(outer)
    h = 5
    local = metered(lpdec.diloco(optax.sgd(0.1), outer, local_steps=h, axis_name="nodes"))
    assert alone > 0
    np.testing.assert_allclose(local * h, alone, rtol=1e-12)


def test_the_outer_momentum_warms_up_linearly_over_the_configured_rounds():
    """config.outer_warmup_rounds (train_lib.optimizers.outer): round t (from 0) steps with
    Nesterov momentum mu * min(t / K, 1), against the recursion written out by hand."""
    import types

    from train_lib import optimizers

    lr, mu, rounds = 0.7, 0.6, 4
    tx = optimizers.outer(
        types.SimpleNamespace(outer_lr=lr, outer_momentum=mu, outer_warmup_rounds=rounds)
    )
    params = jnp.zeros(3)
    state = tx.init(params)
    rng = np.random.default_rng(0)
    trace = np.zeros(3)
    for t in range(7):
        g = rng.normal(size=3)
        out, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
        m = mu * min(t / rounds, 1.0)
        trace = m * trace + g
        np.testing.assert_allclose(np.asarray(out), -lr * (g + m * trace), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("warm", [2, 0])
def test_the_outer_momentum_decays_linearly_over_the_last_rounds(warm):
    """config.outer_decay_rounds D: with R = (num_steps - sync_steps) // local_steps rounds,
    round t steps with mu * min(t / K, 1) while t <= R - D, then mu * (R - t) / D down to
    0 at the last round's end, against the recursion written out by hand."""
    import types

    from train_lib import optimizers

    lr, mu, decay = 0.7, 0.6, 3
    view = types.SimpleNamespace(
        outer_lr=lr, outer_momentum=mu, outer_warmup_rounds=warm, outer_decay_rounds=decay,
        num_steps=100, sync_steps=20, local_steps=10,
    )  # fmt: skip
    rounds = 8
    tx = optimizers.outer(view)
    params = jnp.zeros(3)
    state = tx.init(params)
    rng = np.random.default_rng(1)
    trace = np.zeros(3)
    for t in range(rounds):
        g = rng.normal(size=3)
        out, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
        rising = mu * min(t / warm, 1.0) if warm else mu
        m = rising if t <= rounds - decay else mu * (rounds - t) / decay
        trace = m * trace + g
        np.testing.assert_allclose(np.asarray(out), -lr * (g + m * trace), rtol=1e-5, atol=1e-6)


def test_a_slow_outer_momentum_mixes_two_nesterov_steps_of_the_same_steady_gain():
    """config.outer_slow_weight w, outer_slow_momentum b (train_lib.optimizers.outer):
    (1 - w) x the warmed-up fast Nesterov step + w x a Nesterov step of momentum b at
    lr (1 - b) / (1 - mu), against both recursions written out by hand; on a constant
    pseudo-gradient both parts tend to the same step, lr g / (1 - mu)."""
    import types

    from train_lib import optimizers

    lr, mu, b, w, rounds = 0.7, 0.6, 0.9, 0.25, 2
    view = types.SimpleNamespace(
        outer_lr=lr, outer_momentum=mu, outer_warmup_rounds=rounds,
        outer_slow_momentum=b, outer_slow_weight=w,
    )  # fmt: skip
    tx = optimizers.outer(view)
    params = jnp.zeros(3)
    state = tx.init(params)
    rng = np.random.default_rng(2)
    fast, slow = np.zeros(3), np.zeros(3)
    for t in range(6):
        g = rng.normal(size=3)
        out, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
        m = mu * min(t / rounds, 1.0)
        fast = m * fast + g
        slow = b * slow + g
        expected = (1 - w) * -lr * (g + m * fast) + w * -lr * (1 - b) / (1 - mu) * (g + b * slow)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)
    g = np.ones(3)
    for _ in range(300):
        out, state = tx.update(jnp.asarray(g, jnp.float32), state, params)
    np.testing.assert_allclose(np.asarray(out), -lr * g / (1 - mu), rtol=1e-4)
