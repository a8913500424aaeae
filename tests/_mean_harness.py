"""What tests/test_compressed_mean.py and tests/test_local_mean.py share: the program that
feeds every node the same gradients, and gradients of awkward sizes."""

import jax
import jax.numpy as jnp
import numpy as np

import lpdec
from lpdec import gossip
from lpdec import testing as harness

N = 8


AXIS = harness.AXIS


def _run_mean(tx, grads, *, mode, axes=(AXIS,), steps=1):
    """Feeds every device the same gradients `steps` times.

    grads: leaves [*mesh_shape, ...]. Returns numpy (updates [*mesh_shape, steps,
    ...], the last state).
    """
    k = len(axes)

    def program(g):
        if mode == "shard_map":
            g = jax.tree.map(lambda x: x.reshape(x.shape[k:]), g)

        def body(state, _):
            u, state = tx.update(g, state)
            return state, u

        state, us = jax.lax.scan(body, tx.init(g), length=steps)
        out = gossip.to_varying((us, state), axes)
        if mode == "shard_map":
            out = jax.tree.map(lambda x: x.reshape((1,) * k + x.shape), out)
        return out

    if mode == "vmap":
        fn = program
        for name in reversed(axes):
            fn = jax.vmap(fn, axis_name=name)
        return harness.to_numpy(jax.jit(fn)(grads))
    mesh = jax.make_mesh(jax.tree.leaves(grads)[0].shape[:k], axes)
    spec = jax.P(*axes)
    fn = lpdec.layout.shard_map(program, mesh=mesh, in_specs=spec, out_specs=spec)
    return harness.to_numpy(jax.jit(fn)(jax.device_put(grads, jax.NamedSharding(mesh, spec))))


def _gradients(rng, n=N):
    """Leaves of awkward sizes (3 < n, empty, bfloat16) and node-dependent scales."""
    scale = rng.uniform(0.5, 3.0, size=(n, 1)).astype(np.float32)
    return {
        "a": (scale * rng.standard_normal((n, 1000)) + 1.0).astype(np.float32),
        "b": (scale[:, :, None] * rng.standard_normal((n, 5, 3))).astype(np.float32),
        "c": rng.standard_normal((n, 3)).astype(np.float32),
        "d": jnp.asarray(rng.standard_normal((n, 11)), jnp.bfloat16),
        "e": np.zeros((n, 0), np.float32),
    }
