"""Machines x workers (`make_layout(machines=)`), checked against flat layouts and numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import lpdec

D, T = 6, 4


def _need(devices):
    if len(jax.devices()) < devices:
        pytest.skip(f"needs {devices} devices")


def _run(tx, layout, x0, grads):
    """T steps of `tx` from per-node models x0 [n, D] with per-node gradients [T, n, D]."""

    def step(params, opt_state, g):
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = lpdec.init_nodes(tx, {"w": x0}, layout, stacked=True)
    step = jax.jit(layout.map(step, (True, True, True)))
    for g in grads:
        params, opt_state = step(params, opt_state, {"w": layout.put(g)})
    return np.asarray(params["w"])


# (nodes, machines, devices): one worker per device, 4 machines of 2, and 2 workers per device.
MACHINE_LAYOUTS = [(8, 2, 8), (8, 4, 8), (16, 2, 8), (8, 2, 2)]
FLAT_CHAINS = {
    "dpsgd": lambda n, axis: lpdec.dpsgd(lpdec.ring(n), axis_name=axis),
    "choco": lambda n, axis: optax.chain(
        optax.sgd(0.1, momentum=0.9),
        lpdec.choco(lpdec.ring(n), lpdec.minmax(4), gamma=0.5, axis_name=axis),
    ),
}


@pytest.mark.parametrize("chain", sorted(FLAT_CHAINS))
@pytest.mark.parametrize("num_nodes,machines,devices", MACHINE_LAYOUTS)
def test_flat_gossip_on_machines_numbers_nodes_as_the_flat_layout(
    rng, chain, num_nodes, machines, devices
):
    """Over layout.axis_name, node m * (n / M) + w is worker w of machine m: the 2-D
    layout runs any flat algorithm exactly as the 1-D layout does."""
    _need(devices)
    flat = lpdec.make_layout(num_nodes, devices=jax.devices()[:devices])
    layout = lpdec.make_layout(num_nodes, machines=machines, devices=jax.devices()[:devices])
    assert layout.hierarchical and layout.machines == machines
    assert layout.mesh.shape == {
        "machines": machines,
        "workers": min(devices, num_nodes) // machines,
    }
    x0 = rng.normal(size=(num_nodes, D)).astype(np.float32)
    grads = rng.normal(size=(T, num_nodes, D)).astype(np.float32)
    expected = _run(FLAT_CHAINS[chain](num_nodes, flat.axis_name), flat, x0, grads)
    got = _run(FLAT_CHAINS[chain](num_nodes, layout.axis_name), layout, x0, grads)
    np.testing.assert_array_equal(got, expected)


def _traffic(layout):
    tx = lpdec.dpsgd(lpdec.ring(8), axis_name=layout.axis_name)

    def step(params, opt_state, g):
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params, opt_state = lpdec.init_nodes(tx, {"w": np.zeros((8, D), np.float32)}, layout)
    grads = {"w": layout.put(np.zeros((8, D), np.float32))}
    lowered = jax.jit(layout.map(step, (True, True, True))).lower(params, opt_state, grads)
    return lpdec.metrics.collective_traffic(lowered.compile().as_text())


def test_flat_gossip_on_machines_compiles_to_the_flat_layouts_permutes():
    """Over the pair of mesh axes a gossip round is one collective-permute per edge
    class (the two directions of a ring), as on the 1-D mesh: not the nested path's
    gathers."""
    _need(8)
    got = _traffic(lpdec.make_layout(8, machines=2))
    expected = _traffic(lpdec.make_layout(8))
    assert got.count_by_op == expected.count_by_op == {"collective-permute": 2}
    assert got.bytes_by_op == expected.bytes_by_op


def test_machine_and_worker_indices_are_the_rows_and_columns_of_the_mesh():
    layout = lpdec.make_layout(16, machines=2)
    _need(8)
    assert layout.axis_name == ("machines", "workers", "local")
    assert layout.worker_axis == ("workers", "local")

    def indices(x):
        del x
        node = jax.lax.axis_index(layout.axis_name)
        return jnp.stack(
            [node, jax.lax.axis_index(layout.machine_axis), jax.lax.axis_index(layout.worker_axis)]
        )

    got = np.asarray(jax.jit(layout.map(indices, (True,)))(layout.put(np.zeros(16))))
    np.testing.assert_array_equal(got[:, 0], np.arange(16))
    np.testing.assert_array_equal(got[:, 1], np.arange(16) // 8)
    np.testing.assert_array_equal(got[:, 2], np.arange(16) % 8)


BAD_LAYOUTS = [
    (dict(num_nodes=9, machines=2), "num_nodes=9 is not a multiple of machines=2"),
    (dict(num_nodes=6, machines=3), "machines=3 does not divide the 8 devices"),
    (dict(num_nodes=12, machines=2), "num_nodes=6 exceeds each machine's 4 devices"),
    (dict(num_nodes=8, machines=0), "machines must be a positive integer"),
]


@pytest.mark.parametrize("kwargs,message", BAD_LAYOUTS, ids=[m for _, m in BAD_LAYOUTS])
def test_bad_machine_layouts_raise_one_line(kwargs, message):
    _need(8)
    with pytest.raises(ValueError, match=message):
        lpdec.make_layout(**kwargs, devices=jax.devices()[:8])


def test_machine_and_worker_axes_need_a_layout_of_machines():
    with pytest.raises(ValueError, match=r"NodeLayout.machine_axis exists only .*machines=M"):
        _ = lpdec.make_layout(8).machine_axis
