"""The per-node programs of a training run, as jitted functions of global arrays.

Each is written for ONE node and mapped over all of them with
`NodeLayout.map` (one node per device, or several per device under vmap):
`train_chunk` runs `log_every` optimizer steps in a `lax.scan`, the others
initialise the optimizer state and evaluate.

Two tasks: classification (inputs x, labels y) and next-token prediction
(`next_token=True`: x holds windows of T + 1 tokens, the model reads the first T
and predicts the last T; y is unused). With a `plan` (`lpdec.fsdp.ShardPlan`)
each device holds its blocks of its machine's model: the programs gather the
whole leaves over the workers for the forward and backward pass, and the
gradient arrives reduce-scattered (each block's mean over the workers).
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
    model: nn.Module,
    tx: optax.GradientTransformation,
    layout: NodeLayout,
    *,
    next_token: bool = False,
    plan: lpdec.fsdp.ShardPlan | None = None,
) -> dict[str, Callable]:
    """Jitted global-array functions built from per-node ones (see `NodeLayout.map`)."""
    axis = layout.axis_name

    def whole(params):
        return plan.gather(params, layout.worker_axis) if plan is not None else params

    def apply(params, model_state, x, y, rngs, train):
        """(logits, targets, model_state) of a batch, on the whole model."""
        inputs, targets = (x[:, :-1], x[:, 1:].astype(jnp.int32)) if next_token else (x, y)
        variables = {"params": whole(params), **model_state}
        if model_state and train:
            logits, model_state = model.apply(
                variables, inputs, train=True, rngs=rngs, mutable=list(model_state)
            )
            return logits, targets, model_state
        return model.apply(variables, inputs, train=train, rngs=rngs), targets, model_state

    def loss_fn(params, model_state, x, y, rngs):
        logits, targets, model_state = apply(params, model_state, x, y, rngs, True)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        accuracy = jnp.mean(jnp.argmax(logits, -1) == targets)
        return loss, (accuracy, model_state)

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
            (loss, (accuracy, model_state)), grads = grad_fn(params, model_state, x, y, rngs)
            if plan is not None:
                # The gather's gradient summed the workers' gradients of each block.
                grads = jax.tree.map(lambda g: g / plan.workers, grads)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            carry = (params, opt_state, model_state)
            if not layout.nested:
                # The carry entered as varying over the nodes (`NodeLayout.map` casts the
                # initial state); keep every leaf so, e.g. a constant learning rate that
                # an optimizer stores, or check_vma rejects the scan.
                carry = lpdec.gossip.to_varying(carry, layout.mesh_axis)
            return carry, (loss, accuracy)

        steps = jnp.arange(xs.shape[0], dtype=jnp.int32)
        carry = (params, opt_state, model_state)
        if xs.shape[0] == 1:  # no loop at all (loop.Chunks runs CPU training so)
            carry, (loss, accuracy) = body(carry, (xs[0], ys[0], steps[0]))
            losses, accuracies = loss[None], accuracy[None]
        else:
            carry, (losses, accuracies) = jax.lax.scan(body, carry, (xs, ys, steps))
        return (*carry, losses, accuracies)

    def init_opt(params):
        return tx.init(params)

    def evaluate(params, model_state, x, y):
        """(summed loss, correct predictions) over a batch; targets count separately."""
        logits, targets, _ = apply(params, model_state, x, y, None, False)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(losses), jnp.sum(jnp.argmax(logits, -1) == targets)

    def distance(params, reference):
        """||x - reference||^2 of this node's parameters (or blocks), float32."""
        return sum(
            jnp.sum(jnp.square(x.astype(jnp.float32) - r.astype(jnp.float32)))
            for x, r in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True)
        )

    train_chunk = jax.jit(
        layout.map(chunk, (True, True, True, True, True, False, False)), donate_argnums=(0, 1, 2)
    )
    init = jax.jit(layout.map(init_opt, (True,)))
    # A model per node (its own, its blocks, or a per-node copy of a reference) on the
    # node's share of the test set; and one model, the same on every node, on it.
    node_eval = jax.jit(layout.map(evaluate, (True, True, True, True)))
    shared_eval = jax.jit(layout.map(evaluate, (False, False, True, True)))
    # Whether `average` returns a copy per node (else one replicated model).
    average_per_node = True
    if plan is None:
        # Each node's own model on the same examples.
        local_eval = jax.jit(layout.map(evaluate, (True, True, False, False)))
        if layout.hierarchical and not layout.nested:
            # Each machine's models cross the link once (lpdec.metrics.hierarchical_average).
            average = jax.jit(
                layout.map(
                    lambda tree: lpdec.metrics.hierarchical_average(
                        tree, layout.machine_axis, layout.worker_axis
                    ),
                    (True,),
                )
            )
        else:
            average = jax.jit(_on_every_device(lpdec.metrics.average_model, layout))
            average_per_node = False
    else:
        # Each worker evaluates its machine's model on its own share of the examples.
        local_eval = node_eval
        # Each worker averages its blocks over the machines: one model crosses the link
        # per machine.
        average = jax.jit(
            layout.map(lambda b: lpdec.fsdp.average_blocks(b, layout.machine_axis), (True,))
        )
    return dict(
        train_chunk=train_chunk,
        init=init,
        node_eval=node_eval,
        shared_eval=shared_eval,
        local_eval=local_eval,
        average=average,
        average_per_node=average_per_node,
        node_distance=jax.jit(layout.map(distance, (True, True))),
        shared_distance=jax.jit(layout.map(distance, (True, False))),
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
