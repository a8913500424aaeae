"""Elastic DiLoCo: one machine of a run whose machines may be lost and join (issue 27).

`train_elastic(config, workdir, options)` runs ONE machine. The machines never
form a `jax.distributed` gang: each is a single process training on its own
devices, and they meet only at exchanges, through the run's coordinating
service (`python -m lpdec.elastic serve`, jax's coordination service run
standalone; `lpdec.elastic.ElasticGroup` is the protocol).

A machine is one DiLoCo replica trained data-parallel over its devices (the
config's `num_nodes / machines` workers average their gradients every step, as
the hierarchical DiLoCo of `train.py` does). A round:

1. `h` local steps (this machine's `--elastic_local_steps`, default
   `config.local_steps`) from the anchor, on this machine's data shard;
2. delta = anchor - x, encoded with the config's exchange (`mean`: float32;
   `compressed_mean`: its compressor, with error feedback when
   `config.error_feedback`), posted to the service;
3. the round's decision names the contributions that arrived in time (every
   live machine's, or whatever came before `--elastic_deadline`); every machine
   decodes the same ones in the same order, takes their mean
   (`config.elastic_mean`: "contributors", weighted by their local steps,
   `lpdec.elastic.step_weighted_mean`; "slots", their sum over the run's
   machines, `lpdec.elastic.slot_mean`) and the outer Nesterov step in float32
   numpy: the same anchor, bit for bit, on every machine, which also starts the
   next round from it;
4. the lowest machine of the decision answers join requests with the state to
   start the next round from: anchor, outer momentum, its inner optimizer
   state, the round.

How long the run is (`config.elastic_budget`): "rounds", ceil(num_steps / H)
exchanges whoever takes part; "samples", until the local steps the exchanges took
in (`machine_steps`, the same count on every machine, handed to a joining one)
reach num_steps x machines, the uninterrupted run's: the others make up a lost or
slow machine's share with more rounds, in more wall time.

A late contribution is dropped (its machine applies the round's mean like the
others; its steps of that round are lost, `included=0` in `exchanges.csv`). A
machine the service declared lost (its link was down) is ended by jaxlib when
it hears the service again; `train.py`'s supervisor (`cli.run_elastic`)
restarts it and it joins like any restarted machine. A call to the service that
fails without that (`ServiceLost`) reconnects and joins in place. Data and
random streams follow from the machine's slot and the round, so a rejoin
replays what the machine would have seen. Nothing is checkpointed to disk: the
live machines hold the state (if every machine is lost, the run is lost; see
docs/machines.md).
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import json
import math
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging

import lpdec
from lpdec import elastic
from train_lib import evaluation
from train_lib import metrics as metrics_lib
from train_lib import registry
from train_lib import setup
from train_lib import steps
from train_lib import workdir as workdir_lib
from train_lib.errors import ConfigError
from train_lib.errors import RunError

EXCHANGE_FIELDS = (
    "round",
    "step",
    "members",
    "included",
    "reason",
    "closed_by",
    "waited_s",
    "bytes_sent",
    "bytes_received",
    "anchors_agree",
    "local_steps",
    "machine_steps",
)


class ElasticLost(RunError):
    """The coordinating service could not be reached again (exit status 4)."""


@dataclasses.dataclass(frozen=True)
class ElasticOptions:
    """One machine's command-line settings (`train.py --elastic_*`).

    Attributes:
      service: the coordinating service, host:port.
      machine: this machine's slot.
      machines: the run's slots (the service's `--machines`).
      token: the run's secret (empty: none, and every join is refused).
      local_steps: this machine's local steps per round (0: config.local_steps).
      deadline: seconds an exchange waits for late machines after contributing.
      join_timeout: seconds a joining machine waits for a live one's answer, and a
        machine that lost the service tries to reconnect.
      heartbeat_timeout: seconds without a heartbeat before a machine counts as lost.
      connect_timeout: seconds a fresh start waits for every machine to register.
      slowdown: a testing aid: each round's local steps take this many times as long
        (the machine sleeps the difference); 1 = full speed.
      min_round_s: a testing aid: each round's local steps take at least this long.
    """

    service: str
    machine: int
    machines: int
    token: bytes
    local_steps: int = 0
    deadline: float = 60.0
    join_timeout: float = 600.0
    heartbeat_timeout: int = 10
    connect_timeout: int = 300
    slowdown: float = 1.0
    min_round_s: float = 0.0


def check(config: ml_collections.ConfigDict, options: ElasticOptions) -> None:
    """One-line errors for what an elastic run cannot do, before anything starts."""
    if registry.ALGORITHMS.get(config.algorithm) is None or not _takes_local_steps(config):
        raise ConfigError(
            f"--elastic_service needs config.algorithm='diloco' (machines meet only at "
            f"exchanges); got {config.algorithm!r}."
        )
    if config.exchange not in ("mean", "compressed_mean"):
        raise ConfigError(
            f"config.exchange={config.exchange!r}: an elastic run exchanges a mean "
            "('mean' or 'compressed_mean'), not gossip."
        )
    unsupported = (("overlap", False), ("shard_model", False), ("error_decay", 1.0))
    for field, off in (*unsupported, ("outer_warmup_rounds", 0), ("sync_steps", 0)):
        if config[field] != off:
            raise ConfigError(f"config.{field}={config[field]!r} is not supported elastic.")
    if options.machines < 1 or config.num_nodes % options.machines:
        raise ConfigError(
            f"config.num_nodes={config.num_nodes} must be a multiple of "
            f"--elastic_machines={options.machines} (workers per machine)."
        )
    if not 0 <= options.machine < options.machines:
        raise ConfigError(
            f"--elastic_machine={options.machine} must be in [0, {options.machines})."
        )
    if config.elastic_data not in ("shard", "whole"):
        raise ConfigError(
            f"config.elastic_data={config.elastic_data!r} must be 'shard' or 'whole'."
        )
    if config.elastic_mean not in ("contributors", "slots"):
        raise ConfigError(
            f"config.elastic_mean={config.elastic_mean!r} must be 'contributors' or 'slots'."
        )
    budget = config.elastic_budget
    if budget not in ("rounds", "samples"):
        raise ConfigError(f"config.elastic_budget={budget!r} must be 'rounds' or 'samples'.")
    if budget == "samples" and config.lr_schedule != "constant":
        raise ConfigError(
            f"config.elastic_budget='samples' needs config.lr_schedule='constant' (got "
            f"{config.lr_schedule!r}): the run's length, and so a decay's end, is not known "
            "in advance."
        )
    if options.local_steps < 0:
        raise ConfigError(f"--elastic_local_steps={options.local_steps} must be >= 0.")
    if not options.deadline > 0 or not options.join_timeout > 0:
        raise ConfigError("--elastic_deadline and --elastic_join_timeout must be > 0 s.")
    if not options.slowdown >= 1:
        raise ConfigError(f"--elastic_slowdown={options.slowdown} must be >= 1.")


def _takes_local_steps(config: ml_collections.ConfigDict) -> bool:
    """Whether the config's algorithm takes local steps between exchanges (role "whole")."""
    return registry.ALGORITHMS[config.algorithm].role == "whole"


def fingerprint(config: ml_collections.ConfigDict) -> str:
    """The run's config, hashed: every machine of a run has the same one."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _machine_config(config: ml_collections.ConfigDict, workers: int) -> ml_collections.ConfigDict:
    """The config one machine trains with between exchanges: its workers, all-reduced."""
    local = ml_collections.ConfigDict(config.to_dict())
    local.algorithm = "allreduce"
    local.num_nodes = workers
    local.hierarchical, local.machines = False, 0
    local.local_steps, local.overlap, local.error_feedback = 1, False, False
    local.mean_rounds, local.error_decay = 2, 1.0
    return local


def machine_partitions(config, exp: setup.Experiment, machine: int) -> tuple:
    """The training-sample indices of each of `machine`'s workers (`config.elastic_data`).

    "shard": the shards nodes m*k .. m*k+k-1 get in the same run's non-elastic form,
    so the data follow from the slot, not from who is alive. "whole": `setup.build`'s
    split of the whole training set over the machine's k workers; every machine draws
    from it in its own order (the batcher's seed is the slot's).
    """
    if config.elastic_data == "whole":
        return tuple(exp.partitions)
    workers = len(exp.partitions)
    shards = lpdec.data.skew_partition(
        exp.dataset.y_train, config.num_nodes, config.skew, config.seed
    )
    return tuple(shards[machine * workers : (machine + 1) * workers])


def train_elastic(
    config: ml_collections.ConfigDict, workdir: str, options: ElasticOptions
) -> dict[str, Any]:
    """Runs this machine of an elastic DiLoCo run; returns its summary (also written)."""
    started = time.time()
    check(config, options)
    workers = config.num_nodes // options.machines
    exp = setup.build(_machine_config(config, workers))
    exp = dataclasses.replace(exp, partitions=machine_partitions(config, exp, options.machine))
    workdir = workdir_lib.prepare(workdir)
    with workdir_lib.Lock(workdir, 0):
        machine = _Machine(config, exp, workdir, options, started)
        try:
            return machine.run()
        finally:
            # Leave the service before the interpreter tears its client down (a process
            # that ends with an exception would otherwise abort in jaxlib's destructor).
            machine.group.close()


class _Machine:
    def __init__(self, config, exp: setup.Experiment, workdir: str, options, started):
        self.exp, self.workdir, self.options, self.started = exp, workdir, options, started
        self.layout = layout = exp.layout
        self.H = int(config.local_steps)
        self.h = int(options.local_steps or self.H)
        self.rounds = math.ceil(exp.total_steps / self.H)
        # "samples": the run ends once its exchanges took in the uninterrupted run's
        # local steps (every machine's rounds x H); "rounds": after self.rounds rounds.
        self.by_samples = config.elastic_budget == "samples"
        self.budget = self.rounds * self.H * options.machines
        self.machine_steps = 0  # local steps the decided exchanges took in, run-wide
        self.slot_mean = config.elastic_mean == "slots"
        self.outer_lr, self.outer_mu = float(config.outer_lr), float(config.outer_momentum)
        self.compressed = config.exchange == "compressed_mean"
        self.feedback = self.compressed and bool(config.error_feedback)
        self.compressor = exp.compressor if self.compressed else lpdec.identity()
        self.next_token = exp.dataset.task == "next_token"
        self.seed = exp.seed * 1_000_003 + options.machine
        self.batcher = lpdec.data.NodeBatcher(
            exp.dataset.x_train,
            exp.dataset.y_train,
            exp.partitions,
            exp.batch_size,
            self.seed,
            augment=exp.augment,
        )
        example = setup.example_input(exp.dataset)
        variables = jax.jit(lambda x: exp.model.init(jax.random.key(exp.seed), x, train=False))(
            example
        )
        variables = jax.tree.map(np.asarray, variables)
        self.anchor = variables.pop("params")
        self.model_state = dict(variables)
        self.momentum = jax.tree.map(np.zeros_like, self.anchor)
        self.residual = jax.tree.map(np.zeros_like, self.anchor)
        self.programs = steps.make_programs(exp.model, exp.tx, layout, next_token=self.next_token)
        params = self._put(self.anchor)
        self.opt_state = self.programs["init"](params)
        self.model_state_dev = self._put(self.model_state)
        self.key = layout.put(
            jax.random.key_data(jax.random.fold_in(jax.random.key(exp.seed + 1), options.machine)),
            per_node=False,
        )
        self.model_sig = elastic.signature(self.anchor)
        self.group = elastic.ElasticGroup(
            options.service,
            options.machine,
            options.machines,
            options.token,
            fingerprint(config),
            heartbeat_timeout=options.heartbeat_timeout,
            connect_timeout=options.connect_timeout,
        )
        self.evaluator = evaluation.Evaluator(exp, self.programs, anchor=False, identical=True)
        self._encode = jax.jit(self._encode_fn)
        self._decode = jax.jit(
            lambda p: lpdec.compress.tree.decode_tree(self.compressor, p, self.anchor)
        )
        self._payload_like = jax.eval_shape(
            self._encode_fn, self.anchor, self.residual, jax.random.key(0)
        )[0]
        self.compiled: dict[int, Any] = {}
        # What the synchronous loop watches, watched the same way (train_lib.loop).
        reference = math.log(exp.dataset.num_classes)
        self.divergence = metrics_lib.DivergenceMonitor(
            exp.loop.divergence_factor, exp.loop.divergence_patience, reference=reference
        )
        self.jumps = metrics_lib.LossJumpMonitor(reference=reference)
        # Contributions dropped for holding NaN/Inf (every machine drops the same ones).
        self.nonfinite_received = 0

    # -- helpers -------------------------------------------------------------

    def _put(self, tree):
        n = self.layout.num_nodes
        return self.layout.put(jax.tree.map(lambda x: np.broadcast_to(x, (n,) + x.shape), tree))

    @staticmethod
    def _node0(tree):
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x))[0], tree)

    def _encode_fn(self, delta, residual, key):
        v = jax.tree.map(lambda d, e: d + e, delta, residual) if self.feedback else delta
        payload = lpdec.compress.tree.encode_tree(
            self.compressor, v, key if self.compressor.needs_key else None
        )
        decoded = lpdec.compress.tree.decode_tree(self.compressor, payload, v)
        return payload, jax.tree.map(lambda a, b: a - b, v, decoded)

    def _done(self, round_: int) -> bool:
        """Whether the run is over before round `round_` (see `config.elastic_budget`)."""
        if self.by_samples:
            return self.machine_steps >= self.budget
        return round_ >= self.rounds

    def _state_bytes(self, round_: int) -> bytes:
        return elastic.pack(
            {
                "round": np.int64(round_),
                "machine_steps": np.int64(self.machine_steps),
                "anchor": self.anchor,
                "momentum": self.momentum,
                "inner": self._node0(self.opt_state),
                "model_state": self.model_state,
            }
        )

    def _load_state(self, blob: bytes) -> int:
        like = {
            "round": np.int64(0),
            "machine_steps": np.int64(0),
            "anchor": self.anchor,
            "momentum": self.momentum,
            "inner": self._node0(self.opt_state),
            "model_state": self.model_state,
        }
        state = elastic.unpack(blob, like)
        self.anchor, self.momentum = state["anchor"], state["momentum"]
        self.machine_steps = int(state["machine_steps"])
        self.model_state = state["model_state"]
        self.opt_state = self._put(state["inner"])
        self.model_state_dev = self._put(self.model_state)
        # This machine's unsent error of before its loss belongs to an old anchor.
        self.residual = jax.tree.map(np.zeros_like, self.anchor)
        return int(state["round"])

    # -- joining ---------------------------------------------------------------

    def _start(self) -> int:
        """Connects; returns the round to start from (0, or a live machine's)."""
        self.group.connect()
        # For train.py's supervisor: this process took part, so a later abnormal end
        # (jaxlib ending a client the service declared lost) is worth a restart.
        with open(os.path.join(self.workdir, workdir_lib.ELASTIC_CONNECTED), "w") as f:
            f.write(f"{self.group.incarnation}\n")
        latest = self.group.latest_round()
        if latest is None:
            if not self.options.token:
                raise RunError(
                    "an elastic run needs its secret: --elastic_token_file or "
                    "LPDEC_ELASTIC_TOKEN (a machine without it can only be refused)"
                )
            logging.info("elastic: machine %d starts the run", self.options.machine)
            self.group.mark_active()
            return 0
        return self._join()

    def _join(self) -> int:
        latest = self.group.latest_round()
        finished = self.group.finished_round()
        others = set(self.group.live()) - {self.options.machine}
        if finished is not None and not others:
            # Nobody is left to hand over the final state.
            raise RunError(f"the run has finished (its last round, {finished}, is decided)")
        logging.info(
            "elastic: machine %d joins a running run (last exchange: round %s)",
            self.options.machine,
            latest,
        )
        try:
            _, blob = self.group.join(self.model_sig, self.options.join_timeout)
        except elastic.JoinRefused as error:
            raise RunError(str(error)) from None
        round_ = self._load_state(blob)
        self.joins.append(round_)
        logging.info("elastic: machine %d joined at round %d", self.options.machine, round_)
        self.group.mark_active()
        return round_

    def _reconnect(self, error: Exception, round_: int) -> int:
        logging.warning(
            "elastic: machine %d lost the service at round %d (%s); reconnecting to rejoin",
            self.options.machine,
            round_,
            error,
        )
        self.group.close()
        deadline = time.monotonic() + self.options.join_timeout
        while True:
            try:
                self.group.connect()
                return self._join()
            except elastic.ServiceLost as again:
                if time.monotonic() > deadline:
                    raise ElasticLost(
                        f"lost the coordinating service {self.options.service} and could "
                        f"not rejoin within {self.options.join_timeout:g} s: {again}"
                    ) from None
                self.group.close()
                time.sleep(1.0)

    # -- the loop --------------------------------------------------------------

    def _step(self, round_: int) -> int:
        """The local steps a machine of H takes by round `round_` (the metrics' step)."""
        step = round_ * self.H
        return step if self.by_samples else min(step, self.exp.total_steps)

    def _log(self, writer, step, row, seconds, losses, accuracies, fields) -> dict:
        """Evaluates the anchor and writes one metrics row; returns it."""
        exp = self.exp
        eval_started = time.time()
        evaluated = self.evaluator.evaluate(
            self._put(self.anchor), self.opt_state, self.model_state_dev, step
        )
        updates, _, theta = metrics_lib.health_counts(self.opt_state)
        train_loss = float(np.mean(losses)) if losses else float("nan")
        jump = self.jumps.update(step, train_loss) if losses else None
        if jump:
            logging.warning("%s", jump)
        metrics = {
            "step": step,
            "epoch": step / exp.steps_per_epoch,
            "train_loss": train_loss,
            "train_accuracy": float(np.mean(accuracies)) if accuracies else float("nan"),
            **{k: v for k, v in evaluated.items() if "local_mean" not in k},
            "wire_bytes_per_step": (row["bytes_sent"] + row["bytes_received"]) / self.h,
            "step_time_s": seconds / self.h,
            "eval_time_s": time.time() - eval_started,
            "wall_time_s": time.time() - self.started,
            "learning_rate": float(exp.schedule(step - 1)),
            "nonfinite_updates": updates,
            "nonfinite_received": self.nonfinite_received,
            "theta_warnings": theta,
            "loss_jump": int(self.jumps.jumping),
            "members": len(row["members"].split()),
        }
        metrics = {k: v for k, v in metrics.items() if k in fields}
        writer.write(metrics)
        return metrics

    def _finish(self, round_: int) -> None:
        """Marks the run over after round `round_ - 1`, then hands the final state to
        machines still behind (their exchange raises `Behind` and they join for it),
        until every machine the service hears has finished or --elastic_join_timeout."""
        if round_ == 0:
            return
        me = self.options.machine
        self.group.finish(round_ - 1)
        deadline = time.monotonic() + self.options.join_timeout

        def training() -> set[int]:
            return set(self.group.live()) - self.group.finished_machines() - {me}

        if training():
            logging.info(
                "elastic: the run is over; machine(s) %s still train: waiting up to %g s to "
                "hand them the final state",
                sorted(training()),
                self.options.join_timeout,
            )
        while training():
            for line in self.group.serve_joins(
                round_, self.model_sig, lambda: self._state_bytes(round_)
            ):
                logging.warning("elastic: %s (the final state)", line)
            if time.monotonic() > deadline:
                logging.warning("elastic: machines still training after the run ended; leaving")
                break
            time.sleep(self.group.poll_s)

    def run(self) -> dict[str, Any]:
        exp, options = self.exp, self.options
        self.joins: list[int] = []
        try:
            round_ = self._start()
        except elastic.ServiceLost as error:
            raise ElasticLost(f"{error}") from None
        fields = metrics_lib.LM_METRIC_FIELDS if self.next_token else metrics_lib.METRIC_FIELDS
        fields = tuple(f for f in fields if "local_mean" not in f) + ("members",)
        writer = metrics_lib.MetricWriter(self.workdir, 0, exp.total_steps, fields)
        exchanges_path = os.path.join(self.workdir, "exchanges.csv")
        if not os.path.exists(exchanges_path):  # a restarted machine appends its rounds
            with open(exchanges_path, "w", newline="") as f:
                csv.DictWriter(f, EXCHANGE_FIELDS).writeheader()
        history: list[dict] = []
        metrics: dict[str, Any] = {}
        losses: list[float] = []
        accuracies: list[float] = []
        train_time = 0.0
        diverged = None
        log_every = max(exp.loop.log_every, self.H)
        while not self._done(round_):
            try:
                row, (loss, accuracy), seconds = self._round(round_)
            except elastic.ServiceLost as error:
                round_ = self._reconnect(error, round_)
                continue
            except elastic.Behind as error:
                logging.warning("elastic: %s", error)
                round_ = self._join()
                continue
            history.append(row)
            losses.append(loss)
            accuracies.append(accuracy)
            train_time += seconds
            with open(exchanges_path, "a", newline="") as f:
                csv.DictWriter(f, EXCHANGE_FIELDS).writerow(row)
            if not row["anchors_agree"]:
                logging.warning(
                    "elastic: round %d's members started from different anchors", round_
                )
            round_ += 1
            step = self._step(round_)
            if step % log_every < self.H or self._done(round_):
                metrics = self._log(writer, step, row, seconds, losses, accuracies, fields)
                diverged = self.divergence.update(
                    step, metrics["train_loss"], last=self._done(round_)
                )
                losses, accuracies = [], []
                if diverged:
                    # Every machine watches its own loss, as each process of a
                    # synchronous run does, and stops: nothing is exported.
                    logging.error("stopping: %s", diverged)
                    break
        step = self._step(round_)
        if history and metrics.get("step") != step and not diverged:
            # It joined for the run's final state after its last round: evaluate that.
            metrics = self._log(writer, step, history[-1], 0.0, losses, accuracies, fields)
        writer.close()
        if not diverged:
            self._finish(round_)
        self.group.close()
        summary = {
            "final": metrics,
            "steps": self._step(round_),
            "rounds": round_,
            "budget": "samples" if self.by_samples else "rounds",
            "machine_steps": self.machine_steps,
            "budget_machine_steps": self.budget,
            "machine": options.machine,
            "machines": options.machines,
            "local_steps": self.h,
            "joined_at_rounds": self.joins,
            "rounds_included": sum(int(r["included"]) for r in history),
            "rounds_seen": len(history),
            "rounds_short": sum(len(r["members"].split()) < options.machines for r in history),
            "anchors_agree": all(r["anchors_agree"] for r in history),
            "final_anchor_digest": elastic.tree_digest(self.anchor),
            "train_time_s": train_time,
            "wall_time_s": time.time() - self.started,
            "diverged": bool(diverged),
            "stopped": diverged,
            "loss_jumps": self.jumps.warnings,
            "interrupted": None,
            "config": exp.config_dict,
        }
        metrics_lib.write_summary(self.workdir, summary)
        if diverged:
            return summary
        np.savez(
            os.path.join(self.workdir, "final_params.npz"),
            **{
                jax.tree_util.keystr(p): np.asarray(x)
                for p, x in jax.tree_util.tree_flatten_with_path(self.anchor)[0]
            },
        )
        return summary

    def _round(self, round_: int) -> tuple[dict, float, float]:
        """One round: local steps, the exchange, the outer step; returns its row."""
        layout, h = self.layout, self.h
        step0 = round_ * self.H
        self.batcher.restore({**self.batcher.state(), "step": step0})
        xs, ys = zip(*(self.batcher.next() for _ in range(h)), strict=True)
        xs, ys = layout.put(np.stack(xs, axis=1)), layout.put(np.stack(ys, axis=1))
        params = self._put(self.anchor)
        args = (
            params,
            self.opt_state,
            self.model_state_dev,
            xs,
            ys,
            layout.put(np.int32(step0), per_node=False),
            self.key,
        )
        if h not in self.compiled:
            self.compiled[h] = self.programs["train_chunk"].lower(*args).compile()
        chunk_started = time.time()
        params, self.opt_state, self.model_state_dev, losses, accuracies = self.compiled[h](*args)
        losses, accuracies = metrics_lib.to_host((losses, accuracies))
        seconds = time.time() - chunk_started
        if self.options.slowdown > 1:
            time.sleep(seconds * (self.options.slowdown - 1))
            seconds *= self.options.slowdown
        if seconds < self.options.min_round_s:
            time.sleep(self.options.min_round_s - seconds)
            seconds = self.options.min_round_s
        x = self._node0(params)
        delta = jax.tree.map(lambda a, b: np.float32(a) - np.asarray(b, np.float32), self.anchor, x)
        key = jax.random.fold_in(jax.random.key(self.seed), round_)
        payload, residual = self._encode(delta, self.residual, key)
        blob = elastic.pack(payload)
        anchor_digest = elastic.tree_digest(self.anchor)
        ex = self.group.exchange(round_, blob, h, anchor_digest, self.options.deadline)
        if self.feedback:
            # Sent or dropped, what the payload could not carry stays for next round.
            self.residual = jax.tree.map(np.asarray, residual)
        deltas = [
            self._decode(elastic.unpack(c.payload, self._payload_like)) for c in ex.contributions
        ]
        deltas = [jax.tree.map(np.asarray, d) for d in deltas]
        # A contribution holding NaN/Inf is dropped, by every machine alike (they decode
        # the same ones), and counted: as lpdec's exchanges skip a non-finite payload.
        finite = [all(np.isfinite(x).all() for x in jax.tree.leaves(d)) for d in deltas]
        self.nonfinite_received += finite.count(False)
        kept = [
            (d, c.steps) for d, c, ok in zip(deltas, ex.contributions, finite, strict=True) if ok
        ]
        deltas, counts = [d for d, _ in kept], [n for _, n in kept]
        if not deltas:
            mean = jax.tree.map(np.zeros_like, self.anchor)
        elif self.slot_mean:
            mean = elastic.slot_mean(deltas, self.options.machines)
        else:
            mean = elastic.step_weighted_mean(deltas, counts)
        self.machine_steps += sum(c.steps for c in ex.contributions)
        self.anchor, self.momentum = elastic.nesterov_step(
            self.anchor, self.momentum, mean, self.outer_lr, self.outer_mu
        )
        if ex.members and min(ex.members) == self.options.machine:
            for line in self.group.serve_joins(
                round_ + 1, self.model_sig, lambda: self._state_bytes(round_ + 1)
            ):
                logging.warning("elastic: %s", line)
        row = {
            "round": round_,
            "step": step0 + self.H,
            "members": " ".join(str(m) for m in ex.members),
            "included": int(ex.included),
            "reason": ex.reason,
            "closed_by": ex.closed_by,
            "waited_s": round(ex.waited_s, 3),
            "bytes_sent": ex.bytes_sent,
            "bytes_received": ex.bytes_received,
            "anchors_agree": int(len({c.anchor_digest for c in ex.contributions}) == 1),
            "local_steps": h,
            "machine_steps": self.machine_steps,
        }
        if len(ex.members) < self.options.machines or not ex.included:
            logging.info(
                "elastic: round %d: mean over machines %s (%s)%s",
                round_,
                row["members"],
                ex.reason,
                "" if ex.included else "; this machine's contribution came late: dropped",
            )
        return row, (float(np.mean(losses)), float(np.mean(accuracies))), seconds
