"""The training loop, written once: `run(trainer, workdir, ...)`, and the synchronous run.

A run is a `Trainer` plugged into `run`. The loop owns what every run does the same
way: the metrics row (stderr, metrics.csv, TensorBoard), the divergence and loss-jump
watches, the save / stop / halt decisions, summary.json and the parameter export. A
trainer owns what differs: where its state comes from (a checkpoint, or a live
machine of an elastic run), how it gets to the next log point (compiled chunks of
steps; or rounds of local steps that meet at an exchange), which model it evaluates,
and what it saves. `train_and_evaluate(config, workdir)` is the synchronous run
(`SyncTrainer`); `train_lib.elastic` plugs an elastic machine into the same loop.

The pieces both trainers build their steps from are here too: the model's initial
variables (`initial_model`), the batcher (`make_batcher`) and the compiled chunk of
steps with its cache by length (`Chunks`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any
from typing import Protocol

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

# ----------------------------------------------------------------------------
# What every trainer builds its steps from.
# ----------------------------------------------------------------------------


def initial_model(exp: setup.Experiment) -> tuple[dict, dict]:
    """(params, other variables) of the model at `exp.seed`, as host numpy trees."""
    init_key = jax.random.key(exp.seed)
    example = setup.example_input(exp.dataset)
    variables = jax.jit(lambda x: exp.model.init(init_key, x, train=False))(example)
    variables = jax.tree.map(np.asarray, variables)
    params = variables.pop("params")
    return params, dict(variables)


def make_batcher(exp: setup.Experiment, seed: int) -> lpdec.data.NodeBatcher:
    """The batches of `exp.partitions`' nodes, in the order `seed` draws."""
    dataset = exp.dataset
    return lpdec.data.NodeBatcher(
        dataset.x_train, dataset.y_train, exp.partitions, exp.batch_size, seed, augment=exp.augment
    )


def stack(tree, n: int):
    """`tree` repeated for `n` nodes along a new leading axis (every node the same model)."""
    return jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree)


def metric_fields(exp: setup.Experiment) -> tuple[str, ...]:
    """The columns of the run's metrics.csv."""
    lm = exp.dataset.task == "next_token"
    return metrics_lib.LM_METRIC_FIELDS if lm else metrics_lib.METRIC_FIELDS


class Chunks:
    """`length` steps of `programs["train_chunk"]` on the batcher's next batches,
    compiled once per length; the first compilation is metered (`wire`).

    A model with convolutions on CPU devices trains one step per program, called
    `length` times: XLA:CPU runs convolutions inside a loop (the chunk's `lax.scan`)
    several times slower than outside one (jax-ml/jax#12868; BENCHMARKS.md,
    "bench/cpu_loops.py": a CNN's SGD step 17-54x, quickstart's chunks 2.2-3.2x;
    ResNet-20 in 8 bits, configs/cifar10_resnet20_ring8.py, 63 s a step against
    5.3-5.9 s in a separate run). Other models on CPU (lm_tiny's transformer: its scan
    0.83-1.08x of the per-step time), and every model elsewhere, run the chunk as one
    program.
    """

    def __init__(self, exp: setup.Experiment, programs: dict):
        self.layout, self.program = exp.layout, programs["train_chunk"]
        on_cpu = all(d.platform == "cpu" for d in exp.layout.mesh.devices.flat)
        # Decided on the first chunk (None) from its program, False off CPU.
        self.step_by_step: bool | None = None if on_cpu else False
        self.compiled: dict[int, Any] = {}
        # Lowered and not yet compiled, by length: (the lowering, what the meter counted).
        self.lowered: dict[int, tuple[Any, lpdec.wire.TrafficMeter]] = {}
        # (bytes per node and step, their source, collectives per step, bytes by axis,
        # link bytes per node and step, link bytes by axis: `lpdec.wire.TrafficMeter`)
        self.wire: tuple[float, str, float, dict, float, dict] | None = None

    def _lower(self, args):
        """(the program for `args` lowered, what the traffic meter counted in its trace).

        Once per length, under the meter: jax traces a function once per shape, so a
        second `lower` of the same length (the first chunk's, after the one that decides
        `step_by_step`) would show the meter nothing.
        """
        length = args[3].shape[1]
        if length not in self.lowered:
            with lpdec.wire.traffic_meter() as meter:
                self.lowered[length] = (self.program.lower(*args), meter)
        return self.lowered[length]

    def _program(self, args):
        """The compiled program for `args` (its length: the batches' step axis)."""
        length = args[3].shape[1]
        if length not in self.compiled:
            lowered, meter = self._lower(args)
            self.compiled[length] = lowered.compile()
            del self.lowered[length]
            if self.wire is None:
                sent, source = metrics_lib.wire_bytes(
                    self.compiled[length], meter, self.layout.per_device
                )
                self.wire = (
                    float(sent),
                    source,
                    meter.collectives,
                    dict(meter.bytes_by_axis),
                    meter.link_bytes,
                    dict(meter.link_bytes_by_axis),
                )
        return self.compiled[length]

    def run(self, params, opt_state, model_state, batcher, length: int, step: int, key):
        """Trains `length` steps from `step`: (params, opt_state, model_state, losses,
        accuracies, seconds per step), the losses and accuracies on the host."""
        layout = self.layout
        batches = [batcher.next() for _ in range(length)]

        def inputs(i, piece):
            """(xs, ys, first step) of the steps in `piece`, the i-th of its length."""
            xs, ys = zip(*piece, strict=True)
            xs, ys = layout.put(np.stack(xs, axis=1)), layout.put(np.stack(ys, axis=1))
            return xs, ys, layout.put(np.int32(step + i * len(piece)), per_node=False)

        if self.step_by_step is None:
            one = (params, opt_state, model_state, *inputs(0, batches[:1]), key)
            self.step_by_step = "convolution" in self._lower(one)[0].as_text()
        pieces = [[b] for b in batches] if self.step_by_step else [batches]
        calls = [inputs(i, piece) for i, piece in enumerate(pieces)]
        self._program((params, opt_state, model_state, *calls[0], key))  # compiled first
        started, outputs = time.time(), []
        for xs, ys, step0 in calls:
            args = (params, opt_state, model_state, xs, ys, step0, key)
            params, opt_state, model_state, losses, accuracies = self._program(args)(*args)
            outputs.append((losses, accuracies))
            if len(calls) > 1 or lpdec.host_sum.installed() is not None:
                # Each step waits for the one before: XLA:CPU can deadlock on many queued
                # programs that communicate between devices (docs/status.md). With
                # lpdec.host_sum the program's sums are Python callbacks, which need the
                # GIL: a later call that waits inside jax holding it (process_allgather,
                # in to_host) would stop them, and with them the other processes.
                jax.block_until_ready(losses)
        # Each program's losses and accuracies (per node, its steps), the steps joined.
        host = metrics_lib.to_host(outputs)
        losses = np.concatenate([loss for loss, _ in host], axis=-1)
        accuracies = np.concatenate([accuracy for _, accuracy in host], axis=-1)
        seconds = (time.time() - started) / length
        return params, opt_state, model_state, losses, accuracies, seconds


# ----------------------------------------------------------------------------
# The loop.
# ----------------------------------------------------------------------------


@dataclasses.dataclass
class Progress:
    """What a trainer's `advance` did: the step it reached and what to log there.

    `losses` empty: no step was trained (an elastic machine handed the run's final
    state): the row's train loss is NaN and the watches skip it.
    """

    step: int
    losses: Any
    accuracies: Any
    step_time_s: float
    wire_bytes_per_step: float
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Trainer(Protocol):
    """What a run plugs into `run`."""

    exp: setup.Experiment
    #: Whether the run's end writes final_params.npz.
    exports: bool

    def start(self) -> tuple[int, dict[str, Any] | None]:
        """The step to start from, and the saved watches' state (None: fresh)."""
        ...

    def done(self, step: int) -> bool:
        """Whether the run is over at `step`."""
        ...

    def advance(self, step: int) -> Progress:
        """Trains from `step` to the next log point."""
        ...

    def evaluate(self, step: int) -> dict[str, float]:
        """The evaluated model's metrics after `step`."""
        ...

    def health(self) -> tuple[int, int, int]:
        """Non-finite updates, non-finite contributions received, θ warnings."""
        ...

    def save(self, step: int, meta: dict[str, Any]) -> None:
        """Keeps the state after `step` with the loop's `meta` (a no-op where none is kept)."""
        ...

    def end(self, step: int, diverged: bool) -> dict[str, Any]:
        """After the last row: the trainer's own summary fields."""
        ...

    def export(self, workdir: str) -> None:
        """Writes workdir/final_params.npz."""
        ...


def run(
    trainer: Trainer,
    workdir: str,
    started: float,
    fields: tuple[str, ...],
    stop: watchdog.StopSignals | None = None,
) -> dict[str, Any]:
    """Runs `trainer` to its end; writes metrics, summary.json and the export. Returns
    the summary (see `train_and_evaluate`)."""
    exp = trainer.exp
    loop = exp.loop
    step, meta = trainer.start()
    # The yardstick of a diverged loss: the cross-entropy of a uniform guess.
    reference = math.log(exp.dataset.num_classes)
    divergence = metrics_lib.DivergenceMonitor(
        loop.divergence_factor, loop.divergence_patience, reference=reference
    )
    jumps = metrics_lib.LossJumpMonitor(reference=reference)
    if meta is not None:
        divergence.restore(meta.get("divergence", {}))
        jumps.restore(meta.get("loss_jumps", {}))
    resumed_from = step
    next_token = exp.dataset.task == "next_token"
    targets = exp.dataset.x_test.shape[1] - 1 if next_token else 1
    tokens_per_step = exp.layout.num_nodes * exp.batch_size * targets
    writer = metrics_lib.MetricWriter(workdir, step, exp.total_steps, fields)
    halt_at = step + loop.halt_after_steps if loop.halt_after_steps else None
    metrics: dict[str, Any] = {}
    stopped = diverged = interrupted = None
    while not trainer.done(step):
        progress = trainer.advance(step)
        step = progress.step
        trained = len(progress.losses) > 0
        eval_started = time.time()
        evaluated = trainer.evaluate(step)
        train_loss = float(np.mean(progress.losses)) if trained else math.nan
        jump = jumps.update(step, train_loss) if trained else None
        updates, received, theta = trainer.health()
        row = {
            "step": step,
            "epoch": step / exp.steps_per_epoch,
            "train_loss": train_loss,
            "train_accuracy": float(np.mean(progress.accuracies)) if trained else math.nan,
            **evaluated,
            "wire_bytes_per_step": progress.wire_bytes_per_step,
            "step_time_s": progress.step_time_s,
            "eval_time_s": time.time() - eval_started,
            "wall_time_s": time.time() - started,
            "tokens_per_s_per_machine": (
                tokens_per_step / exp.layout.machines / progress.step_time_s
                if next_token and progress.step_time_s > 0
                else math.nan
            ),
            "learning_rate": float(exp.schedule(step - 1)),
            "nonfinite_updates": updates,
            "nonfinite_received": received,
            "theta_warnings": theta,
            "loss_jump": int(jumps.jumping),
            **progress.extra,
        }
        metrics = {k: v for k, v in row.items() if k in fields}
        writer.write(metrics)
        if jump:
            logging.warning("%s", jump)
        last = trainer.done(step)
        if trained:
            stopped = diverged = divergence.update(step, train_loss, last=last)
        if diverged:
            # No saved state of a diverged run, the final one included: a resumed run
            # starts from the last good one; nothing is exported.
            logging.error("stopping: %s", diverged)
            break
        interrupted = stop.agreed() if stop is not None else None
        if (
            (loop.checkpoint_every and step % loop.checkpoint_every == 0)
            or last
            or step == halt_at
            or interrupted
        ):
            trainer.save(step, {"divergence": divergence.state(), "loss_jumps": jumps.state()})
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
    writer.close()
    own = trainer.end(step, bool(diverged))
    summary = {
        "final": metrics,
        "steps": step,
        "total_steps": exp.total_steps,
        "halted": step == halt_at and not trainer.done(step) and not stopped,
        "diverged": bool(diverged),
        "interrupted": interrupted.name if interrupted else None,
        "stopped": stopped,
        "loss_jumps": jumps.warnings,
        "resumed_from_step": resumed_from,
        "wall_time_s": time.time() - started,
        **own,
        "config": exp.config_dict,
    }
    metrics_lib.write_summary(workdir, summary)
    if trainer.exports and not interrupted and not diverged:
        trainer.export(workdir)
    return summary


# ----------------------------------------------------------------------------
# The synchronous run.
# ----------------------------------------------------------------------------


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
        return run(SyncTrainer(exp, workdir), workdir, started, metric_fields(exp), stop)


class SyncTrainer:
    """Every node steps together: chunks of `config.log_every` compiled steps, with the
    algorithm's exchanges inside them; orbax checkpoints to resume from."""

    def __init__(self, exp: setup.Experiment, workdir: str):
        self.exp, self.workdir = exp, workdir
        self.exports = exp.loop.save_final_params
        layout, n = exp.layout, exp.layout.num_nodes
        self.batcher = make_batcher(exp, exp.seed)
        params, variables = initial_model(exp)
        # Every node starts from the same model, as in seed 002.
        self.model_state = layout.put(stack(variables, n))
        self.shards = shards = exp.shard_plan
        # Sharded: each device holds its blocks of its machine's model; else a whole model.
        self.params = (
            shards.put(params, layout) if shards is not None else layout.put(stack(params, n))
        )
        next_token = exp.dataset.task == "next_token"
        self.programs = steps.make_programs(
            exp.model, exp.tx, layout, next_token=next_token, plan=shards
        )
        self.opt_state = self.programs["init"](self.params)
        self.key = layout.put(jax.random.key_data(jax.random.key(exp.seed + 1)), per_node=False)
        self.manager = checkpoint.manager(workdir)
        self.chunks = Chunks(exp, self.programs)

    def start(self) -> tuple[int, dict[str, Any] | None]:
        state = self._state()
        state, meta = checkpoint.restore_latest(self.manager, state, self.exp.config_dict)
        step = 0
        if meta is not None:
            step = int(meta["step"])
            self.batcher.restore(meta["batcher"])
            logging.info("resumed from step %d of %s", step, self.workdir)
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.model_state = state["model_state"]
        self.held_bytes = metrics_lib.device_bytes((self.params, self.opt_state))
        loop = self.exp.loop
        self.evaluator = evaluation.Evaluator(
            self.exp, self.programs, anchor=loop.evaluate_anchor, identical=loop.replicas_identical
        )
        # Compiled before the first step, as the training program is: eval_time_s then
        # times evaluations, not their compilation.
        self.evaluate(step)
        return step, meta

    def _state(self) -> dict[str, Any]:
        return {"params": self.params, "opt_state": self.opt_state, "model_state": self.model_state}

    def done(self, step: int) -> bool:
        return step >= self.exp.total_steps

    def advance(self, step: int) -> Progress:
        length = min(self.exp.loop.log_every, self.exp.total_steps - step)
        self.params, self.opt_state, self.model_state, losses, accuracies, seconds = (
            self.chunks.run(
                self.params, self.opt_state, self.model_state, self.batcher, length, step, self.key
            )
        )
        assert self.chunks.wire is not None
        return Progress(step + length, losses, accuracies, seconds, self.chunks.wire[0])

    def evaluate(self, step: int) -> dict[str, float]:
        return self.evaluator.evaluate(self.params, self.opt_state, self.model_state, step)

    def health(self) -> tuple[int, int, int]:
        return metrics_lib.health_counts(self.opt_state)

    def save(self, step: int, meta: dict[str, Any]) -> None:
        meta = {"step": step, "batcher": self.batcher.state(), **meta}
        checkpoint.save(self.manager, step, self._state(), meta, self.exp.config_dict)

    def end(self, step: int, diverged: bool) -> dict[str, Any]:
        self.manager.wait_until_finished()
        layout = self.exp.layout
        wire = self.chunks.wire or (None, None, None, {}, None, {})
        return {
            "num_nodes": layout.num_nodes,
            "devices": layout.mesh.devices.size,
            "processes": jax.process_count(),
            "nodes_per_device": layout.per_device,
            # Parameters and optimizer state on the fullest device (sharded: 1/k per worker).
            "state_bytes_per_device": self.held_bytes,
            "wire_bytes_source": wire[1],
            "collectives_per_step": wire[2],
            "wire_bytes_by_axis": wire[3],
            # What a node puts on its links (the meter's model: `lpdec.wire.LINK_SHARE`).
            "link_bytes_per_step": wire[4],
            "link_bytes_by_axis": wire[5],
        }

    def export(self, workdir: str) -> None:
        checkpoint.export_params(workdir, self.params, self.shards)
