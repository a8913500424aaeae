"""lpdec.fsdp: one model per machine split over its workers, against whole-model references."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

import lpdec  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def _mlp_params(rng):
    return {
        "w1": rng.normal(size=(12, 32)).astype(np.float32),
        "b1": rng.normal(size=(32,)).astype(np.float32),
        "w2": rng.normal(size=(32, 8)).astype(np.float32),
    }


def _mlp_loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - y) ** 2)


def test_each_leaf_is_cut_along_its_largest_dimension_the_workers_divide():
    plan = lpdec.plan_shards(
        {
            "a": np.zeros((6, 8)),
            "b": np.zeros((12, 8)),
            "c": np.zeros((3, 4, 5)),
            "d": np.zeros((4, 16)),
        },
        workers=4,
    )
    assert plan.dims == {"a": 1, "b": 0, "c": 1, "d": 1}
    assert plan.block_shapes == {"a": (6, 2), "b": (3, 8), "c": (3, 1, 5), "d": (4, 4)}
    # Ties go to the first dimension.
    assert lpdec.plan_shards({"w": np.zeros((8, 8))}, workers=2).dims == {"w": 0}


@pytest.mark.parametrize(
    "params, message",
    [
        ({"layer": {"bias": np.zeros((10,))}}, r"params\['layer'\]\['bias'\] has shape \(10,\)"),
        ({"w": np.zeros((2, 3))}, "no dimension divisible by the 4 workers"),
        ({"s": np.zeros(())}, r"params\['s'\] has shape \(\)"),
        ({}, "empty pytree"),
    ],
)
def test_a_leaf_the_workers_cannot_share_evenly_is_refused_in_one_line(params, message):
    with pytest.raises(ValueError, match=message) as info:
        lpdec.plan_shards(params, workers=4)
    assert "\n" not in str(info.value)


def test_split_put_and_unshard_reassemble_every_machines_model(rng):
    params = _mlp_params(rng)
    layout = lpdec.make_layout(8, machines=2)
    plan = lpdec.plan_shards(params, workers=4)
    blocks = plan.put(params, layout)
    for name, leaf in params.items():
        dim = plan.dims[name]
        # Device m * 4 + w holds block w of the leaf, cut by an independent slicing.
        size = leaf.shape[dim] // 4
        for device in range(8):
            w = device % 4
            expected = np.take(leaf, np.arange(w * size, (w + 1) * size), axis=dim)
            np.testing.assert_array_equal(np.asarray(blocks[name][device]), expected)
        # A device holds 1/4 of the leaf.
        shard = blocks[name].addressable_shards[0].data
        assert shard.size * 4 == leaf.size
    whole = plan.unshard(blocks)
    for name, leaf in params.items():
        np.testing.assert_array_equal(whole[name], np.stack([leaf, leaf]))


def test_a_sharded_step_takes_each_machines_whole_batch_gradient(rng):
    """Gather for the forward pass, reduce-scatter (the gather's gradient) / k: each
    machine's model moves by the gradient of its 4 workers' batches, computed here in
    float64 on the whole model."""
    params = _mlp_params(rng)
    layout = lpdec.make_layout(8, machines=2)
    plan = lpdec.plan_shards(params, workers=4)
    x = rng.normal(size=(8, 5, 12)).astype(np.float32)
    y = rng.normal(size=(8, 5, 8)).astype(np.float32)

    def step(blocks, x, y):
        grads = jax.grad(lambda b: _mlp_loss(plan.gather(b, layout.worker_axis), x, y))(blocks)
        return jax.tree.map(lambda p, g: p - 0.1 * g / plan.workers, blocks, grads)

    stepped = jax.jit(layout.map(step, (True, True, True)))(
        plan.put(params, layout), layout.put(x), layout.put(y)
    )
    whole = plan.unshard(stepped)
    with jax.enable_x64():
        p64 = jax.tree.map(lambda a: a.astype(np.float64), params)
        for machine in range(2):
            rows = range(4 * machine, 4 * machine + 4)
            loss = lambda p, rows=rows: sum(_mlp_loss(p, x[i], y[i]) for i in rows) / 4  # noqa: E731
            grads = jax.grad(loss)(p64)
            for name in params:
                expected = p64[name] - 0.1 * np.asarray(grads[name])
                np.testing.assert_allclose(whole[name][machine], expected, rtol=0, atol=2e-6)


def _diloco_with_error_feedback():
    """DiLoCo with Adam inside and a 4-bit error-feedback mean between the machines."""
    outer = optax.chain(
        lpdec.compressed_mean(lpdec.minmax(bits=4), axis_name="machines", error_feedback=True),
        optax.sgd(0.7, momentum=0.9, nesterov=True),
    )
    return lpdec.diloco(optax.adam(1e-3), outer, local_steps=4, axis_name="machines")


def test_the_optimizer_state_beside_the_blocks_is_a_quarter_of_the_replicated_one(rng):
    """Per device, parameters + Adam + DiLoCo (anchor, outer momentum) + compressed-mean
    error feedback, read from the arrays' addressable shards: 1/k of what a device holds
    when every worker keeps the whole model."""
    params = {"w": rng.normal(size=(256, 64)).astype(np.float32)}
    layout = lpdec.make_layout(8, machines=2)
    tx = _diloco_with_error_feedback()

    def device_bytes(tree):
        return sum(
            x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if x.size >= 1024
        )

    plan = lpdec.plan_shards(params, workers=4)
    blocks = plan.put(params, layout)
    state = jax.jit(layout.map(tx.init, (True,)))(blocks)
    sharded = device_bytes(blocks) + device_bytes(state)

    replicated_params = layout.put(np.broadcast_to(params["w"], (8, 256, 64)))
    replicated_params = {"w": replicated_params}
    replicated_state = jax.jit(layout.map(tx.init, (True,)))(replicated_params)
    replicated = device_bytes(replicated_params) + device_bytes(replicated_state)
    assert replicated >= 5 * params["w"].nbytes  # params, Adam's 2, anchor, momentum, EF
    assert sharded <= 1.1 * replicated / 4, (sharded, replicated)


def test_the_compiled_step_takes_a_quarter_of_the_replicated_arguments(rng):
    """The same per-device step (DiLoCo with Adam and a 4-bit error-feedback mean),
    compiled on blocks and on whole models: XLA's memory analysis of the program's
    arguments (parameters, state, gradients), per device."""
    params = {"w": rng.normal(size=(256, 64)).astype(np.float32)}
    layout = lpdec.make_layout(8, machines=2)
    tx = _diloco_with_error_feedback()

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def argument_bytes(params):
        state = jax.jit(layout.map(tx.init, (True,)))(params)
        program = jax.jit(layout.map(step, (True, True, True)))
        compiled = program.lower(params, state, params).compile()
        return compiled.memory_analysis().argument_size_in_bytes

    plan = lpdec.plan_shards(params, workers=4)
    sharded = argument_bytes(plan.put(params, layout))
    replicated = argument_bytes({"w": layout.put(np.broadcast_to(params["w"], (8, 256, 64)))})
    assert replicated >= 7 * params["w"].nbytes  # params, grads, Adam's 2, anchor, momentum, EF
    assert sharded <= 1.1 * replicated / 4, (sharded, replicated)
