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

The config becomes objects in one place, `train_lib.setup.build` (names are
looked up in `train_lib.registry`); the per-node programs are in
`train_lib.steps`, checkpoints in `train_lib.checkpoint`, metric files in
`train_lib.metrics`.
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import signal
import sys
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

import lpdec
from train_lib import checkpoint
from train_lib import metrics as metrics_lib
from train_lib import processes
from train_lib import setup
from train_lib import steps
from train_lib import watchdog
from train_lib import workdir as workdir_lib
from train_lib.registry import RunError

FLAGS = flags.FLAGS
flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summary.json.")
config_flags.DEFINE_config_file("config", None, "Training configuration file.", lock_config=True)
flags.DEFINE_string("coordinator_address", None, "Multi-host: address:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: index of this process.")
flags.DEFINE_string(
    "coordinator_bind_address",
    None,
    "Multi-host: where process 0's coordinator listens (default: the host of "
    "--coordinator_address, so a loopback address stays on loopback; never all interfaces).",
)
flags.DEFINE_integer(
    "peer_timeout", 300, "Multi-host: seconds to wait for every process to connect, then exit 2."
)
flags.DEFINE_integer(
    "heartbeat_timeout",
    60,
    "Multi-host: seconds without a heartbeat after which a connected process counts as lost "
    "(a killed process is noticed at once), then exit 4.",
)
flags.DEFINE_float(
    "stop_timeout",
    10,
    "Seconds after SIGTERM/SIGINT by which the run exits even if it has not reached a step "
    "boundary (a checkpoint still being written is then abandoned).",
)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    stop: watchdog.StopSignals | None = None,
) -> dict[str, Any]:
    """Trains `config` and writes metrics, checkpoints and summary.json into `workdir`.

    Resumes from the newest intact checkpoint in `workdir` if there is one (see
    `train_lib.checkpoint`), and holds the workdir's lock while it runs. With
    `stop`, a signal it caught ends the run at the next step boundary, with a
    checkpoint of that step.

    Returns:
      The summary (also written to `workdir/summary.json`); `summary["diverged"]`
      says whether the run stopped because its loss diverged, `summary["interrupted"]`
      names the signal that stopped it.

    Raises:
      RunError: a bad config, workdir or checkpoint, in one line.
    """
    started = time.time()
    exp = setup.build(config)
    workdir = workdir_lib.prepare(workdir)
    processes.check_shared_workdir(workdir)
    with workdir_lib.Lock(workdir, jax.process_index()):
        return _train(config, exp, workdir, started, stop)


def _train(
    config, exp: setup.Experiment, workdir: str, started: float, stop: watchdog.StopSignals | None
) -> dict[str, Any]:
    layout, dataset, n = exp.layout, exp.dataset, config.num_nodes
    batcher = lpdec.data.NodeBatcher(
        dataset.x_train,
        dataset.y_train,
        exp.partitions,
        config.batch_size,
        config.seed,
        augment=config.augment,
    )

    init_key = jax.random.key(config.seed)
    variables = jax.jit(lambda x: exp.model.init(init_key, x, train=False))(dataset.x_train[:1])
    variables = jax.tree.map(np.asarray, variables)
    params = variables.pop("params")
    # Every node starts from the same model, as in seed 002.
    stack = lambda tree: jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree)  # noqa: E731
    params, model_state = layout.put(stack(params)), layout.put(stack(dict(variables)))
    programs = steps.make_programs(exp.model, exp.tx, layout)
    state = {"params": params, "opt_state": programs["init"](params), "model_state": model_state}
    key = layout.put(jax.random.key_data(jax.random.key(config.seed + 1)), per_node=False)

    manager = checkpoint.manager(workdir)
    state, meta = checkpoint.restore_latest(manager, state, config)
    step = 0
    # The yardstick of a diverged loss: the cross-entropy of a uniform guess.
    divergence = metrics_lib.DivergenceMonitor(
        config.divergence_factor,
        config.divergence_patience,
        reference=math.log(dataset.num_classes),
    )
    if meta is not None:
        step = int(meta["step"])
        batcher.restore(meta["batcher"])
        logging.info("resumed from step %d of %s", step, workdir)
    resumed_from = step
    params, opt_state, model_state = state["params"], state["opt_state"], state["model_state"]

    # Test data: the averaged model sees a 1/n shard per node; local models a subset.
    per_node = len(dataset.x_test) // n
    shard_x, shard_y = (
        layout.put(a[: per_node * n].reshape((n, per_node) + a.shape[1:]))
        for a in (dataset.x_test, dataset.y_test)
    )
    local_count = min(config.eval_local_examples, len(dataset.x_test))
    local_x = layout.put(dataset.x_test[:local_count], per_node=False)
    local_y = layout.put(dataset.y_test[:local_count], per_node=False)

    writer = metrics_lib.MetricWriter(workdir, step, exp.total_steps)
    compiled: dict[int, Any] = {}
    wire_bytes, wire_source, collectives, bytes_by_axis = None, None, None, {}
    halt_at = step + config.halt_after_steps if config.halt_after_steps else None
    metrics: dict[str, Any] = {}
    stopped = diverged = interrupted = None
    while step < exp.total_steps:
        length = min(config.log_every, exp.total_steps - step)
        xs, ys = zip(*(batcher.next() for _ in range(length)), strict=True)
        xs, ys = layout.put(np.stack(xs, axis=1)), layout.put(np.stack(ys, axis=1))
        step0 = layout.put(np.int32(step), per_node=False)
        args = (params, opt_state, model_state, xs, ys, step0, key)
        if length not in compiled:
            with lpdec.wire.traffic_meter() as meter:
                compiled[length] = programs["train_chunk"].lower(*args).compile()
            if wire_bytes is None:
                collectives, bytes_by_axis = meter.collectives, dict(meter.bytes_by_axis)
                wire_bytes, wire_source = metrics_lib.wire_bytes(
                    compiled[length], meter, layout.per_device, config.local_steps
                )
        chunk_started = time.time()
        params, opt_state, model_state, losses, accuracies = compiled[length](*args)
        losses, accuracies = metrics_lib.to_host((losses, accuracies))
        step_time = (time.time() - chunk_started) / length
        step += length

        avg_params = programs["average"](params)
        avg_state = programs["average"](model_state)
        avg_correct = programs["shard_correct"](avg_params, avg_state, shard_x, shard_y)
        local_correct = programs["local_correct"](params, model_state, local_x, local_y)
        avg_correct, local_correct = metrics_lib.to_host((avg_correct, local_correct))
        health = metrics_lib.health_counts(opt_state)
        metrics = {
            "step": step,
            "epoch": step / exp.steps_per_epoch,
            "train_loss": float(np.mean(losses)),
            "train_accuracy": float(np.mean(np.asarray(accuracies))),
            "test_accuracy_avg_model": float(avg_correct.sum() / (per_node * n)),
            "test_accuracy_local_mean": float(local_correct.mean() / local_count),
            "consensus_distance": float(programs["consensus"](params)),
            "wire_bytes_per_step": float(wire_bytes),
            "step_time_s": step_time,
            "learning_rate": float(exp.schedule(step - 1)),
            "nonfinite_updates": health[0],
            "nonfinite_received": health[1],
            "theta_warnings": health[2],
        }
        writer.write(metrics)
        stopped = diverged = divergence.update(step, metrics["train_loss"])
        if diverged:
            # No checkpoint of a diverged state: a resumed run starts from the last good one.
            logging.error("stopping: %s", diverged)
            break
        interrupted = stop.agreed() if stop is not None else None
        if (
            (config.checkpoint_every and step % config.checkpoint_every == 0)
            or step == exp.total_steps
            or step == halt_at
            or interrupted
        ):
            state = {"params": params, "opt_state": opt_state, "model_state": model_state}
            meta = {"step": step, "batcher": batcher.state()}
            checkpoint.save(manager, step, state, meta, config)
        if interrupted:
            stopped = (
                f"interrupted: {interrupted.name} to process {interrupted.process} "
                f"at step {step}, saved as a checkpoint; rerun the same command to resume"
            )
            logging.warning("stopping: %s", stopped)
            break
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
        "total_steps": exp.total_steps,
        "halted": step < exp.total_steps and not stopped,
        "diverged": bool(diverged),
        "interrupted": interrupted.name if interrupted else None,
        "stopped": stopped,
        "resumed_from_step": resumed_from,
        "wall_time_s": time.time() - started,
        "num_nodes": n,
        "devices": layout.mesh.devices.size,
        "processes": jax.process_count(),
        "nodes_per_device": layout.per_device,
        "wire_bytes_source": wire_source,
        "collectives_per_step": collectives,
        "wire_bytes_by_axis": bytes_by_axis,
        "config": config.to_dict(),
    }
    metrics_lib.write_summary(workdir, summary)
    if config.save_final_params and not interrupted:
        checkpoint.export_params(workdir, params)
    return summary


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    # Orbax logs every checkpoint step at INFO through absl; keep lpdec's lines readable.
    logging.get_absl_handler().addFilter(lambda record: "orbax" not in record.pathname)
    peers = None
    try:
        processes.check_args(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        if FLAGS.coordinator_address:
            peers = processes.start(
                FLAGS.coordinator_address,
                FLAGS.num_processes,
                FLAGS.process_id,
                {f"config.{k}": v for k, v in checkpoint.flatten_config(FLAGS.config).items()},
                bind=FLAGS.coordinator_bind_address,
                timeout_s=FLAGS.peer_timeout,
                heartbeat_timeout_s=FLAGS.heartbeat_timeout,
                peer_lost_status=EXIT_PEER_LOST,
            )
    except RunError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(EXIT_BAD_INPUT)
    # After jax.distributed.initialize, whose preemption service takes SIGTERM.
    stop = watchdog.StopSignals(FLAGS.stop_timeout, peers).install()
    logging.info(
        "process %d of %d; %d local / %d global devices: %s",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )
    try:
        summary = train_and_evaluate(FLAGS.config, FLAGS.workdir, stop=stop)
    except RunError as error:
        if peers is not None:
            peers.leave(error=str(error))
        sys.stderr.write(f"error: {error}\n")
        sys.exit(EXIT_BAD_INPUT)
    if peers is not None:
        peers.leave()
    if summary["diverged"]:
        sys.stderr.write(f"error: {summary['stopped']}\n")
        sys.exit(EXIT_DIVERGED)
    if summary["interrupted"]:
        sys.stderr.write(f"{summary['stopped']}\n")
        sys.exit(128 + signal.Signals[summary["interrupted"]])


# Exit statuses besides 0 (done, or halted by config.halt_after_steps).
EXIT_BAD_INPUT = 2  # a bad flag, config, workdir or checkpoint: one `error:` line on stderr
EXIT_DIVERGED = 3  # the loss diverged; summary.json says where
EXIT_PEER_LOST = 4  # another process of the run was lost: one `error:` line names it
# SIGTERM/SIGINT: 128 + the signal's number (143, 130), as the shell reports a death by it.


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad flag, config file or override reported in one line.

    The config file is loaded here (absl loads it lazily, at first use), so a
    missing file or a typo in `--config.FIELD` stops the run before anything
    starts, naming the flag and, for a typo, the closest field.
    """
    try:
        rest = FLAGS(argv)
        FLAGS.config.keys()  # loads the file and applies the overrides now
        return rest
    except SystemExit:
        if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
            _print_config_fields(argv)
        raise
    except Exception as error:  # noqa: BLE001 - ml_collections raises many types
        sys.stderr.write(f"error: {_explain_flag_error(argv, error)}\n")
        sys.exit(EXIT_BAD_INPUT)


def _explain_flag_error(argv: list[str], error: Exception) -> str:
    path = _config_path(argv)
    if path and not os.path.isfile(path):
        return f"--config={path}: no such file; expected a config file such as configs/default.py"
    config = _load_config_quietly(argv)
    if config is not None:
        fields = sorted(_field_names(config.to_dict()))
        for arg in argv[1:]:
            if not arg.startswith("--config."):
                continue
            name = arg[len("--config.") :].split("=", 1)[0]
            if name not in fields:
                close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
                hint = f"; did you mean config.{close[0]}?" if close else ""
                return f"{arg}: the config has no field {name!r}{hint}"
    causes, cause = [], error
    while cause is not None and len(causes) < 3:
        text = " ".join(str(cause).split()).strip("'\"") or type(cause).__name__
        if not any(text in earlier for earlier in causes):
            causes.append(text)
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(causes)[:500]


def _load_config_quietly(argv: list[str]):
    """The config `--config=FILE` names, built by its get_config(), or None."""
    path = _config_path(argv)
    if not path or not os.path.isfile(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location("lpdec_user_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()
    except Exception:  # noqa: BLE001 - the caller falls back to the error's own text
        return None


def _print_config_fields(argv: list[str]) -> None:
    """After absl's help: every `--config.FIELD` override with its default."""
    if not _config_path(argv):
        argv = [
            *argv,
            f"--config={os.path.join(os.path.dirname(__file__), 'configs', 'default.py')}",
        ]
    config = _load_config_quietly(argv)
    if config is None:
        return
    print(f"\n  --config.FIELD=VALUE overrides (defaults from {_config_path(argv)}):")
    for name, value in checkpoint.flatten_config(config).items():
        print(f"    --config.{name}: {value!r}")


def _config_path(argv: list[str]) -> str | None:
    """The file of the last `--config=FILE[:ARG]` flag, or None."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return values[-1].split(":")[0] if values else None


def _field_names(tree: dict, prefix: str = "") -> list[str]:
    names = []
    for key, value in tree.items():
        names.append(prefix + key)
        if isinstance(value, dict):
            names += _field_names(value, f"{prefix}{key}.")
    return names


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main, flags_parser=parse_flags)
