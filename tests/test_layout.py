"""lpdec.init_nodes and NodeLayout.map on every layout, against a dense numpy simulation."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpdec

D, T = 5, 4

# (nodes, devices used): one node per device, two per device, all on one device.
LAYOUTS = [(8, 8), (16, 8), (8, 4), (8, 1)]


def _layout(num_nodes, num_devices):
    if len(jax.devices()) < num_devices:
        pytest.skip(f"needs {num_devices} devices")
    return lpdec.make_layout(num_nodes, devices=jax.devices()[:num_devices])


def _step(tx):
    def step(params, opt_state, grads):  # one node's arrays: no node axis in here
        assert params["w"].shape == (D,)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


@pytest.mark.parametrize("num_nodes,num_devices", LAYOUTS)
def test_dcd_started_by_init_nodes_follows_the_dense_recursion(rng, num_nodes, num_devices):
    """DCD's init exchanges every node's model with its neighbours (the replicas x_hat_j),
    so only a state built under the node axis, with each node's own neighbours, gives
    x+ = W x + u from the first step (lossless compression: Q(z) = z, x_hat_j = x_j)."""
    layout = _layout(num_nodes, num_devices)
    topo = lpdec.exponential(num_nodes)
    tx = lpdec.dcd(topo, lpdec.identity(), axis_name=layout.axis_name)
    x0 = rng.normal(size=(num_nodes, D)).astype(np.float32)
    grads = rng.normal(size=(T, num_nodes, D)).astype(np.float32)

    params, opt_state = lpdec.init_nodes(tx, {"w": x0}, layout, stacked=True)
    assert params["w"].sharding == layout.node_sharding
    assert all(leaf.shape[0] == num_nodes for leaf in jax.tree.leaves(opt_state))
    step = jax.jit(layout.map(_step(tx), (True, True, True)))
    # exponential(n)'s W is checked against its definition in test_topology.py.
    w = np.asarray(topo.mixing_matrix(0), np.float64)
    expected = x0.astype(np.float64)
    for t in range(T):
        params, opt_state = step(params, opt_state, {"w": layout.put(grads[t])})
        expected = w @ expected + grads[t]
        np.testing.assert_allclose(np.asarray(params["w"]), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_nodes,num_devices", LAYOUTS)
def test_every_node_starts_from_the_given_model(num_nodes, num_devices):
    layout = _layout(num_nodes, num_devices)
    tx = optax.chain(
        optax.sgd(0.1, momentum=0.9),
        lpdec.choco(lpdec.ring(num_nodes), lpdec.minmax(8), gamma=0.5, axis_name=layout.axis_name),
    )
    model = {"w": np.arange(D, dtype=np.float32), "b": np.float32(3.0)}
    params, opt_state = lpdec.init_nodes(tx, model, layout)
    np.testing.assert_array_equal(np.asarray(params["w"]), np.tile(model["w"], (num_nodes, 1)))
    np.testing.assert_array_equal(np.asarray(params["b"]), np.full(num_nodes, 3.0, np.float32))
    # With equal models and equal gradients, every node takes the same (local) step.
    step = jax.jit(layout.map(_step(tx), (True, True, True)))
    grads = {"w": jnp.ones((num_nodes, D)), "b": jnp.ones(num_nodes)}
    params, _ = step(params, opt_state, grads)
    np.testing.assert_allclose(
        np.asarray(params["w"]), np.tile(model["w"] - 0.1, (num_nodes, 1)), rtol=1e-6
    )


def test_params_and_state_can_both_be_donated(rng):
    """CHOCO's state starts as copies of the parameters; they must be copies, or jit
    refuses to donate the same buffer twice."""
    layout = lpdec.make_layout(8)
    tx = optax.chain(
        optax.sgd(0.1),
        lpdec.choco(lpdec.ring(8), lpdec.minmax(8), gamma=0.5, axis_name=layout.axis_name),
    )
    x0 = rng.normal(size=(8, D)).astype(np.float32)
    grads = {"w": layout.put(rng.normal(size=(8, D)).astype(np.float32))}
    step = layout.map(_step(tx), (True, True, True))
    expected, _ = jax.jit(step)(*lpdec.init_nodes(tx, {"w": x0}, layout, stacked=True), grads)
    params, opt_state = lpdec.init_nodes(tx, {"w": x0}, layout, stacked=True)
    params, _ = jax.jit(step, donate_argnums=(0, 1))(params, opt_state, grads)
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(expected["w"]))


def test_init_nodes_rejects_params_without_the_node_axis():
    layout = lpdec.make_layout(8)
    tx = lpdec.dpsgd(lpdec.ring(8), axis_name=layout.axis_name)
    message = r"params\['w'\] has shape \(3, 2\).*leading node axis of 8"
    with pytest.raises(ValueError, match=message):
        lpdec.init_nodes(tx, {"w": np.zeros((3, 2))}, layout, stacked=True)
    with pytest.raises(ValueError, match="params must hold at least one array"):
        lpdec.init_nodes(tx, {}, layout)


@pytest.mark.parametrize("num_nodes,num_devices", LAYOUTS)
def test_map_takes_a_model_with_an_empty_leaf(rng, num_nodes, num_devices):
    """An empty leaf beside others, used by each node's program. jaxlib 0.11.2 crashed
    (segmentation fault) compiling such a shard_map; `lpdec.layout.shard_map` keeps
    empty arrays out of it and hands the program zeros of the per-node shape."""
    layout = _layout(num_nodes, num_devices)
    w = rng.normal(size=(num_nodes, D)).astype(np.float32)
    params = layout.put({"w": w, "empty": np.zeros((num_nodes, 0, 3), np.float32)})
    scale = layout.put(np.float32(3.0), per_node=False)

    def node(params, scale):
        assert params["empty"].shape == (0, 3) and params["w"].shape == (D,)
        # A loop carry mixes the stand-in with this node's values: it must vary like them.
        empty = jax.lax.fori_loop(0, 2, lambda _, e: e + params["w"][:0, None], params["empty"])
        out = {"w": params["w"] * scale + jnp.sum(params["empty"]), "empty": empty + 1}
        return out, jnp.sum(out["w"])

    out, total = jax.jit(layout.map(node, (True, False)))(params, scale)
    np.testing.assert_allclose(out["w"], 3 * w, rtol=1e-6)
    assert out["empty"].shape == (num_nodes, 0, 3)
    np.testing.assert_allclose(total, 3 * w.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_shard_map_hands_empty_arguments_their_block_shape():
    """In-spec prefixes of every form (one spec for all arguments, a spec per argument, a
    tree of specs) and mesh axes that split one dimension together."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    empty = np.zeros((8, 0, 4), np.float32)
    seen = []

    def body(tree, y):
        seen.append((tree["e"].shape, y.shape))
        return tree["x"] * 2 + jnp.sum(tree["e"]) + jnp.sum(y)

    ab, a, b = jax.P(("a", "b")), jax.P("a"), jax.P(None, None, "b")
    for in_specs, x_spec, e_spec, block in [
        (ab, ab, ab, (1, 0, 4)),
        ((a, a), a, a, (4, 0, 4)),
        (({"x": a, "e": b}, b), a, b, (8, 0, 1)),
    ]:
        seen.clear()
        fn = lpdec.layout.shard_map(
            body, mesh=mesh, in_specs=in_specs, out_specs=x_spec, check_vma=False
        )
        put = lambda v, spec: jax.device_put(v, jax.NamedSharding(mesh, spec))  # noqa: E731
        out = jax.jit(fn)({"x": put(x, x_spec), "e": put(empty, e_spec)}, put(empty, e_spec))
        assert seen == [(block, block)], (in_specs, seen)
        np.testing.assert_array_equal(out, 2 * x)
