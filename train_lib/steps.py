"""The per-node programs of a training run, as jitted functions of global arrays.

Each is written for ONE node and mapped over all of them with
`NodeLayout.map` (one node per device, or several per device under vmap):
`train_chunk` runs `log_every` optimizer steps in a `lax.scan`, the others
initialise the optimizer state and evaluate.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import lpdec
from lpdec.layout import NodeLayout


def make_programs(
    model: nn.Module, tx: optax.GradientTransformation, layout: NodeLayout
) -> dict[str, Callable]:
    """Jitted global-array functions built from per-node ones (see `NodeLayout.map`)."""
    axis = layout.axis_name

    def apply(params, model_state, x, rngs, train):
        variables = {"params": params, **model_state}
        if model_state and train:
            return model.apply(variables, x, train=True, rngs=rngs, mutable=list(model_state))
        return model.apply(variables, x, train=train, rngs=rngs), model_state

    def loss_fn(params, model_state, x, y, rngs):
        logits, model_state = apply(params, model_state, x, rngs, True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, (logits, model_state)

    def chunk(params, opt_state, model_state, xs, ys, step0, key):
        node = jax.lax.axis_index(axis)

        def body(carry, inputs):
            params, opt_state, model_state = carry
            x, y, k = inputs
            step_key = jax.random.fold_in(jax.random.fold_in(key, step0 + k), node)
            rngs = {
                "quant": jax.random.fold_in(step_key, 0),
                "dropout": jax.random.fold_in(step_key, 1),
            }
            grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
            (loss, (logits, model_state)), grads = grad_fn(params, model_state, x, y, rngs)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            accuracy = jnp.mean(jnp.argmax(logits, -1) == y)
            carry = (params, opt_state, model_state)
            if not layout.nested:
                # The carry entered as varying over the nodes (`NodeLayout.map` casts the
                # initial state); keep every leaf so, e.g. a constant learning rate that
                # an optimizer stores, or check_vma rejects the scan.
                carry = lpdec.gossip.to_varying(carry, layout.mesh_axis)
            return carry, (loss, accuracy)

        steps = jnp.arange(xs.shape[0], dtype=jnp.int32)
        carry, (losses, accuracies) = jax.lax.scan(
            body, (params, opt_state, model_state), (xs, ys, steps)
        )
        return (*carry, losses, accuracies)

    def init_opt(params):
        return tx.init(params)

    def correct(params, model_state, x, y):
        logits, _ = apply(params, model_state, x, None, False)
        return jnp.sum(jnp.argmax(logits, -1) == y)

    train_chunk = jax.jit(
        layout.map(chunk, (True, True, True, True, True, False, False)), donate_argnums=(0, 1, 2)
    )
    init = jax.jit(layout.map(init_opt, (True,)))
    local_correct = jax.jit(layout.map(correct, (True, True, False, False)))
    # The averaged model evaluates a 1/n shard of the test set on every node.
    shard_correct = jax.jit(layout.map(correct, (False, False, True, True)))
    average = jax.jit(_on_every_device(lpdec.metrics.average_model, layout))
    consensus = jax.jit(_on_every_device(lpdec.metrics.consensus_distance, layout))
    return dict(
        train_chunk=train_chunk,
        init=init,
        local_correct=local_correct,
        shard_correct=shard_correct,
        average=average,
        consensus=consensus,
    )


def _on_every_device(reduce: Callable, layout: NodeLayout) -> Callable:
    """`reduce` of all nodes' values, computed whole on every device.

    The nodes' arrays are first gathered onto every device (an exact copy), so the
    sums inside `reduce` run in one order whatever the layout. Split over the
    devices, they would end in an all-reduce whose order is the collective's own
    (gloo's across processes), and 2 processes x 4 devices would log other last
    bits than 1 x 8 from the same parameters.
    """

    def gathered(tree):
        tree = jax.lax.with_sharding_constraint(tree, layout.replicated)
        return jax.lax.with_sharding_constraint(reduce(tree), layout.replicated)

    return gathered
