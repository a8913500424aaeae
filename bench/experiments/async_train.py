"""Seed 003's recipe on MNIST-1D trained through `lpdec.async_sim` (AD-PSGD, Moniqua on
AD-PSGD) and, in the same harness, synchronous D-PSGD at the same number of gradients.

Everything train.py's seed-003 runs fix is taken from `seed003_config`: the data
(MNIST-1D, 10,000 sequences, 8,000 for training, IID over the workers), the 1-D CNN,
batch 32, heavy-ball momentum 0.9, weight decay 5e-4 and lr 0.1 decayed x0.1 at 50% and
75% of the gradients. The local transform is `add_decayed_weights` then `trace`, which
with the step -alpha d is optax.sgd(momentum=0.9) after weight decay, train.py's
optimizer. A minibatch is 32 indices drawn with replacement from the worker's shard by
a key folded with the gradient's index (train.py walks epochs instead).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import lpdec
from bench.experiments.runner import placeholder_curve
from lpdec import async_sim
from train_lib import setup


class Task:
    """The data, model, loss and gradient of one seed's run (built once, reused by its runs)."""

    def __init__(self, config):
        dataset = setup.load_dataset(config)
        self.n = config.num_nodes
        parts = lpdec.data.skew_partition(dataset.y_train, self.n, config.skew, config.seed)
        m = min(len(p) for p in parts)
        self.parts = jnp.asarray(np.stack([p[:m] for p in parts]), jnp.int32)
        self.x_train = jnp.asarray(dataset.x_train, jnp.float32)
        self.y_train = jnp.asarray(dataset.y_train, jnp.int32)
        self.x_test = jnp.asarray(dataset.x_test, jnp.float32)
        self.y_test = jnp.asarray(dataset.y_test, jnp.int32)
        self.batch = config.batch_size
        self.recipe = (config.learning_rate, tuple(config.lr_boundaries), config.lr_decay)
        self.model = lpdec.models.get_model("cnn1d", num_classes=dataset.num_classes)
        variables = self.model.init(jax.random.key(config.seed), self.x_train[:1], train=False)
        self.params = variables["params"]
        self.data_key = jax.random.key(1000 + config.seed)
        self.local = optax.chain(
            optax.add_decayed_weights(config.weight_decay), optax.trace(config.momentum)
        )
        self.grad_fn = functools.partial(_grad, self)
        self.step_grads = jax.jit(jax.vmap(self.grad_fn, in_axes=(0, 0, 0)))

    def loss(self, params, x, y):
        logits = self.model.apply({"params": params}, x, train=True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def stacked(self):
        return jax.tree.map(lambda v: jnp.broadcast_to(v, (self.n, *v.shape)), self.params)

    @functools.partial(jax.jit, static_argnums=0)
    def test_accuracy(self, stacked):
        """(test accuracy, test loss) of the averaged model."""
        mean = jax.tree.map(lambda v: v.mean(0), stacked)
        logits = self.model.apply({"params": mean}, self.x_test, train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, self.y_test).mean()
        return jnp.mean(jnp.argmax(logits, -1) == self.y_test), loss

    @functools.partial(jax.jit, static_argnums=0)
    def final_metrics(self, stacked, adjacency):
        """(train loss of the averaged model on 2,000 training sequences, consensus
        distance: mean over workers of ||x_i - mean||^2, the largest elementwise
        |x_i - x_j| over the edges: what Moniqua's theta must bound)."""
        mean = jax.tree.map(lambda v: v.mean(0), stacked)
        logits = self.model.apply({"params": mean}, self.x_train[:2000], train=False)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, self.y_train[:2000])
        leaves = jax.tree.leaves(stacked)
        spread = sum(jnp.sum((v - v.mean(0)) ** 2) for v in leaves) / self.n
        gap = jnp.max(
            jnp.stack(
                [
                    jnp.max(
                        jnp.where(
                            adjacency[(...,) + (None,) * (v.ndim - 1)],
                            jnp.abs(v[:, None] - v[None]),
                            0.0,
                        )
                    )
                    for v in leaves
                ]
            )
        )
        return loss.mean(), spread, gap


def _grad(task: Task, params, worker, k):
    """Worker `worker`'s stochastic gradient at `params`; the minibatch is drawn from k."""
    idx = jax.random.randint(
        jax.random.fold_in(task.data_key, k), (task.batch,), 0, task.parts.shape[1]
    )
    rows = task.parts[worker, idx]
    return jax.grad(task.loss)(params, task.x_train[rows], task.y_train[rows])


def _record(task, stacked, topology, curve, started, steps):
    adjacency = jnp.asarray((topology.mixing_matrix() > 0) & ~np.eye(task.n, dtype=bool))
    train_loss, spread, gap = (float(v) for v in task.final_metrics(stacked, adjacency))
    return {
        "final_test_accuracy": curve[-1][1],
        "final_test_loss": curve[-1][2],
        "final_train_loss": train_loss,
        "final_consensus_distance": spread,
        "max_neighbour_gap": gap,
        "diverged": not np.isfinite(train_loss),
        "steps": steps,
        "total_steps": steps,
        "wall_clock_s": time.time() - started,
        "curve": curve,
    }


def _placeholder_record(numbers: dict, started: float, steps: int, chunks: int) -> dict:
    """A dry run's record: `_record`'s fields, with `numbers` (`runner.placeholder`)."""
    points = [int(b) for b in np.linspace(0, steps, chunks + 1).astype(int)[1:]]
    curve = placeholder_curve(numbers, points)
    return {
        "final_test_accuracy": curve[-1][1],
        "final_test_loss": curve[-1][2],
        "final_train_loss": numbers["loss"],
        "final_consensus_distance": numbers["consensus"],
        "max_neighbour_gap": numbers["consensus"],
        "diverged": False,
        "steps": steps,
        "total_steps": steps,
        "wall_clock_s": time.time() - started,
        "curve": curve,
        "dry_run": True,
    }


def train_async(
    task: Task,
    topology,
    steps: int,
    *,
    speeds,
    compressor,
    max_delay,
    seed,
    chunks=5,
    placeholder=None,
):
    """AD-PSGD (compressor None) or Moniqua on AD-PSGD for steps x n iterations
    (gradients), evaluated `chunks` times; the schedule's delays come from the speeds.
    With `placeholder` (a dry run's numbers), everything up to the first iteration is
    built, and the record holds those numbers instead of training's."""
    started = time.time()
    total = steps * task.n
    schedule = async_sim.ad_psgd_schedule(
        topology, total, max_delay=max_delay, speeds=speeds, delays="speeds", seed=seed
    )
    lr = lr_schedule(task.recipe, total)
    x = task.stacked()
    state = async_sim.init(x, max_delay=max_delay, local_transform=task.local, seed=seed)
    delays = {
        "mean_delay": float(schedule.delay.mean()),
        "max_delay_seen": int(schedule.delay.max()),
    }
    if placeholder is not None:
        return _placeholder_record(placeholder, started, steps, chunks) | delays
    curve = []
    bounds = np.linspace(0, total, chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        x, state = async_sim.run(
            x,
            state,
            schedule.chunk(a, b),
            task.grad_fn,
            lr,
            compressor=compressor,
            local_transform=task.local,
        )
        acc, test_loss = task.test_accuracy(x)
        curve.append([int(b) // task.n, float(acc), float(test_loss)])
    return _record(task, x, topology, curve, started, steps) | delays


@functools.cache
def lr_schedule(recipe: tuple, total: int) -> optax.Schedule:
    """The recipe's step decay over `total` updates; one object per length, so the
    compiled programs (which take it as a static argument) are reused."""
    lr, boundaries, decay = recipe
    return optax.piecewise_constant_schedule(lr, {int(f * total): decay for f in boundaries})


def train_sync(task: Task, topology, steps: int, *, chunks=5, placeholder=None):
    """Synchronous D-PSGD, x+ = W x - alpha d (combine-then-adapt, as lpdec.dpsgd), for
    `steps` steps of n gradients each; the minibatch of worker i at step t is drawn from
    k = t n + i. With `placeholder`, as in `train_async`."""
    started = time.time()
    w = jnp.asarray(topology.mixing_matrix(), jnp.float32)
    lr = lr_schedule(task.recipe, steps)
    x = task.stacked()
    opt = jax.vmap(task.local.init)(x)
    workers = jnp.arange(task.n, dtype=jnp.int32)
    if placeholder is not None:
        return _placeholder_record(placeholder, started, steps, chunks)

    @jax.jit
    def chunk(x, opt, ts):
        def step(carry, t):
            x, opt = carry
            g = task.step_grads(x, workers, t * task.n + workers)
            d, opt = jax.vmap(task.local.update)(g, opt, x)
            mixed = jax.tree.map(lambda v: jnp.einsum("ij,j...->i...", w, v), x)
            return (jax.tree.map(lambda m, u: m - lr(t) * u, mixed, d), opt), None

        return jax.lax.scan(step, (x, opt), ts)[0]

    curve = []
    bounds = np.linspace(0, steps, chunks + 1).astype(int)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        x, opt = chunk(x, opt, jnp.arange(a, b, dtype=jnp.int32))
        acc, test_loss = task.test_accuracy(x)
        curve.append([int(b), float(acc), float(test_loss)])
    return _record(task, x, topology, curve, started, steps)
