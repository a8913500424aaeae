"""Machines x workers (`make_layout(machines=)`), checked against flat layouts and numpy."""

import types

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

    params, opt_state = lpdec.init_nodes(
        tx, {"w": np.zeros((8, D), np.float32)}, layout, stacked=True
    )
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


# ----------------------------------------------------------------------------
# Hierarchical gossip: local_mean inside a machine, shard_over(gossip) between.
# ----------------------------------------------------------------------------

SHAPES = {"a": (5, 3), "b": (7,)}  # d = 22: padded to 24 for 4 workers, 11 a slice for 2


def _hierarchical_chain(layout, comp, *, lr=0.125, gamma=0.5):
    machines = layout.machines
    return optax.chain(
        # A nested layout's worker axis is a pair: (workers, local).
        lpdec.local_mean(axis_name=layout.worker_axis),
        optax.sgd(lr),
        lpdec.shard_over(
            lpdec.choco(lpdec.ring(machines), comp, gamma=gamma, axis_name=layout.machine_axis),
            axis_name=layout.worker_axis,
        ),
    )


def _minmax_np(x, bits=8):
    """Seed 000's min-max quantizer of one chunk in float32 numpy (nearest rounding)."""
    x = x.astype(np.float32)
    lo, hi = x.min(), x.max()
    unit = (hi - lo) * np.float32(1.0 / (2**bits - 1))
    if unit == 0:
        return np.full_like(x, lo)
    codes = np.clip(np.round((x - lo) * (np.float32(1.0) / unit)), 0, 2**bits - 1)
    return (lo + codes * unit).astype(np.float32)


def _choco_machines_np(x0, grads, workers, quantize, *, lr=0.125, gamma=0.5):
    """Dense reference: machine m's model is x0[m]; each step averages the gradients of
    its workers, takes an SGD step, then CHOCO over ring(M) with Q applied slice by
    slice to the model flattened and padded to a multiple of the workers by repeating
    its last element."""
    machines, d = x0.shape
    # ring(M)'s W is checked against its definition in test_topology.py.
    w = np.asarray(lpdec.ring(machines).mixing_matrix(0), np.float32)
    size = -(-d // workers)
    x, x_hat = x0.astype(np.float32), np.zeros_like(x0, np.float32)
    for g in grads:
        local = x - np.float32(lr) * g.reshape(machines, workers, d).mean(axis=1)
        diff = np.zeros((machines, size * workers), np.float32)
        diff[:, :d] = local - x_hat
        diff[:, d:] = diff[:, d - 1 : d]
        q = np.stack([quantize(s) for row in diff for s in row.reshape(workers, size)])
        x_hat = x_hat + q.reshape(machines, -1)[:, :d]
        x = local + np.float32(gamma) * (w @ x_hat - x_hat)
    return x


def _flat(tree):
    return np.concatenate([np.asarray(tree[k]).reshape(tree[k].shape[0], -1) for k in SHAPES], 1)


@pytest.mark.parametrize("nodes,machines", [(8, 2), (8, 4), (16, 2)])
@pytest.mark.parametrize("compressor", ["identity", "minmax8"])
def test_hierarchical_choco_follows_choco_between_machine_models(rng, nodes, machines, compressor):
    """On 8 devices: 2 x 4 and 4 x 2 workers, and 2 x 8 workers nested 2 per device.

    The gradients are multiples of 1/8 and lr = 1/8, so the machines' means and local
    steps are exact in any summation order and the first quantizer input is the
    reference's to the bit. Later steps mix in float32 in another order than numpy, and
    a difference of one ulp can move an 8-bit code across a rounding tie (a whole code
    step, 8e-4 here, seen once in ~100 runs): with 8 bits the test checks the first
    step, the one that quantizes whole slices of the model; identity checks T steps."""
    _need(8)
    layout = lpdec.make_layout(nodes, machines=machines)
    workers = nodes // machines
    comp, quantize = {
        "identity": (lpdec.identity(), lambda s: s),
        "minmax8": (lpdec.minmax(8), _minmax_np),
    }[compressor]
    tx = _hierarchical_chain(layout, comp)
    model = {k: rng.normal(size=(machines, *s)).astype(np.float32) for k, s in SHAPES.items()}
    model["b"] += 5.0  # the last slice is all positive: padding it with zeros would show
    # Every worker of machine m starts from machine m's model.
    x0 = {k: np.repeat(v, workers, axis=0) for k, v in model.items()}
    steps = T if compressor == "identity" else 1
    grads = [
        {
            k: (rng.integers(-16, 17, size=(nodes, *s)) / 8).astype(np.float32)
            for k, s in SHAPES.items()
        }
        for _ in range(steps)
    ]
    params, opt_state = lpdec.init_nodes(tx, x0, layout, stacked=True)
    assert jax.tree.leaves(opt_state[-1].inner.lag)[0].shape == (nodes, -(-22 // workers))

    def step(params, opt_state, g):
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step = jax.jit(layout.map(step, (True, True, True)))
    for g in grads:
        params, opt_state = step(params, opt_state, layout.put(g))

    expected = _choco_machines_np(
        _flat(model), np.stack([_flat(g) for g in grads]), workers, quantize
    )
    np.testing.assert_allclose(
        _flat(params), np.repeat(expected, workers, axis=0), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("bits", [8, 4])
def test_each_machine_sends_one_compressed_model_per_edge(bits):
    """The compiled step's collective-permutes (the only traffic between machines) carry,
    per worker, one payload of its 1/k slice per edge class: k workers together send
    comp.wire_bytes(d) per edge, the size of ONE compressed model, not k of them."""
    _need(8)
    machines, workers, d = 2, 4, 4 * 2048
    layout = lpdec.make_layout(8, machines=machines)
    comp = lpdec.minmax(bits, chunk_size=2048)
    tx = _hierarchical_chain(layout, comp)
    params, opt_state = lpdec.init_nodes(tx, {"w": np.zeros((64, 128), np.float32)}, layout)

    def step(params, opt_state, g):
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    lowered = jax.jit(layout.map(step, (True, True, True))).lower(params, opt_state, params)
    traffic = lpdec.metrics.collective_traffic(lowered.compile().as_text())
    classes = len(lpdec.ring(machines).rounds[0].edge_classes)
    per_worker = traffic.bytes_by_op["collective-permute"]
    assert per_worker == classes * comp.wire_bytes(d // workers)
    assert workers * per_worker == classes * comp.wire_bytes(d)
    # Inside a machine: one all-reduce of the gradients, one all-gather of the update.
    assert traffic.bytes_by_dtype[("all-gather", "f32")] == 4 * d // workers


def test_shard_over_rejects_what_is_not_a_transform():
    with pytest.raises(TypeError, match="shard_over needs an optax transform"):
        lpdec.shard_over(lpdec.ring(2), axis_name="workers")


@pytest.mark.parametrize("compressor", ["identity", "minmax8"])
def test_compressed_mean_runs_between_the_machines_of_a_2d_mesh(rng, compressor):
    """Seed 004 on machines x workers (axis_name="machines", local_axis="workers") gives
    the numbers of the 1-D mesh of 2 devices with 4 nested nodes each; with lossless
    compression, the mean of all 8 gradients."""
    _need(8)
    comp = {"identity": lpdec.identity(), "minmax8": lpdec.minmax(8, "stochastic")}[compressor]
    grads = {"w": rng.normal(size=(8, 37)).astype(np.float32)}

    def mean_on(layout, axis_name, local_axis):
        tx = lpdec.compressed_mean(comp, axis_name=axis_name, local_axis=local_axis)

        def step(g, opt_state):
            return tx.update(g, opt_state)[0]

        _, opt_state = lpdec.init_nodes(tx, grads, layout, stacked=True)
        return np.asarray(
            jax.jit(layout.map(step, (True, True)))(layout.put(grads), opt_state)["w"]
        )

    machines = lpdec.make_layout(8, machines=2)
    got = mean_on(machines, machines.machine_axis, machines.worker_axis)
    nested = lpdec.make_layout(8, devices=jax.devices()[:2])
    np.testing.assert_array_equal(got, mean_on(nested, nested.mesh_axis, nested.local_axis))
    if compressor == "identity":
        np.testing.assert_allclose(got, np.tile(grads["w"].mean(0), (8, 1)), rtol=1e-5, atol=1e-6)


def _dyadic(rng, shape):
    """Multiples of 1/64: their mean over 8 nodes is exact in float32 in any order."""
    return (rng.integers(-256, 256, size=shape) / 64).astype(np.float32)


MEANS = {
    "local_mean": lambda axis: lpdec.local_mean(axis_name=axis),
    "compressed_mean": lambda axis: lpdec.compressed_mean(lpdec.identity(), axis_name=axis),
}


@pytest.mark.parametrize("layout_kind", ["machines", "nested"])
@pytest.mark.parametrize("name", sorted(MEANS))
def test_means_over_a_tuple_of_axes_average_every_node(rng, name, layout_kind):
    """axis_name=layout.axis_name, a tuple: ("machines", "workers") of the 2 x 4 mesh, or
    ("nodes", "local") of 8 nodes nested on 2 devices, is one flat axis of 8 nodes."""
    _need(8)
    layout = {
        "machines": lambda: lpdec.make_layout(8, machines=2),
        "nested": lambda: lpdec.make_layout(8, devices=jax.devices()[:2]),
    }[layout_kind]()
    assert (
        layout.axis_name
        == {"machines": ("machines", "workers"), "nested": ("nodes", "local")}[layout_kind]
    )
    tx = MEANS[name](layout.axis_name)
    grads = {"a": _dyadic(rng, (8, 5, 3)), "b": _dyadic(rng, (8, 7)), "c": _dyadic(rng, (8, 1))}

    def step(g, opt_state):
        return tx.update(g, opt_state)[0]

    _, opt_state = lpdec.init_nodes(tx, grads, layout, stacked=True)
    step = jax.jit(layout.map(step, (True, True)))
    got = step(layout.put(grads), opt_state)
    for k, g in grads.items():
        exact = np.broadcast_to(g.astype(np.float64).mean(axis=0), g.shape)
        np.testing.assert_array_equal(np.asarray(got[k]), exact)


def test_each_process_is_one_machine_of_its_own_devices():
    """Rows of the mesh follow the processes (sorted by device id inside), whatever
    order jax lists the devices in: the workers axis never spans two processes."""
    fake = [
        types.SimpleNamespace(process_index=p, id=i)
        for i, p in [(5, 1), (0, 0), (4, 1), (2, 0), (1, 0), (7, 1), (3, 0), (6, 1)]
    ]
    rows = lpdec.layout._machine_rows(fake, 2)
    assert [[d.id for d in row] for row in rows] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="machines=4 but the devices belong to 2 processes"):
        lpdec.layout._machine_rows(fake, 4)
    with pytest.raises(ValueError, match="the same number of devices"):
        lpdec.layout._machine_rows(fake[:-1], 2)


def test_the_sum_over_machines_and_workers_sends_one_buffer_between_machines(rng):
    """`gossip.local_sum` over (machines, workers) on 2 machines x 4: numpy's float64 sum,
    the same on every worker, and the only all-reduce carries a quarter of the buffer
    between a machine's worker and its peer (a reduce-scatter inside each machine, then
    an all-gather). One all-reduce over all 8 workers would run a ring whose link
    crossings carry 2 x 7/8 of the buffer."""
    _need(8)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("machines", "workers"))
    spec = jax.sharding.PartitionSpec("machines", "workers")
    x = rng.standard_normal((2, 4, 999)).astype(np.float32)  # (padded to 1,000 inside)
    total = jax.jit(
        jax.shard_map(
            lambda a: lpdec.gossip.local_sum(a, axis_name=("machines", "workers")),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
        )
    )
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    out = np.asarray(total(sharded))
    np.testing.assert_allclose(out, np.broadcast_to(x.astype(np.float64).sum((0, 1)), x.shape),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    assert all(np.array_equal(out[0, 0], out[m, w]) for m in range(2) for w in range(4))
    hlo = total.lower(sharded).compile().as_text()
    reduces = [line for line in hlo.splitlines() if " all-reduce(" in line]
    assert reduces and all("f32[250]" in line for line in reduces), reduces
    assert "reduce-scatter(" in hlo and "all-gather(" in hlo


@pytest.mark.parametrize("machines, workers", [(2, 4), (4, 2)])
def test_the_meter_puts_the_hierarchical_sum_on_the_links_it_runs_over(machines, workers):
    """`lpdec.wire`'s link bytes for `gossip.local_sum` over (machines, workers), counted
    from the schedule of the sum it runs: inside a machine a ring reduce-scatter of the
    (padded) buffer, workers - 1 steps of one of its `workers` blocks, and an all-gather
    of this worker's block to the workers - 1 others; between machines a ring all-reduce
    of that block, 2 (machines - 1) steps of 1/machines of it. The meter counts the
    buffer unpadded (999 floats of the padded 1,000): within 0.1%."""
    _need(8)
    names = ("machines", "workers")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(machines, workers), names)
    spec = jax.sharding.PartitionSpec(*names)
    total = jax.shard_map(
        lambda a: lpdec.gossip.local_sum(a, axis_name=names),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )
    with lpdec.wire.traffic_meter() as meter:
        jax.jit(total).lower(jax.ShapeDtypeStruct((machines, workers, 999), np.float32))
    block = 4 * 1000 / workers  # bytes of one worker's block of the padded buffer
    inside = (workers - 1) * block + (workers - 1) * block
    between = 2 * (machines - 1) * block / machines
    assert meter.link_bytes_by_axis == pytest.approx(
        {"workers": inside, "machines": between}, rel=1e-3
    )
    assert meter.bytes_by_axis == {"machines+workers": 4 * 999}  # the operand, as before
