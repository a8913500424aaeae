"""Library-level faults: NaN gradients and a Byzantine node in an optax chain run by
`lpdec.testing.run` or `jax.lax.scan`, against the same chain without the fault."""

from __future__ import annotations

import numpy as np

from bench.faults.common import Context
from bench.faults.common import Trial


def nan_steps(ctx: Context, rng: np.random.Generator) -> Trial:
    """NaN gradients on random nodes at random steps: the run ends where a clean one does."""
    del ctx
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import lpdec  # noqa: PLC0415
    from lpdec import testing  # noqa: PLC0415

    n, d, steps = 8, 16, 150
    b = rng.uniform(-1, 1, (n, d)).astype(np.float32)
    hits = int(rng.integers(1, 4))
    bad_nodes = jnp.asarray(rng.integers(0, n, hits))
    bad_steps = jnp.asarray(rng.integers(0, steps // 2, hits))

    def grad_fn(nan):
        def fn(params, node, step):
            g = params["w"] - jnp.asarray(b)[node]
            poisoned = nan & jnp.any((bad_nodes == node) & (bad_steps == step))
            return {"w": jnp.where(poisoned, jnp.nan, g)}

        return fn

    def final(nan):
        tx = lpdec.chain(
            optax.sgd(0.05, momentum=0.9),
            lpdec.choco(lpdec.ring(n), lpdec.minmax(8), gamma=0.5),
        )
        x0 = {"w": np.zeros((n, d), np.float32)}
        params, _, _ = testing.run(tx, x0, steps, grad_fn=grad_fn(nan), mode="vmap")
        return np.asarray(params["w"][:, -1])

    apart = float(np.abs(final(True) - final(False)).max())
    where = ", ".join(
        f"node {int(a)} step {int(s)}" for a, s in zip(bad_nodes, bad_steps, strict=True)
    )
    # The clean run's nodes sit ~0.3 from the optimum of their average; 2e-3 is noise.
    return Trial(apart < 2e-3, f"NaN at {where}: {apart:.1e} from the clean run")


def byzantine(ctx: Context, rng: np.random.Generator) -> Trial:
    """One random node of 8 on a ring sends a bad model every step (its model x -10 of the
    others' mean, or noise 10x their scale): ClippedGossip's honest nodes end within 3
    points of a clean run's accuracy; plain D-PSGD's, for comparison, do not."""
    del ctx
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import optax  # noqa: PLC0415

    import lpdec  # noqa: PLC0415

    n, classes, features, examples, steps = 8, 4, 20, 60, 150
    bad = int(rng.integers(0, n))
    kind = ("sign flip", "noise")[int(rng.integers(0, 2))]
    centers = rng.standard_normal((classes, features))

    def sample(m):
        y = rng.integers(0, classes, m)
        return (centers[y] + 2.5 * rng.standard_normal((m, features))).astype(np.float32), y

    data = [sample(examples) for _ in range(n)]
    xs, ys = (
        jnp.asarray(np.stack([x for x, _ in data])),
        jnp.asarray(np.stack([y for _, y in data])),
    )
    test_x, test_y = sample(2000)

    def loss(p, x, y):
        logp = jax.nn.log_softmax(x @ p["w"] + p["b"])
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    grads = jax.vmap(jax.grad(loss))

    def attack(params, step):
        others = jax.tree.map(lambda x: (jnp.sum(x, 0) - x[bad]) / (n - 1), params)
        if kind == "sign flip":
            claim = jax.tree.map(lambda m: -10.0 * m, others)
        else:
            scale = jnp.sqrt(sum(jnp.mean(m**2) for m in jax.tree.leaves(others)) / 2)
            keys = jax.random.split(jax.random.fold_in(jax.random.key(bad), step), 2)
            claim = {
                k: 10.0 * scale * jax.random.normal(key, m.shape)
                for key, (k, m) in zip(keys, sorted(others.items()), strict=True)
            }
        return jax.tree.map(lambda x, c: x.at[bad].set(c), params, claim)

    def accuracy(algorithm, attacked):
        tx = optax.chain(optax.sgd(0.5), algorithm)

        @jax.jit
        def final(params):
            def body(carry, step):
                p, s = carry
                p = attack(p, step) if attacked else p
                u, s = jax.vmap(tx.update, axis_name="nodes")(grads(p, xs, ys), s, p)
                return (optax.apply_updates(p, u), s), None

            state = jax.vmap(tx.init, axis_name="nodes")(params)
            return jax.lax.scan(body, (params, state), jnp.arange(steps))[0][0]

        p = final({"b": jnp.zeros((n, classes)), "w": jnp.zeros((n, features, classes))})
        honest = [i for i in range(n) if i != bad]
        w, b = np.asarray(p["w"])[honest].mean(0), np.asarray(p["b"])[honest].mean(0)
        return float(np.mean(np.argmax(test_x @ w + b, axis=1) == test_y))

    ring = lpdec.ring(n)
    clean = accuracy(lpdec.dpsgd(ring), attacked=False)
    plain = accuracy(lpdec.dpsgd(ring), attacked=True)
    clipped = accuracy(lpdec.clipped_gossip(ring), attacked=True)
    return Trial(
        clipped >= clean - 0.03,
        f"node {bad}, {kind}: honest accuracy clean {clean:.3f}, clipped {clipped:.3f} "
        f"(plain D-PSGD {plain:.3f})",
    )
