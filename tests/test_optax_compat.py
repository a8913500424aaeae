"""lpdec inside the optax/flax ecosystem, composed the way users will try it, on 8 nodes.

Every node minimises 0.5 ||x - target_i||^2 (its gradient is x - target_i) with
its own target, so nodes that only train locally drift apart and gossip is what
pulls them together. The nodes run under `jax.vmap(axis_name="nodes")`, and
one case per topic under `jax.shard_map` over the 8 CPU devices.
"""

import contextlib
import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from flax.training import train_state

import lpdec

N, LR, AXIS = 8, 0.1, "nodes"
RING = lpdec.ring(N)
_rng = np.random.default_rng(0)
PARAMS = {
    "b": _rng.standard_normal((N, 3)).astype(np.float32),
    "w": _rng.standard_normal((N, 5)).astype(np.float32),
}
TARGETS = jax.tree.map(lambda x: 3 * _rng.standard_normal(x.shape).astype(np.float32), PARAMS)


def per_node(fn, mode="vmap"):
    """`fn` on every node: vmapped over the node axis, or one node per device under shard_map."""
    if mode == "vmap":
        return jax.vmap(fn, axis_name=AXIS)
    mesh = jax.make_mesh((N,), (AXIS,))

    def one_node(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)

    return jax.shard_map(one_node, mesh=mesh, in_specs=jax.P(AXIS), out_specs=jax.P(AXIS))


@functools.cache
def compiled(tx, mode="vmap"):
    """Jitted per-node (init(params) -> state, step(params, state, target, noise) -> both)."""

    def step(params, state, target, noise):
        grads = jax.tree.map(lambda p, t, e: p - t + e, params, target, noise)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(per_node(tx.init, mode)), jax.jit(per_node(step, mode))


def on_nodes(tree, mode="vmap"):
    """`tree` (leading node axis) as `per_node(fn, mode)` takes it: split over the devices."""
    if mode == "vmap":
        return jax.tree.map(jnp.asarray, tree)
    return jax.device_put(tree, jax.NamedSharding(jax.make_mesh((N,), (AXIS,)), jax.P(AXIS)))


def column(tree, t):
    return jax.tree.map(lambda x: x[:, t], tree)


def run(tx, steps, *, mode="vmap", noise=None, between=None):
    """`steps` steps of `tx` from PARAMS; noise [N, steps, ...] is added to the gradients.

    `between(t, state)` may replace the state before step t. Returns (params, state).
    """
    if noise is None:
        noise = jax.tree.map(lambda x: np.zeros((N, steps) + x.shape[1:], np.float32), PARAMS)
    params, targets, noise = on_nodes((PARAMS, TARGETS, noise), mode)
    init, step = compiled(tx, mode)
    state = init(params)
    for t in range(steps):
        if between is not None:
            state = between(t, state)
        params, state = step(params, state, targets, column(noise, t))
    return params, state


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def assert_trees_close(a, b, rtol=0.0, atol=1e-5):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol), a, b)


@contextlib.contextmanager
def one_line_error(match):
    with pytest.raises(ValueError, match=match) as error:
        yield
    assert "\n" not in str(error.value)


def spread(x):
    """Largest standard deviation over the nodes of any coordinate."""
    return float(np.max(np.std(np.asarray(x), axis=0)))


# ---------------------------------------------------------------- inject_hyperparams


@pytest.mark.parametrize("mode", ["vmap", "shard_map"])
def test_inject_hyperparams_choco_is_bit_identical_to_plain(mode):
    comp = lpdec.minmax(4)
    plain, _ = run(optax.chain(optax.sgd(LR), lpdec.choco(RING, comp, gamma=0.5)), 10, mode=mode)
    injected = optax.inject_hyperparams(lpdec.choco)(RING, comp, gamma=0.5)
    assert_trees_equal(run(optax.chain(optax.sgd(LR), injected), 10, mode=mode)[0], plain)
    if mode == "vmap":
        as_array = lpdec.choco(RING, comp, gamma=jnp.float32(0.5))
        assert_trees_equal(run(optax.chain(optax.sgd(LR), as_array), 10)[0], plain)


def choco_reference(gammas):
    """Dense float64 CHOCO with Q = identity, gamma_t = gammas[t], after the sgd(LR) step.

    q_i = x~_i - x^_i; x^_j += q_j; x_i+ = x~_i + gamma_t sum_j W_ij (x^_j - x^_i).
    """
    shift = np.roll(np.eye(N), 1, axis=1)
    w = (np.eye(N) + shift + shift.T) / 3  # the ring: 1/3 to itself and each neighbour
    out = {}
    for name, x in PARAMS.items():
        x, x_hat = x.astype(np.float64), np.zeros(x.shape)
        for gamma in gammas:
            x_local = x - LR * (x - TARGETS[name])
            x_hat = x_hat + (x_local - x_hat)
            x = x_local + gamma * (w @ x_hat - x_hat)
        out[name] = x
    return out


def values(schedule, steps):
    return [float(schedule(t)) for t in range(steps)]


def test_gamma_schedule_matches_dense_reference():
    steps = 8
    schedule = lambda count: 0.2 + 0.7 / (1.0 + count)  # noqa: E731
    direct = lpdec.choco(RING, lpdec.identity(), gamma=schedule)
    params, _ = run(optax.chain(optax.sgd(LR), direct), steps)
    assert_trees_close(params, choco_reference(values(schedule, steps)))
    linear = optax.linear_schedule(0.9, 0.3, transition_steps=steps)
    injected = optax.inject_hyperparams(lpdec.choco)(RING, lpdec.identity(), gamma=linear)
    params, _ = run(optax.chain(optax.sgd(LR), injected), steps)
    assert_trees_close(params, choco_reference(values(linear, steps)))


def test_changing_injected_gamma_between_steps_changes_the_step():
    def lower_gamma(t, state):
        if t != 3:
            return state
        hyperparams = dict(state[1].hyperparams, gamma=jnp.full((N,), 0.2, jnp.float32))
        return (state[0], state[1]._replace(hyperparams=hyperparams))

    injected = optax.inject_hyperparams(lpdec.choco)(RING, lpdec.identity(), gamma=0.9)
    params, _ = run(optax.chain(optax.sgd(LR), injected), 6, between=lower_gamma)
    assert_trees_close(params, choco_reference([0.9] * 3 + [0.2] * 3))


def _injected(factory, *args, static_args=(), **hyperparams):
    """(plain chain, the same chain with `factory` wrapped in inject_hyperparams)."""
    pair = (factory, optax.inject_hyperparams(factory, static_args=static_args))
    if factory is lpdec.qg_momentum:  # a local optimizer: it goes before the gossip
        return [optax.chain(f(*args, **hyperparams), lpdec.dpsgd(RING)) for f in pair]
    return [optax.chain(optax.sgd(LR), f(*args, **hyperparams)) for f in pair]


INJECTED = {
    "deepsqueeze": lambda: _injected(lpdec.deepsqueeze, RING, lpdec.top_k(0.5), gamma=0.5),
    "quant_sgp": lambda: _injected(lpdec.quant_sgp, RING, lpdec.minmax(4), gamma=0.5),
    "sparse_push": lambda: _injected(lpdec.sparse_push, RING, lpdec.top_k(0.5), gamma=0.5),
    "moniqua": lambda: _injected(
        lpdec.moniqua, RING, lpdec.modulo(8), theta=4.0, slack=1.0, static_args=("slack",)
    ),
    "qg_momentum": lambda: _injected(lpdec.qg_momentum, learning_rate=LR, momentum=0.9),
}


@pytest.mark.parametrize("name", sorted(INJECTED))
def test_inject_hyperparams_matches_plain(name):
    plain, injected = INJECTED[name]()
    # Within an ulp or two, not bit for bit: a hyperparameter that is a traced array
    # instead of a Python constant lets XLA fuse the update differently (with jaxlib
    # 0.10.2 and optax 0.2.8 quant_sgp's x~ + gamma (s + (W_ii - 1) h) parts by 1 ulp at
    # 7 of 24 elements). A hyperparameter dropped or misread moves them by far more.
    assert_trees_close(run(injected, 5)[0], run(plain, 5)[0], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- every factory, one table

COMMUNICATING = {
    "choco": lambda a: lpdec.choco(RING, lpdec.minmax(8), gamma=0.5, axis_name=a),
    "choco_per_peer": lambda a: lpdec.choco(
        RING, lpdec.minmax(8), gamma=0.5, replicas="per_peer", axis_name=a
    ),
    "compressed_mean": lambda a: lpdec.compressed_mean(lpdec.minmax(8), axis_name=a),
    "d2": lambda a: lpdec.d2(RING.with_slack(0.5), axis_name=a),
    "dcd": lambda a: lpdec.dcd(RING, lpdec.minmax(8), axis_name=a),
    "dcd_per_peer": lambda a: lpdec.dcd(RING, lpdec.minmax(8), replicas="per_peer", axis_name=a),
    "deepsqueeze": lambda a: lpdec.deepsqueeze(RING, lpdec.top_k(0.5), gamma=0.5, axis_name=a),
    "dpsgd": lambda a: lpdec.dpsgd(RING, axis_name=a),
    "local_mean": lambda a: lpdec.local_mean(axis_name=a),
    "moniqua": lambda a: lpdec.moniqua(RING, lpdec.modulo(8, 4.0), axis_name=a),
    "naive_quantized": lambda a: lpdec.naive_quantized(RING, lpdec.minmax(8), axis_name=a),
    "quant_sgp": lambda a: lpdec.quant_sgp(RING, lpdec.minmax(8), gamma=0.5, axis_name=a),
    "sparse_push": lambda a: lpdec.sparse_push(RING, lpdec.top_k(0.5), gamma=0.5, axis_name=a),
}
MEANS = ("compressed_mean", "local_mean")  # these average the gradients: first in the chain
FACTORIES = sorted(COMMUNICATING) + ["qg_momentum"]


def chain(name, axis_name=AXIS):
    """The chain a user writes around factory `name`."""
    if name == "qg_momentum":
        return optax.chain(lpdec.qg_momentum(LR), lpdec.dpsgd(RING, axis_name=axis_name))
    algorithm = COMMUNICATING[name](axis_name)
    if name in MEANS:
        return optax.chain(algorithm, optax.sgd(LR))
    return optax.chain(optax.sgd(LR), algorithm)


@pytest.mark.parametrize("name", FACTORIES)
def test_flax_train_state_can_be_donated(name):
    """Eager TrainState.create under the node axis, then jit(step, donate_argnums=0).

    A state that holds the params' own buffers fails with "Attempt to donate
    the same buffer twice".
    """
    tx = chain(name)
    create = lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=tx)  # noqa: E731
    state = jax.vmap(create, axis_name=AXIS)(on_nodes(PARAMS))

    def step(state, target):
        return state.apply_gradients(grads=jax.tree.map(jnp.subtract, state.params, target))

    step = jax.jit(jax.vmap(step, axis_name=AXIS), donate_argnums=0)
    for _ in range(2):
        state = step(state, TARGETS)
    np.testing.assert_array_equal(state.step, np.full(N, 2))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state))


@pytest.mark.parametrize("name", FACTORIES)
def test_init_never_holds_the_params_buffers(name):
    params = on_nodes(PARAMS)
    state = jax.vmap(chain(name).init, axis_name=AXIS)(params)
    param_leaves = jax.tree.leaves(params)
    pointers = {p.unsafe_buffer_pointer() for p in param_leaves}
    for leaf in jax.tree.leaves(state):
        assert all(leaf is not p for p in param_leaves)
        assert leaf.unsafe_buffer_pointer() not in pointers


@pytest.mark.parametrize("name", sorted(COMMUNICATING))
def test_init_outside_the_node_axis_is_a_clear_error(name):
    one_node = jax.tree.map(lambda x: x[0], PARAMS)
    with one_line_error(f"'{AXIS}'"):
        chain(name).init(one_node)


@pytest.mark.parametrize("name", sorted(COMMUNICATING))
def test_axis_name_typo_is_one_line_error_in_init_and_update(name):
    typo = chain(name, axis_name="node")
    state = jax.eval_shape(per_node(chain(name).init), PARAMS)
    with one_line_error("'node'"):
        jax.eval_shape(per_node(typo.update), PARAMS, state, PARAMS)
    with one_line_error("'node'"):
        jax.eval_shape(per_node(typo.init), PARAMS)


def test_axis_name_typo_under_shard_map_names_the_mesh_axes():
    typo = optax.chain(optax.sgd(LR), lpdec.choco(RING, lpdec.minmax(8), axis_name="node"))
    with one_line_error(r"'node'.*\('nodes',\)"):
        jax.eval_shape(per_node(typo.init, "shard_map"), on_nodes(PARAMS, "shard_map"))


@pytest.mark.parametrize("name", FACTORIES)
def test_update_keeps_the_state_structure(name):
    """chex: the state after a step has the structure, shapes and dtypes it had before."""
    tx = chain(name)
    before = jax.eval_shape(per_node(tx.init), PARAMS)
    _, after = jax.eval_shape(per_node(tx.update), PARAMS, before, PARAMS)
    chex.assert_trees_all_equal_structs(before, after)
    chex.assert_trees_all_equal_shapes_and_dtypes(before, after)


# ---------------------------------------------------------------- MultiSteps, multi_transform


def test_multisteps_steps_on_the_mean_of_micro_gradients(rng):
    """MultiSteps(chain, k) = the chain every k-th step on the mean of the k micro-gradients.

    Correct, but optax's MultiSteps runs the inner update on EVERY micro-step
    and masks its result, so a gossip chain communicates k times per real step
    (the HLO test below checks it). To communicate once per k local steps, use
    lpdec's local-step wrapper (issue 8), not MultiSteps.
    """
    k, outer = 3, 3
    inner = optax.chain(optax.sgd(LR), lpdec.choco(RING, lpdec.identity(), gamma=0.5))
    noise = jax.tree.map(
        lambda x: rng.standard_normal((N, k * outer) + x.shape[1:]).astype(np.float32), PARAMS
    )
    multi_steps = optax.MultiSteps(inner, k)
    assert_trees_equal(run(multi_steps, k - 1, noise=noise)[0], PARAMS)  # no move before step k
    mean_noise = jax.tree.map(lambda e: e.reshape((N, outer, k) + e.shape[2:]).mean(2), noise)
    reference, _ = run(inner, outer, noise=mean_noise)
    assert_trees_close(run(multi_steps, k * outer, noise=noise)[0], reference, rtol=1e-5)


def test_multisteps_communicates_on_every_micro_step():
    """The compiled MultiSteps update holds the inner chain's collective-permutes
    unconditionally (no `conditional` around them): optax computes and masks.
    If this ever fails, optax skips the gossip on micro-steps: update the docs."""
    inner = optax.chain(optax.sgd(LR), lpdec.choco(RING, lpdec.minmax(8), gamma=0.5))

    def hlo_of(tx):
        params, target = on_nodes((PARAMS, TARGETS), "shard_map")
        state = jax.jit(per_node(tx.init, "shard_map"))(params)
        update = jax.jit(per_node(tx.update, "shard_map"))
        return update.lower(target, state, params).compile().as_text()

    def permutes(hlo):
        return len(re.findall(r"\bcollective-permute(?:-start)?\(", hlo))

    plain, multi = hlo_of(inner), hlo_of(optax.MultiSteps(inner, 4))
    assert permutes(plain) > 0
    assert permutes(multi) == permutes(plain)
    assert "conditional(" not in multi


def test_multi_transform_gossips_only_some_groups():
    """{"w": a CHOCO chain, "b": plain sgd}: w reaches consensus, b trains on its own."""
    steps = 40
    gossip = optax.chain(optax.sgd(LR), lpdec.choco(RING, lpdec.identity(), gamma=1.0))
    tx = optax.multi_transform(
        {"gossip": gossip, "local": optax.sgd(LR)}, {"w": "gossip", "b": "local"}
    )
    params, _ = run(tx, steps)
    local, _ = run(optax.sgd(LR), steps)
    assert spread(params["w"]) < 0.3 * spread(local["w"])
    np.testing.assert_array_equal(params["b"], local["b"])
    assert spread(params["b"]) > 1.0


# ---------------------------------------------------------------- flax nnx, orbax


def test_nnx_optimizer_under_nnx_vmap(rng):
    """The pattern for flax.nnx: build model and Optimizer inside nnx.vmap(axis_name="nodes")
    (tx.init must run under the node axis), and the step under nnx.vmap too."""

    x = jnp.asarray(rng.standard_normal((N, 16, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((N, 16, 2)), jnp.float32)

    def train(tx):
        @nnx.vmap(axis_name=AXIS)
        def create(key):
            model = nnx.Linear(3, 2, rngs=nnx.Rngs(params=key))
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        @nnx.vmap(axis_name=AXIS)
        def step(model, optimizer, x, y):
            loss = lambda m: jnp.mean((m(x) - y) ** 2)  # noqa: E731
            optimizer.update(model, nnx.grad(loss)(model))

        model, optimizer = create(jax.random.split(jax.random.key(0), N))
        before = spread(model.kernel[...])
        for _ in range(10):
            step(model, optimizer, x, y)
        np.testing.assert_array_equal(optimizer.step[...], np.full(N, 10))
        return spread(model.kernel[...]) / before

    # A small learning rate: local training alone barely changes how far apart the nodes are.
    assert train(optax.sgd(0.01)) > 0.8
    assert train(optax.chain(optax.sgd(0.01), lpdec.choco(RING, lpdec.minmax(8), gamma=0.5))) < 0.5


@pytest.mark.parametrize("mode", ["vmap", "shard_map"])
def test_orbax_restore_with_a_target_continues_bit_identically(tmp_path, mode):
    """Save (params, opt_state), both with a leading node axis, with orbax; a restarted run
    builds the target from shapes alone (jax.eval_shape), restores into it and goes on.
    Under shard_map the target also says how the nodes lie on the devices."""
    tx = optax.chain(optax.sgd(LR), lpdec.choco(RING, lpdec.minmax(4), gamma=0.5))
    init, step = compiled(tx, mode)
    targets, zeros = on_nodes((TARGETS, jax.tree.map(np.zeros_like, PARAMS)), mode)

    def steps(params, state, n):
        for _ in range(n):
            params, state = step(params, state, targets, zeros)
        return params, state

    params = on_nodes(PARAMS, mode)
    straight = steps(params, init(params), 6)

    manager = ocp.CheckpointManager(tmp_path / "ckpt")
    manager.save(3, args=ocp.args.StandardSave(steps(params, init(params), 3)))
    manager.wait_until_finished()
    sharding = None
    if mode == "shard_map":
        sharding = jax.NamedSharding(jax.make_mesh((N,), (AXIS,)), jax.P(AXIS))
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), PARAMS
    )
    abstract = jax.eval_shape(lambda p: (p, per_node(tx.init, mode)(p)), shapes)
    # eval_shape leaves an abstract mesh; orbax places the arrays on the real one.
    abstract = jax.tree.map(lambda s: s.update(sharding=sharding), abstract)
    restored = manager.restore(3, args=ocp.args.StandardRestore(abstract))
    manager.close()
    assert jax.tree.structure(restored) == jax.tree.structure(abstract)
    assert_trees_equal(steps(*restored, 3), straight)
