"""The training loop: `train_and_evaluate(config, workdir)`, for `train.py` and the benchmarks."""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

import lpdec
from train_lib import checkpoint
from train_lib import evaluation
from train_lib import metrics as metrics_lib
from train_lib import processes
from train_lib import setup
from train_lib import steps
from train_lib import watchdog
from train_lib import workdir as workdir_lib


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
      says whether its loss diverged (it stopped for it, or ended on a bad log
      interval; `summary["stopped"]` says which), `summary["interrupted"]` names the
      signal that stopped it.

    Raises:
      RunError: a bad config, workdir or checkpoint, in one line.
    """
    started = time.time()
    exp = setup.build(config)
    workdir = workdir_lib.prepare(workdir)
    processes.check_shared_workdir(workdir)
    with workdir_lib.Lock(workdir, jax.process_index()):
        return _train(exp, workdir, started, stop)


def _train(
    exp: setup.Experiment, workdir: str, started: float, stop: watchdog.StopSignals | None
) -> dict[str, Any]:
    """The loop itself: it reads the frozen `exp`, never the config."""
    layout, dataset, n, loop = exp.layout, exp.dataset, exp.layout.num_nodes, exp.loop
    batcher = lpdec.data.NodeBatcher(
        dataset.x_train,
        dataset.y_train,
        exp.partitions,
        exp.batch_size,
        exp.seed,
        augment=exp.augment,
    )

    init_key = jax.random.key(exp.seed)
    example = setup.example_input(dataset)
    variables = jax.jit(lambda x: exp.model.init(init_key, x, train=False))(example)
    variables = jax.tree.map(np.asarray, variables)
    params = variables.pop("params")
    # Every node starts from the same model, as in seed 002.
    stack = lambda tree: jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree)  # noqa: E731
    model_state = layout.put(stack(dict(variables)))
    shards = exp.shard_plan
    # Sharded: each device holds its blocks of its machine's model; else a whole model.
    params = shards.put(params, layout) if shards is not None else layout.put(stack(params))
    next_token = dataset.task == "next_token"
    programs = steps.make_programs(exp.model, exp.tx, layout, next_token=next_token, plan=shards)
    state = {"params": params, "opt_state": programs["init"](params), "model_state": model_state}
    key = layout.put(jax.random.key_data(jax.random.key(exp.seed + 1)), per_node=False)

    manager = checkpoint.manager(workdir)
    state, meta = checkpoint.restore_latest(manager, state, exp.config_dict)
    step = 0
    # The yardstick of a diverged loss: the cross-entropy of a uniform guess.
    divergence = metrics_lib.DivergenceMonitor(
        loop.divergence_factor,
        loop.divergence_patience,
        reference=math.log(dataset.num_classes),
    )
    jumps = metrics_lib.LossJumpMonitor(reference=math.log(dataset.num_classes))
    if meta is not None:
        step = int(meta["step"])
        batcher.restore(meta["batcher"])
        divergence.restore(meta.get("divergence", {}))
        jumps.restore(meta.get("loss_jumps", {}))
        logging.info("resumed from step %d of %s", step, workdir)
    resumed_from = step
    params, opt_state, model_state = state["params"], state["opt_state"], state["model_state"]
    held_bytes = metrics_lib.device_bytes((params, opt_state))

    targets = dataset.x_test.shape[1] - 1 if next_token else 1
    tokens_per_step = n * exp.batch_size * targets
    evaluator = evaluation.Evaluator(
        exp, programs, anchor=loop.evaluate_anchor, identical=loop.replicas_identical
    )
    # Compiled before the first step, as the training program is: eval_time_s then
    # times evaluations, not their compilation.
    evaluator.evaluate(params, opt_state, model_state, step)

    fields = metrics_lib.LM_METRIC_FIELDS if next_token else metrics_lib.METRIC_FIELDS
    writer = metrics_lib.MetricWriter(workdir, step, exp.total_steps, fields)
    compiled: dict[int, Any] = {}
    wire_bytes, wire_source, collectives, bytes_by_axis = None, None, None, {}
    halt_at = step + loop.halt_after_steps if loop.halt_after_steps else None
    metrics: dict[str, Any] = {}
    stopped = diverged = interrupted = None
    while step < exp.total_steps:
        length = min(loop.log_every, exp.total_steps - step)
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
                    compiled[length], meter, layout.per_device, exp.exchange_every
                )
        chunk_started = time.time()
        params, opt_state, model_state, losses, accuracies = compiled[length](*args)
        losses, accuracies = metrics_lib.to_host((losses, accuracies))
        step_time = (time.time() - chunk_started) / length
        step += length

        health = metrics_lib.health_counts(opt_state)
        eval_started = time.time()
        evaluated = evaluator.evaluate(params, opt_state, model_state, step)
        train_loss = float(np.mean(losses))
        jump = jumps.update(step, train_loss)
        metrics = {
            "step": step,
            "epoch": step / exp.steps_per_epoch,
            "train_loss": train_loss,
            "train_accuracy": float(np.mean(np.asarray(accuracies))),
            **evaluated,
            "wire_bytes_per_step": float(wire_bytes),
            "step_time_s": step_time,
            "eval_time_s": time.time() - eval_started,
            "wall_time_s": time.time() - started,
            **(
                {"tokens_per_s_per_machine": tokens_per_step / layout.machines / step_time}
                if next_token
                else {}
            ),
            "learning_rate": float(exp.schedule(step - 1)),
            "nonfinite_updates": health[0],
            "nonfinite_received": health[1],
            "theta_warnings": health[2],
            "loss_jump": int(jumps.jumping),
        }
        writer.write(metrics)
        if jump:
            logging.warning("%s", jump)
        last = step == exp.total_steps
        stopped = diverged = divergence.update(step, train_loss, last=last)
        if diverged:
            # No checkpoint of a diverged state, the final one included: a resumed run
            # starts from the last good one.
            logging.error("stopping: %s", diverged)
            break
        interrupted = stop.agreed() if stop is not None else None
        if (
            (loop.checkpoint_every and step % loop.checkpoint_every == 0)
            or last
            or step == halt_at
            or interrupted
        ):
            state = {"params": params, "opt_state": opt_state, "model_state": model_state}
            meta = {
                "step": step,
                "batcher": batcher.state(),
                "divergence": divergence.state(),
                "loss_jumps": jumps.state(),
            }
            checkpoint.save(manager, step, state, meta, exp.config_dict)
        if interrupted:
            stopped = (
                f"interrupted: {interrupted.name} to process {interrupted.process} "
                f"at step {step}, saved as a checkpoint; rerun the same command to resume"
            )
            logging.warning("stopping: %s", stopped)
            break
        if step == halt_at:
            logging.info("halting after %d steps (config.halt_after_steps)", loop.halt_after_steps)
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
        "loss_jumps": jumps.warnings,
        "resumed_from_step": resumed_from,
        "wall_time_s": time.time() - started,
        "num_nodes": n,
        "devices": layout.mesh.devices.size,
        "processes": jax.process_count(),
        "nodes_per_device": layout.per_device,
        # Parameters and optimizer state on the fullest device (sharded: 1/k per worker).
        "state_bytes_per_device": held_bytes,
        "wire_bytes_source": wire_source,
        "collectives_per_step": collectives,
        "wire_bytes_by_axis": bytes_by_axis,
        "config": exp.config_dict,
    }
    metrics_lib.write_summary(workdir, summary)
    if loop.save_final_params and not interrupted:
        checkpoint.export_params(workdir, params, shards)
    return summary
