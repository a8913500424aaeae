"""Elastic DiLoCo: one machine of a run whose machines may be lost and join (issue 27).

`train_elastic(config, workdir, options)` runs ONE machine. The machines never
form a `jax.distributed` gang: each is a single process training on its own
devices, and they meet only at exchanges, through the run's coordinating
service (`python -m lpdec.elastic serve`, jax's coordination service run
standalone; `lpdec.elastic.ElasticGroup` is the protocol).

A machine is one DiLoCo replica trained data-parallel over its devices (the
config's `num_nodes / machines` workers average their gradients every step, as
the hierarchical DiLoCo of `train.py` does; with `config.shard_model` its model
is split over them, FSDP: `setup.machine_config`). Its round is the synchronous
run's DiLoCo cut where the wire is (`train_lib.elastic_outer.OuterStep`):

1. `h` local steps (this machine's `--elastic_local_steps`, default
   `config.local_steps`; one step in the `config.sync_steps` warm-up rounds) from
   the anchor, on this machine's data (its slot's nodes' batches);
2. delta = anchor - x, encoded as `lpdec.compressed_mean`'s one-round exchange
   encodes it (`mean`: float32; `compressed_mean`: the compressor's own encode,
   with error feedback and `error_decay`), moved by the run's transport
   (`train_lib.elastic_transport`: through the service, or between the members);
3. the round's decision names the contributions that arrived in time (every
   live machine's, or whatever came before `--elastic_deadline`); every machine
   decodes the same ones in the same order, takes their mean
   (`config.elastic_mean`: "contributors", weighted by their local steps,
   `lpdec.elastic.step_weighted_mean`; "slots", their sum over the run's
   machines, `lpdec.elastic.slot_mean`) and DiLoCo's optax outer step
   (`train_lib.optimizers.outer`, its momentum warm-up included): the same
   anchor, bit for bit, on every machine, which also starts the next round;
4. the lowest machine of the decision answers join requests with the state to
   start the next round from: anchor, the outer optimizer's state, its inner
   optimizer state, the round.

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
replays what the machine would have seen. After every round each machine writes
the state it goes on from to its workdir (`STATE_FILE`): a service killed and
started again finds every machine back (their supervisors restart them) with its
saved round, and the run goes on from the highest (`ElasticTrainer._resume`; see
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
from flax import serialization

import lpdec
from lpdec import elastic
from lpdec.elastic.signing import digest
from train_lib import checkpoint
from train_lib import elastic_outer
from train_lib import elastic_peers
from train_lib import elastic_transport
from train_lib import evaluation
from train_lib import loop
from train_lib import metrics as metrics_lib
from train_lib import setup
from train_lib import steps
from train_lib import workdir as workdir_lib
from train_lib.errors import ConfigError
from train_lib.errors import RunError

#: The state to go on from after the last decided round, rewritten after every round:
#: a service started again resumes the run from it (`ElasticTrainer._resume`).
STATE_FILE = "elastic_state.msgpack"
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
      credentials: the run's credentials directory (`python -m lpdec.elastic
        credentials`): mutual TLS with the service ("" = none).
      private_network: the user's word that only the run's machines reach the
        service (needed off loopback without credentials).
      peer_address: with `config.elastic_transport="peers"`, the "host" or
        "host:port" this machine listens on for the other machines' bytes, an
        address they reach ("": 127.0.0.1 when the service is on loopback; port 0
        or none: any free one, advertised through the service).
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
    credentials: str = ""
    private_network: bool = False
    peer_address: str = ""

    def peer_bind(self) -> tuple[str, int]:
        """(host, port) this machine's peer-to-peer listener binds."""
        address = self.peer_address
        if not address:
            return "127.0.0.1", 0
        host, _, port = address.rpartition(":") if ":" in address else (address, "", "0")
        return host, int(port)

    def machine_credentials(self) -> elastic.credentials.Credentials | None:
        """This machine's credentials (None without a directory); one-line ValueError."""
        if not self.credentials:
            return None
        return elastic.credentials.load(self.credentials, self.machine)


def check(config: ml_collections.ConfigDict, options: ElasticOptions) -> None:
    """One-line errors for a bad config or option, before anything connects.

    The config goes through the checks every run's does (`setup.check_values`, with
    the elastic layout: what an elastic run cannot do, and how one machine's workers
    fit this process's devices); then this machine's options.
    """
    setup.check_values(config, elastic_machines=options.machines)
    if not 0 <= options.machine < options.machines:
        raise ConfigError(
            f"--elastic_machine={options.machine} must be in [0, {options.machines})."
        )
    if options.local_steps < 0:
        raise ConfigError(f"--elastic_local_steps={options.local_steps} must be >= 0.")
    if not options.deadline > 0 or not options.join_timeout > 0:
        raise ConfigError("--elastic_deadline and --elastic_join_timeout must be > 0 s.")
    try:
        creds = options.machine_credentials()
        elastic.credentials.check(options.service, creds, options.private_network)
        if creds is not None:
            elastic.credentials.check_token(creds, options.token)
    except ValueError as error:
        raise ConfigError(f"--elastic_service={options.service}: {error}") from None
    if config.elastic_transport == "peers":
        _check_peers(config, options, creds)


def _check_peers(config, options: ElasticOptions, creds) -> None:
    """One-line errors for the peer-to-peer transport's settings."""
    if not options.peer_address and not elastic.credentials.is_loopback(options.service):
        raise ConfigError(
            "config.elastic_transport='peers' off loopback needs --elastic_peer_address: "
            "the host (and port) the other machines reach this one at."
        )
    try:
        host, port = options.peer_bind()
        if not 0 <= port < 65536:
            raise ValueError(f"port {port} is out of range")
        if host in ("0.0.0.0", "::", ""):
            raise ValueError("give the address the other machines reach, not a wildcard")
        # The same rule as the service's: loopback, the run's credentials (mutual TLS
        # between the machines too), or the user's word that the network is private.
        elastic.credentials.require_private(f"{host}:{port}", creds, options.private_network)
    except ValueError as error:
        raise ConfigError(f"--elastic_peer_address={options.peer_address}: {error}") from None


def fingerprint(config: ml_collections.ConfigDict) -> str:
    """The run's config, hashed: every machine of a run has the same one."""
    text = json.dumps(config.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


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
    exp = setup.build(setup.machine_config(config, options.machines), checked=True)
    exp = dataclasses.replace(exp, partitions=machine_partitions(config, exp, options.machine))
    workdir = workdir_lib.prepare(workdir)
    # The anchor is the one model: no nodes' own models to evaluate.
    fields = tuple(f for f in loop.metric_fields(exp) if "local_mean" not in f) + ("members",)
    with workdir_lib.Lock(workdir, 0):
        machine = ElasticTrainer(config, exp, workdir, options)
        try:
            return loop.run(machine, workdir, started, fields)
        finally:
            # Leave the service before the interpreter tears its client down (a process
            # that ends with an exception would otherwise abort in jaxlib's destructor).
            machine.group.close()
            if machine.peers is not None:
                machine.peers.close()


class ElasticTrainer:
    """One machine of an elastic run, plugged into `train_lib.loop.run`: it advances by
    rounds (local steps, then the exchange through the service), evaluates the anchor,
    writes the state it goes on from after every round and exports its anchor."""

    exports = True

    def __init__(self, config, exp: setup.Experiment, workdir: str, options):
        self.exp, self.workdir, self.options = exp, workdir, options
        self.layout = layout = exp.layout
        self.shards = exp.shard_plan  # shard_model: the machine's model over its workers
        self.H = int(config.local_steps)
        self.h = int(options.local_steps or self.H)
        # The synchronous warm-up: rounds of one step through the plain exchange first.
        self.S = int(config.sync_steps)
        self.rounds = self.S + math.ceil(max(0, exp.total_steps - self.S) / self.H)
        # "samples": the run ends once its exchanges took in the uninterrupted run's
        # local steps (every machine's steps); "rounds": after self.rounds rounds.
        self.by_samples = config.elastic_budget == "samples"
        self.budget = self._step0(self.rounds) * options.machines
        self.machine_steps = 0  # local steps the decided exchanges took in, run-wide
        self.slot_mean = config.elastic_mean == "slots"
        self.next_token = exp.dataset.task == "next_token"
        self.seed = exp.seed * 1_000_003 + options.machine
        self.batcher = self._batcher(config)
        self.anchor, self.model_state = loop.initial_model(exp)
        self.outer = elastic_outer.OuterStep(config, self.anchor, exp.compressor)
        self.outer_state = self.outer.init(self.anchor)
        self.programs = steps.make_programs(
            exp.model, exp.tx, layout, next_token=self.next_token, plan=self.shards
        )
        self.opt_state = self.programs["init"](self._put(self.anchor))
        self.model_state_dev = layout.put(loop.stack(self.model_state, layout.num_nodes))
        self.key = layout.put(
            jax.random.key_data(jax.random.fold_in(jax.random.key(exp.seed + 1), options.machine)),
            per_node=False,
        )
        self.model_sig = elastic.signature(self.anchor)
        self.fingerprint = fingerprint(config)
        self.group = elastic.ElasticGroup(
            options.service,
            options.machine,
            options.machines,
            options.token,
            self.fingerprint,
            heartbeat_timeout=options.heartbeat_timeout,
            connect_timeout=options.connect_timeout,
            credentials=options.machine_credentials(),
            private_network=options.private_network,
        )
        self.evaluator = evaluation.Evaluator(exp, self.programs, anchor=False, identical=True)
        self.peers: elastic.peers.Peers | None = None
        self.transport: elastic_transport.Transport = elastic_transport.Star(self.group, self._mean)
        if config.elastic_transport == "peers":
            host, port = options.peer_bind()
            self.peers = elastic.peers.Peers(
                options.machine, options.token, host, port, options.machine_credentials(),
                machines=options.machines,
            )  # fmt: skip
            exchange = elastic_peers.PeerExchange(
                self.group,
                self.peers,
                self.anchor,
                self.outer.compressor,
                self.outer.compressed,
                # "mean" moves float32 and is reduced exactly: always scattered.
                int(config.mean_rounds) if self.outer.compressed else 2,
                self._mean,
                decay=self.outer.decay,
            )
            self.transport = elastic_transport.Peers(exchange, self.seed)
        logging.info(
            "elastic: machine %d of %d, %d worker(s)%s: %s",
            options.machine,
            options.machines,
            layout.num_nodes,
            " sharing its model (FSDP)" if self.shards is not None else "",
            elastic_outer.describe(config),
        )
        self.chunks = loop.Chunks(exp, self.programs)
        # Contributions dropped for holding NaN/Inf (every machine drops the same ones).
        self.nonfinite_received = 0
        self.round = 0
        self.joins: list[int] = []
        self.resumed: list[int] = []  # rounds this machine went on from its saved state
        self.history: list[dict] = []
        self.train_time = 0.0
        self.exchanges_path = os.path.join(workdir, "exchanges.csv")

    # -- helpers -------------------------------------------------------------

    def _batcher(self, config) -> lpdec.data.NodeBatcher:
        """This machine's batches: with elastic_data="shard" the ones its slot's nodes
        draw in the synchronous run (its seed, their node indices); with "whole", an
        order of the whole training set of the machine's own."""
        exp, workers = self.exp, self.layout.num_nodes
        whole = config.elastic_data == "whole"
        return lpdec.data.NodeBatcher(
            exp.dataset.x_train,
            exp.dataset.y_train,
            exp.partitions,
            exp.batch_size,
            self.seed if whole else exp.seed,
            augment=exp.augment,
            first_node=0 if whole else self.options.machine * workers,
        )

    def _step0(self, round_: int) -> int:
        """The run's step at which round `round_` starts (warm-up rounds are one step)."""
        if round_ < self.S:
            return round_
        return self.S + (round_ - self.S) * self.H

    def _phase(self, round_: int) -> str:
        return "sync" if round_ < self.S else "outer"

    def _put(self, tree):
        """The machine's model on its workers: whole on each, or split (shard_model)."""
        if self.shards is not None:
            return self.shards.put(tree, self.layout)
        return self.layout.put(loop.stack(tree, self.layout.num_nodes))

    def _machine_model(self, params):
        """The machine's model (host float32 tree) from its workers' parameters."""
        if self.shards is not None:
            return jax.tree.map(lambda x: x[0], self.shards.unshard(params))
        return self._node0(params)

    @staticmethod
    def _node0(tree):
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x))[0], tree)

    def _inner(self):
        """The inner optimizer's state as host arrays: one worker's (they are equal), or
        with shard_model every worker's blocks."""
        if self.shards is not None:
            return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), self.opt_state)
        return self._node0(self.opt_state)

    def _put_inner(self, inner):
        if self.shards is not None:
            return self.layout.put(inner)
        return self.layout.put(loop.stack(inner, self.layout.num_nodes))

    def _mean(self, deltas: list, steps: list[int]):
        """The round's mean of `deltas` (config.elastic_mean), in the given order."""
        if self.slot_mean:
            return elastic.slot_mean(deltas, self.options.machines)
        return elastic.step_weighted_mean(deltas, steps)

    def _done(self, round_: int) -> bool:
        """Whether the run is over before round `round_` (see `config.elastic_budget`)."""
        if self.by_samples:
            return self.machine_steps >= self.budget
        return round_ >= self.rounds

    def _state(self, round_: int) -> dict:
        return {
            "round": np.int64(round_),
            "machine_steps": np.int64(self.machine_steps),
            "anchor": self.anchor,
            "outer": self.outer_state,
            "inner": self._inner(),
            "model_state": self.model_state,
        }

    def _state_bytes(self, round_: int) -> bytes:
        return elastic.pack(self._state(round_))

    def _state_like(self) -> dict:
        return self._state(0)

    def _load_state(self, blob: bytes, own: bool = False) -> int:
        """Goes on from a packed state; `own`: this machine's saved one (its residual
        is its own unsent error; another machine's belongs to that machine)."""
        state = elastic.unpack(blob, self._state_like())
        self.anchor, self.outer_state = state["anchor"], state["outer"]
        if not own:
            for phase in self.outer_state["residual"]:
                self.outer_state["residual"][phase] = np.zeros(self.outer.size, np.float32)
        self.machine_steps = int(state["machine_steps"])
        self.model_state = state["model_state"]
        self.opt_state = self._put_inner(state["inner"])
        self.model_state_dev = self.layout.put(loop.stack(self.model_state, self.layout.num_nodes))
        return int(state["round"])

    # -- joining ---------------------------------------------------------------

    def _start(self) -> int:
        """Connects; returns the round to start from (0, a saved one, or a live machine's)."""
        self.group.connect()
        # For train.py's supervisor: this process took part, so a later abnormal end
        # (jaxlib ending a client the service declared lost) is worth a restart.
        with open(os.path.join(self.workdir, workdir_lib.ELASTIC_CONNECTED), "w") as f:
            f.write(f"{self.group.incarnation}\n")
        return self._enter()

    def _enter(self) -> int:
        """The round to go on from, once connected: a run in progress is joined; on a
        fresh service the machines' saved states decide (`_resume`)."""
        if self.group.latest_round() is not None:
            return self._join()
        if not self.options.token:
            raise RunError(
                "an elastic run needs its secret: --elastic_token_file or "
                "LPDEC_ELASTIC_TOKEN (a machine without it can only be refused)"
            )
        return self._resume()

    # -- the state on disk: a service that restarts -----------------------------

    def _state_path(self) -> str:
        return os.path.join(self.workdir, STATE_FILE)

    def _persist(self) -> None:
        """Writes the state to start round `self.round` from (atomically): what the run
        goes on from if the service is lost and started again (`_resume`)."""
        record = {"fingerprint": self.fingerprint, "state": self._state_bytes(self.round)}
        tmp = self._state_path() + ".tmp"
        with open(tmp, "wb") as f:
            f.write(serialization.msgpack_serialize(record))
        os.replace(tmp, self._state_path())

    def _saved(self) -> bytes | None:
        """This run's saved state (None: none, or another run's)."""
        try:
            with open(self._state_path(), "rb") as f:
                record = serialization.msgpack_restore(f.read())
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("fingerprint") != self.fingerprint:
            return None
        return bytes(record["state"])

    def _resume(self) -> int:
        """A fresh service: every machine posts the round of its saved state; the holders
        of the highest round (the lowest one's bytes) go on from it, the others join
        them; with no saved state anywhere the run starts at round 0."""
        me = self.options.machine
        blob = self._saved()
        mine = (-1, "")
        if blob is not None:
            try:
                mine = (int(elastic.unpack(blob, self._state_like())["round"]), digest(blob))
            except ValueError:  # another model's state: this run cannot go on from it
                blob = None
        records = self.group.resume(mine[0], mine[1], self.options.join_timeout)
        best = max((r for r, _ in records.values()), default=-1)
        if best < 0:
            logging.info("elastic: machine %d starts the run", me)
            self.group.mark_active()
            return 0
        seed = min(m for m, (r, _) in records.items() if r == best)
        if mine == records[seed]:
            round_ = self._load_state(blob, own=True)
            logging.warning(
                "elastic: machine %d goes on from its saved state at round %d (the service "
                "started again; machines %s hold that round)",
                me,
                round_,
                sorted(m for m, r in records.items() if r == records[seed]),
            )
            self.resumed.append(round_)
            self.group.mark_active()
            return round_
        logging.warning(
            "elastic: machine %d's saved state is at round %d; the run goes on from round %d: "
            "joining",
            me,
            mine[0],
            best,
        )
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
                return self._enter()
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
        step = self._step0(round_)
        return step if self.by_samples else min(step, self.exp.total_steps)

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

    # -- what train_lib.loop.run asks of a trainer -------------------------------

    def start(self) -> tuple[int, None]:
        try:
            self.round = self._start()
        except elastic.ServiceLost as error:
            raise ElasticLost(f"{error}") from None
        if not os.path.exists(self.exchanges_path):  # a restarted machine appends its rounds
            with open(self.exchanges_path, "w", newline="") as f:
                csv.DictWriter(f, EXCHANGE_FIELDS).writeheader()
        return self._step(self.round), None

    def done(self, step: int) -> bool:
        return self._done(self.round)

    def advance(self, step: int) -> loop.Progress:
        """Rounds up to the next log point (or the run's end), joining again where the
        service was lost or the run moved on without this machine."""
        losses: list[float] = []
        accuracies: list[float] = []
        row, seconds = None, 0.0
        log_every = max(self.exp.loop.log_every, self.H)
        interval = self._step(self.round) // log_every
        while not self._done(self.round):
            try:
                row, (loss, accuracy), seconds = self._round(self.round)
            except elastic.ServiceLost as error:
                self.round = self._reconnect(error, self.round)
                continue
            except elastic.Behind as error:
                logging.warning("elastic: %s", error)
                self.round = self._join()
                continue
            self.history.append(row)
            losses.append(loss)
            accuracies.append(accuracy)
            self.train_time += seconds
            with open(self.exchanges_path, "a", newline="") as f:
                csv.DictWriter(f, EXCHANGE_FIELDS).writerow(row)
            if not row["anchors_agree"]:
                logging.warning(
                    "elastic: round %d's members started from different anchors", self.round
                )
            self.round += 1
            self._persist()
            if self._step(self.round) // log_every > interval:
                break
        # Joined for the run's final state after its last round: that state is logged.
        row = row or (self.history[-1] if self.history else None)
        sent = (row["bytes_sent"] + row["bytes_received"]) / row["local_steps"] if row else math.nan
        members = len(row["members"].split()) if row else math.nan
        return loop.Progress(
            self._step(self.round), losses, accuracies, seconds / self.h, sent,
            extra={"members": members},
        )  # fmt: skip

    def evaluate(self, step: int) -> dict[str, float]:
        return self.evaluator.evaluate(
            self._put(self.anchor), self.opt_state, self.model_state_dev, step
        )

    def health(self) -> tuple[int, int, int]:
        updates, _, theta = metrics_lib.health_counts(self.opt_state)
        return updates, self.nonfinite_received, theta

    def save(self, step: int, meta: dict[str, Any]) -> None:
        """Nothing more: `advance` writes the state after every round (`_persist`)."""

    def end(self, step: int, diverged: bool) -> dict[str, Any]:
        if not diverged:
            # Every machine watches its own loss, as each process of a synchronous run
            # does; a diverged one stops and hands nothing over.
            self._finish(self.round)
        self.group.close()
        options, history = self.options, self.history
        return {
            "rounds": self.round,
            "budget": "samples" if self.by_samples else "rounds",
            "machine_steps": self.machine_steps,
            "budget_machine_steps": self.budget,
            "machine": options.machine,
            "machines": options.machines,
            "local_steps": self.h,
            "joined_at_rounds": self.joins,
            "resumed_at_rounds": self.resumed,
            "rounds_included": sum(int(r["included"]) for r in history),
            "rounds_seen": len(history),
            "rounds_short": sum(len(r["members"].split()) < options.machines for r in history),
            "anchors_agree": all(r["anchors_agree"] for r in history),
            "final_anchor_digest": elastic.tree_digest(self.anchor),
            "train_time_s": self.train_time,
        }

    def export(self, workdir: str) -> None:
        checkpoint.write_params(workdir, self.anchor)

    def _whole_payload(self, delta, phase: str) -> tuple[bytes, np.ndarray]:
        """This round's whole encoded pseudo-gradient and the residual it leaves."""
        payload, residual = self.outer.encode(delta, self.outer_state, phase, self.options.machine)
        return elastic.pack(payload), residual

    def _decode_whole(self, blob: bytes, sender: int, phase: str) -> np.ndarray | None:
        """Member `sender`'s whole payload as a flat float32 vector (None: not finite)."""
        payload = elastic.unpack(blob, self.outer.payload_like)
        return self.outer.decode(payload, self.outer_state, phase, sender)

    def _round(self, round_: int) -> tuple[dict, tuple[float, float], float]:
        """One round: local steps, the exchange, the outer step; returns its row."""
        phase = self._phase(round_)
        h = 1 if phase == "sync" else self.h
        step0 = self._step0(round_)
        self.batcher.restore({**self.batcher.state(), "step": step0})
        params, self.opt_state, self.model_state_dev, losses, accuracies, per_step = (
            self.chunks.run(
                self._put(self.anchor), self.opt_state, self.model_state_dev, self.batcher, h,
                step0, self.key,
            )
        )  # fmt: skip
        seconds = per_step * h
        if self.options.slowdown > 1:
            time.sleep(seconds * (self.options.slowdown - 1))
            seconds *= self.options.slowdown
        if seconds < self.options.min_round_s:
            time.sleep(self.options.min_round_s - seconds)
            seconds = self.options.min_round_s
        x = self._machine_model(params)
        delta = jax.tree.map(lambda a, b: np.float32(a) - np.asarray(b, np.float32), self.anchor, x)
        offer = elastic_transport.Offer(
            delta=delta,
            residual=self.outer_state["residual"][phase],
            feedback=self.outer.feedback,
            steps=h,
            anchor_digest=elastic.tree_digest(self.anchor),
            payload=lambda: self._whole_payload(delta, phase),
            decode=lambda blob, sender: self._decode_whole(blob, sender, phase),
        )
        moved = self.transport.round(round_, offer, self.options.deadline)
        ex, mean, void = moved.exchange, moved.mean, moved.void
        sent, received = moved.sent, moved.received
        self.outer_state["residual"][phase] = moved.residual
        # A contribution holding NaN/Inf is dropped, by every machine alike (they decode
        # the same ones), and counted: as lpdec's exchanges skip a non-finite payload.
        self.nonfinite_received += moved.nonfinite
        if void:
            # A member's bytes did not come: this machine's anchor stays where it was (as
            # every member's that missed them), and the round's steps are lost.
            logging.warning("elastic: round %d is void here: %s", round_, void)
        else:
            self.machine_steps += sum(c.steps for c in ex.contributions)
            self.anchor = self.outer.apply(self.anchor, self.outer_state, phase, mean)
        if ex.members and min(ex.members) == self.options.machine:
            for line in self.group.serve_joins(
                round_ + 1, self.model_sig, lambda: self._state_bytes(round_ + 1)
            ):
                logging.warning("elastic: %s", line)
        row = {
            "round": round_,
            "step": self._step0(round_ + 1),
            "members": " ".join(str(m) for m in ex.members),
            "included": int(ex.included),
            "reason": ex.reason,
            "closed_by": ex.closed_by,
            "waited_s": round(ex.waited_s, 3),
            "bytes_sent": sent,
            "bytes_received": received,
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
