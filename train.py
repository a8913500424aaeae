r"""Low-precision decentralized training with lpdec, in the style of the flax examples.

    python train.py --config=configs/quickstart.py --workdir=/tmp/lpdec_quickstart
    python train.py --config=configs/quickstart.py --workdir=/tmp/q --config.algorithm=dcd

`main()` parses the flags, starts multi-host JAX when asked
(`--coordinator_address`, `--num_processes`, `--process_id`), logs the devices
and calls `train_and_evaluate(config, workdir)`, which does the work: per-node
non-IID partitions of an offline data set, the model (fp32 or 8-bit), the
optimizer chain (a local optimizer and an lpdec algorithm), the steps on every
node (`lpdec.layout`: one node per device, or several simulated nodes per
device), metrics (stdout, `metrics.csv`, TensorBoard event files), orbax
checkpoints that a restarted run resumes from exactly, and `summary.json`.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import sys
import time
from typing import Any

import jax
import jax.experimental.multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import lpdec
from lpdec import registry
from lpdec.algorithms._common import Health
from lpdec.layout import NodeLayout
from lpdec.layout import make_layout

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summary.json.")
config_flags.DEFINE_config_file("config", None, "Training configuration file.", lock_config=True)
flags.DEFINE_string("coordinator_address", None, "Multi-host: address:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: index of this process.")

DATASETS = ("cifar10", "digits", "mnist1d", "synthetic")
PRECISIONS = ("fp32", "int8")
METRIC_FIELDS = (
    "step",
    "epoch",
    "train_loss",
    "train_accuracy",
    "test_accuracy_avg_model",
    "test_accuracy_local_mean",
    "consensus_distance",
    "wire_bytes_per_step",
    "step_time_s",
    "learning_rate",
    "nonfinite_updates",
    "nonfinite_received",
)


# ----------------------------------------------------------------------------
# Config checks: one clear line per problem, before any tracing.
# ----------------------------------------------------------------------------


def _fail(message: str):
    raise registry.ConfigError(message)


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Raises `registry.ConfigError` naming the first field that cannot work."""
    if config.dataset not in DATASETS:
        _fail(f"config.dataset={config.dataset!r} is not one of: {', '.join(DATASETS)}.")
    if config.dataset == "cifar10":
        if not config.data_dir:
            _fail("config.dataset='cifar10' needs config.data_dir: the CIFAR-10 binary files.")
        if not os.path.isdir(config.data_dir):
            _fail(
                f"config.data_dir={config.data_dir!r} is not a directory; it must hold the "
                "CIFAR-10 binary version (data_batch_1.bin ... test_batch.bin)."
            )
    if config.model not in lpdec.models.MODELS:
        _fail(
            f"config.model={config.model!r} is not one of: "
            f"{', '.join(sorted(lpdec.models.MODELS))}."
        )
    if config.precision not in PRECISIONS:
        _fail(f"config.precision={config.precision!r} is not one of: fp32, int8.")
    if not 0.0 <= config.skew <= 1.0:
        _fail(f"config.skew={config.skew!r} must be in [0, 1] (0 = IID).")
    for field in ("num_nodes", "batch_size", "log_every"):
        if not isinstance(config[field], int) or config[field] < 1:
            _fail(f"config.{field}={config[field]!r} must be a positive integer.")
    if config.num_steps < 0 or config.num_epochs < 0 or not (config.num_steps or config.num_epochs):
        _fail("set config.num_steps (> 0) or config.num_epochs (> 0).")
    if config.checkpoint_every % config.log_every:
        _fail(
            f"config.checkpoint_every={config.checkpoint_every} must be a multiple of "
            f"config.log_every={config.log_every} (steps run in chunks of log_every)."
        )
    topology = registry.make_topology(
        config.topology, config.num_nodes, seed=config.seed, torus_rows=config.torus_rows
    )
    compressor = make_compressor(config)
    registry.make_algorithm(
        config.algorithm, topology, compressor, axis_name="nodes", gamma=config.gamma
    )
    registry.make_schedule(config.lr_schedule, config.learning_rate, 1)
    registry.make_local_optimizer(config.optimizer, 0.1)
    devices = jax.device_count()
    if config.devices:
        if not 1 <= config.devices <= devices:
            _fail(f"config.devices={config.devices} must be in 1..{devices} (0 = all devices).")
        devices = config.devices
    if config.hierarchical:
        if config.algorithm != "compressed_mean":
            _fail("config.hierarchical=True needs config.algorithm='compressed_mean'.")
        if config.num_nodes <= devices:
            _fail(
                "config.hierarchical=True needs several nodes per device (the devices are "
                "the machines): set config.devices below config.num_nodes."
            )
    if config.num_nodes > devices and config.num_nodes % devices:
        _fail(
            f"config.num_nodes={config.num_nodes} exceeds the {devices} devices and is not a "
            f"multiple of {devices}: simulated nodes are spread evenly over the devices."
        )


def make_compressor(config):
    return registry.make_compressor(
        config.compressor,
        bits=config.bits,
        rounding=config.rounding,
        chunk_size=config.chunk_size,
        ratio=config.ratio,
        theta=config.theta,
    )


# ----------------------------------------------------------------------------
# Data, model, optimizer.
# ----------------------------------------------------------------------------


def load_dataset(config) -> lpdec.data.Dataset:
    try:
        return _load_dataset(config.dataset, config.data_dir, config.num_samples, config.seed)
    except (FileNotFoundError, ValueError) as error:
        if config.dataset != "cifar10":
            raise
        _fail(f"config.data_dir={config.data_dir!r}: {error}")


@functools.lru_cache(maxsize=2)
def _load_dataset(name: str, data_dir: str, num_samples: int, seed: int) -> lpdec.data.Dataset:
    # Cached: the data sets are deterministic in these arguments, and generating
    # MNIST-1D takes longer than a short run (bench/experiments.py runs hundreds).
    if name == "cifar10":
        return lpdec.data.cifar10(data_dir)
    if name == "mnist1d":
        return lpdec.data.mnist1d(num_samples=num_samples)
    if name == "synthetic":
        return lpdec.data.synthetic(num_samples, 16, 4, seed)
    return lpdec.data.digits()


def make_model(config, num_classes: int):
    kwargs = dict(config.model_kwargs)
    return lpdec.models.get_model(
        config.model,
        precision=config.precision,
        norm=config.norm or None,
        num_classes=num_classes,
        **kwargs,
    )


def training_length(config, samples_used: int) -> tuple[int, int]:
    """(total steps, steps per epoch); an epoch is one pass of every node over its data."""
    per_epoch = max(1, samples_used // (config.num_nodes * config.batch_size))
    total = config.num_steps or int(round(config.num_epochs * per_epoch))
    return max(total, 1), per_epoch


def make_optimizer(config, total_steps: int, layout: NodeLayout):
    boundaries = [int(f * total_steps) for f in config.lr_boundaries]
    schedule = registry.make_schedule(
        config.lr_schedule,
        config.learning_rate,
        total_steps,
        boundaries=boundaries,
        decay=config.lr_decay,
        warmup=config.warmup_steps,
    )
    local = registry.make_local_optimizer(
        config.optimizer, schedule, momentum=config.momentum, weight_decay=config.weight_decay
    )
    topology = registry.make_topology(
        config.topology, config.num_nodes, seed=config.seed, torus_rows=config.torus_rows
    )
    theta = config.theta
    if config.theta_follows_lr:
        # seed 003, Theorem 2: the a-priori bound proportional to the step size.
        theta = lambda step: config.theta * schedule(step) / config.learning_rate  # noqa: E731
    axis_name, local_axis = layout.axis_name, None
    if config.hierarchical:
        # Seed 004: the mesh axis joins the "machines", the nested vmap axis the
        # devices inside each: compressed_mean reduces inside, compresses across.
        axis_name, local_axis = layout.mesh_axis, layout.local_axis
    algorithm = registry.make_algorithm(
        config.algorithm,
        topology,
        make_compressor(config),
        axis_name=axis_name,
        local_axis=local_axis,
        gamma=config.gamma,
        theta=theta,
        slack=config.slack,
        seed=config.seed,
    )
    return registry.make_chain(config.algorithm, local, algorithm), schedule


# ----------------------------------------------------------------------------
# Per-node programs.
# ----------------------------------------------------------------------------


def make_programs(model, tx, layout: NodeLayout):
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
    average = jax.jit(lpdec.metrics.average_model, out_shardings=layout.replicated)
    consensus = jax.jit(lpdec.metrics.consensus_distance, out_shardings=layout.replicated)
    return dict(
        train_chunk=train_chunk,
        init=init,
        local_correct=local_correct,
        shard_correct=shard_correct,
        average=average,
        consensus=consensus,
    )


def to_host(tree):
    """Per-node global arrays -> numpy on every process (they span all hosts' devices)."""
    if jax.process_count() > 1:
        tree = jax.experimental.multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree.map(np.asarray, tree)


def health_totals(opt_state) -> tuple[int, int]:
    """Sum of every node's non-finite counters found in the optimizer state."""
    found = [
        h
        for h in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, Health))
        if isinstance(h, Health)
    ]
    found = to_host(found)
    updates = sum(int(np.sum(h.nonfinite_updates)) for h in found)
    received = sum(int(np.sum(h.nonfinite_received)) for h in found)
    return updates, received


# ----------------------------------------------------------------------------
# Logging.
# ----------------------------------------------------------------------------


class MetricWriter:
    """stdout + metrics.csv + TensorBoard, written by process 0 only."""

    def __init__(self, workdir: str, resume_step: int):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, "metrics.csv")
        self.tensorboard = None
        if not self.enabled:
            return
        rows = []
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, METRIC_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
        try:
            from tensorboardX import SummaryWriter

            self.tensorboard = SummaryWriter(os.path.join(workdir, "tensorboard"))
        except ImportError:
            logging.warning("tensorboardX is not installed: no TensorBoard event files.")

    def write(self, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        logging.info(
            "step %d: %s",
            metrics["step"],
            ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k != "step"),
        )
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, METRIC_FIELDS).writerow(metrics)
        if self.tensorboard is not None:
            for k, v in metrics.items():
                if k != "step":
                    self.tensorboard.add_scalar(k, v, metrics["step"])
            self.tensorboard.flush()

    def close(self):
        if self.tensorboard is not None:
            self.tensorboard.close()


def progress(step: int, total: int, started: float) -> None:
    if jax.process_index() != 0 or not sys.stderr.isatty():
        return
    done = step / total
    rate = step / max(time.time() - started, 1e-9)
    bar = "#" * int(30 * done)
    sys.stderr.write(f"\r[{bar:<30}] {step}/{total} steps, {rate:.1f} steps/s ")
    sys.stderr.flush()
    if step == total:
        sys.stderr.write("\n")


# ----------------------------------------------------------------------------
# The run.
# ----------------------------------------------------------------------------


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
    """Trains `config` and writes metrics, checkpoints and summary.json into `workdir`.

    Resumes from the latest checkpoint in `workdir` if there is one.

    Returns:
      The summary (also written to `workdir/summary.json`).
    """
    validate_config(config)
    started = time.time()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)

    dataset = load_dataset(config)
    n = config.num_nodes
    devices = jax.devices()[: config.devices] if config.devices else None
    layout = make_layout(n, devices=devices)
    parts = lpdec.data.skew_partition(dataset.y_train, n, config.skew, config.seed)
    batcher = lpdec.data.NodeBatcher(
        dataset.x_train,
        dataset.y_train,
        parts,
        config.batch_size,
        config.seed,
        augment=config.augment,
    )
    total_steps, steps_per_epoch = training_length(config, sum(len(p) for p in parts))

    model = make_model(config, dataset.num_classes)
    init_key = jax.random.key(config.seed)
    variables = jax.jit(lambda x: model.init(init_key, x, train=False))(dataset.x_train[:1])
    variables = jax.tree.map(np.asarray, variables)
    params = variables.pop("params")
    model_state = dict(variables)
    # Every node starts from the same model, as in seed 002.
    stack = lambda tree: jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree)  # noqa: E731
    params, model_state = layout.put(stack(params)), layout.put(stack(model_state))

    tx, schedule = make_optimizer(config, total_steps, layout)
    programs = make_programs(model, tx, layout)
    opt_state = programs["init"](params)
    key = layout.put(jax.random.key_data(jax.random.key(config.seed + 1)), per_node=False)

    # Restore the latest checkpoint of this workdir, if any.
    manager = ocp.CheckpointManager(
        os.path.join(workdir, "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True),
    )
    state = {"params": params, "opt_state": opt_state, "model_state": model_state}
    step = 0
    if manager.latest_step() is not None:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
        )
        restored = manager.restore(
            manager.latest_step(),
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
            ),
        )
        state, step = restored["state"], int(restored["meta"]["step"])
        batcher.restore(restored["meta"]["batcher"])
        logging.info("resumed from step %d of %s", step, workdir)
    params, opt_state, model_state = state["params"], state["opt_state"], state["model_state"]

    # Test data: the averaged model sees a 1/n shard per node; local models a subset.
    test_per_node = len(dataset.x_test) // n
    test_x = dataset.x_test[: test_per_node * n].reshape(
        (n, test_per_node) + dataset.x_test.shape[1:]
    )
    test_y = dataset.y_test[: test_per_node * n].reshape(n, test_per_node)
    shard_x, shard_y = layout.put(test_x), layout.put(test_y)
    local_count = min(config.eval_local_examples, len(dataset.x_test))
    local_x = layout.put(dataset.x_test[:local_count], per_node=False)
    local_y = layout.put(dataset.y_test[:local_count], per_node=False)

    writer = MetricWriter(workdir, step)
    compiled: dict[int, Any] = {}
    wire_bytes, wire_source, collectives, bytes_by_axis = None, None, None, {}
    halt_at = step + config.halt_after_steps if config.halt_after_steps else None
    metrics: dict[str, Any] = {}
    loop_started = time.time()
    while step < total_steps:
        length = min(config.log_every, total_steps - step)
        xs, ys = zip(*(batcher.next() for _ in range(length)), strict=True)
        xs, ys = layout.put(np.stack(xs, axis=1)), layout.put(np.stack(ys, axis=1))
        step0 = layout.put(np.int32(step), per_node=False)
        args = (params, opt_state, model_state, xs, ys, step0, key)
        if length not in compiled:
            with lpdec.wire.traffic_meter() as meter:
                compiled[length] = programs["train_chunk"].lower(*args).compile()
            if wire_bytes is None:
                collectives, bytes_by_axis = meter.collectives, dict(meter.bytes_by_axis)
                # Bytes one node sends per step: read from the compiled program when
                # every node has its own device; when nodes share devices the HLO shows
                # none (or inflated) collectives, so the trace-time meter counts them
                # (the two agree where both apply: tests/test_algorithms.py).
                if layout.per_device == 1:
                    traffic = lpdec.metrics.collective_traffic(compiled[length].as_text())
                    wire_bytes, wire_source = traffic.total_bytes, "compiled HLO"
                else:
                    wire_bytes, wire_source = meter.bytes, "trace-time meter"
        chunk_started = time.time()
        params, opt_state, model_state, losses, accuracies = compiled[length](*args)
        losses, accuracies = to_host((losses, accuracies))
        step_time = (time.time() - chunk_started) / length
        step += length

        avg_params = programs["average"](params)
        avg_state = programs["average"](model_state)
        avg_correct = to_host(programs["shard_correct"](avg_params, avg_state, shard_x, shard_y))
        local_correct = to_host(programs["local_correct"](params, model_state, local_x, local_y))
        nonfinite = health_totals(opt_state)
        metrics = {
            "step": step,
            "epoch": step / steps_per_epoch,
            "train_loss": float(np.mean(losses)),
            "train_accuracy": float(np.mean(np.asarray(accuracies))),
            "test_accuracy_avg_model": float(avg_correct.sum() / (test_per_node * n)),
            "test_accuracy_local_mean": float(local_correct.mean() / local_count),
            "consensus_distance": float(programs["consensus"](params)),
            "wire_bytes_per_step": float(wire_bytes),
            "step_time_s": step_time,
            "learning_rate": float(schedule(step - 1)),
            "nonfinite_updates": nonfinite[0],
            "nonfinite_received": nonfinite[1],
        }
        writer.write(metrics)
        progress(step, total_steps, loop_started)
        if (
            (config.checkpoint_every and step % config.checkpoint_every == 0)
            or step == total_steps
            or step == halt_at
        ):
            manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(
                        {"params": params, "opt_state": opt_state, "model_state": model_state}
                    ),
                    meta=ocp.args.JsonSave({"step": step, "batcher": batcher.state()}),
                ),
            )
        if step == halt_at:
            logging.info(
                "halting after %d steps (config.halt_after_steps)", config.halt_after_steps
            )
            break
    manager.wait_until_finished()
    writer.close()

    summary = {
        "final": metrics,
        "steps": step,
        "total_steps": total_steps,
        "halted": step < total_steps,
        "wall_time_s": time.time() - started,
        "num_nodes": n,
        "devices": jax.device_count(),
        "processes": jax.process_count(),
        "nodes_per_device": layout.per_device,
        "wire_bytes_source": wire_source,
        "collectives_per_step": collectives,
        "wire_bytes_by_axis": bytes_by_axis,
        "config": config.to_dict(),
    }
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=str)
    if config.save_final_params:
        gathered = jax.experimental.multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() == 0:
            flat = {
                jax.tree_util.keystr(k): np.asarray(v)
                for k, v in jax.tree.leaves_with_path(gathered)
            }
            np.savez(os.path.join(workdir, "final_params.npz"), **flat)
    return summary


def quiet_orbax() -> None:
    """Orbax logs every checkpoint step at INFO through absl; keep lpdec's lines readable."""
    logging.get_absl_handler().addFilter(lambda record: "orbax" not in record.pathname)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    quiet_orbax()
    if FLAGS.coordinator_address:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=FLAGS.coordinator_address,
            num_processes=FLAGS.num_processes,
            process_id=FLAGS.process_id,
        )
    logging.info(
        "process %d of %d; %d local / %d global devices: %s",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )
    try:
        train_and_evaluate(FLAGS.config, FLAGS.workdir)
    except registry.ConfigError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(2)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
