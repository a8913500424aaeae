"""Elastic faults: machines of an elastic DiLoCo run (train.py --elastic_service)
that are lost, cut off or slow. Each machine and the coordinating service run
in their own network namespace (bench/netns.py), so a machine can be killed or
cut off without touching the service; on loopback where namespaces cannot be
made (the link-down case is then not run).
"""

from __future__ import annotations

import csv
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import numpy as np

from bench import harness
from bench import netns
from bench.faults.common import ROOT
from bench.faults.common import Context
from bench.faults.common import Trial
from bench.faults.common import _popen
from bench.faults.common import stderr_of
from bench.faults.common import summary

ELASTIC_MACHINES = 3
ELASTIC_STEPS = 6000  # 600 rounds of H = 10: about 110 s uninterrupted on 2 CPU cores
ELASTIC_ROUNDS = ELASTIC_STEPS // 10
ELASTIC_HEARTBEAT = 3  # s: the service's and the machines' heartbeat timeout
ELASTIC_JOIN_TIMEOUT = 60  # s: a joining (or reconnecting) machine waits this long
ELASTIC_BOUND = 420.0  # s: every process of a trial must have ended by then
ELASTIC_STALL = 20.0  # s: an exchange that waited longer is a stall
SLOW_DEADLINE = 0.1  # s: the exchange deadline of the slow machine's same-H case
SLOWDOWN = 10
# The tolerance against uninterrupted runs, fixed before the table it judges (and
# never loosened after the fact). The first table (2026-11-27 06:54) compared with one
# seed-0 run, two-sided (3 points of test accuracy, 10 % of the machines' last-interval
# train loss); uninterrupted runs of other seeds then ended 3 points above that run, and
# faulted tries that did better than it failed. The second (2026-11-27 09:35) compared
# the final evaluation, one-sided, with the worst of 3 seeds: the uninterrupted runs'
# own consecutive evaluations swing by up to 3.3 points (74.3 % to 77.6 % between steps
# 5950 and 6000 of seed 2), more than its 1-point margin. Since then: the metrics are
# the mean of the last LAST_EVALS evaluations (the last 500 steps, 50 rounds) of the
# anchor; a faulted try (seed 0) must be no worse than the worst of REFERENCE_SEEDS
# uninterrupted runs, less the margins below (doing better is no failure).
# The third table (2026-11-27 10:07) judged runs of 600 rounds whoever took part: the
# slow machine's tries ended 2-4 points short, as an uninterrupted run of 2 machines
# does. Since 2026-11-27 11:55 (before the fourth table ran), configs/elastic_mlp.py
# takes elastic_budget="samples": every try is as long as the uninterrupted runs in
# local steps (3 x ELASTIC_STEPS), however many rounds that takes; the references and
# the margins are unchanged. In that fourth table (samples budget, the contributors'
# step-weighted mean) kill and link-down passed 6/6 and the first slow try still
# ended 5.8 points short: its test accuracy settled at a lower level from step ~1500
# on, as a constant learning rate settles at a noise floor, and a round of 2
# machines took a full-length outer step from 2/3 of the batches. Since
# 2026-11-27 12:35 (before the fifth table ran) configs/elastic_mlp.py also takes
# elastic_mean="slots" (lpdec.elastic.slot_mean: a missing machine adds zero);
# references and margins unchanged.
REFERENCE_SEEDS = (0, 1, 2)
LAST_EVALS = 10
ACCURACY_POINTS = 1.0  # final test accuracy of the anchor: >= the worst reference's - this
LOSS_RELATIVE = 0.05  # final test loss of the anchor: <= the worst reference's x (1 + this)
FAULT_ROUNDS = (10, 60)  # a machine is killed or cut off after a round drawn from these
# Kill and link-down runs pace every round at >= PACE_S (`LPDEC_ELASTIC_PACE`), so
# that two machines do not race through the run while the third restarts; pacing
# changes no number of an uninterrupted run (every round has every machine).
PACE_S = 0.15
# train_lib.elastic_flags.PACE_ENV (importing it would define train.py's flags here).
PACE_ENV = "LPDEC_ELASTIC_PACE"
PACED = {m: (f"{PACE_ENV}=min_round_s={PACE_S}",) for m in range(ELASTIC_MACHINES)}
ELASTIC_FLAGS = (
    f"--config={ROOT / 'configs' / 'elastic_mlp.py'}",
    f"--config.num_steps={ELASTIC_STEPS}",
)
ELASTIC_SUBNET = 97
_clusters = iter(range(1_000_000))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Cluster:
    """One elastic run: the service (host 0) and machines 0..2 (hosts 1..3).

    `namespaces`: each in its own network namespace on a bridge; else all on
    loopback. `machine_flags[m]`: extra train.py flags of machine m.
    """

    def __init__(
        self, ctx: Context, root: pathlib.Path, machine_flags=None, credentials: bool = False
    ):
        self.root = root
        self.bound = min(ELASTIC_BOUND, ctx.timeout)
        namespaces = ctx.namespaces
        root.mkdir(parents=True, exist_ok=True)
        self.token = root / "token"
        self.token.write_text(os.urandom(32).hex())
        # With credentials: mutual TLS between the service and the machines (jax >=
        # 0.11.2) instead of the harness's word that its namespaces are private.
        self.credentials: pathlib.Path | None = None
        if credentials:
            from lpdec.elastic import credentials as creds  # noqa: PLC0415

            self.credentials = root / "credentials"
            token = self.token.read_text().strip().encode()
            creds.make(str(self.credentials), ELASTIC_MACHINES, token=token)
        self.machine_flags = machine_flags or {}
        self.procs: dict[int, list[subprocess.Popen]] = {m: [] for m in range(ELASTIC_MACHINES)}
        self.service: subprocess.Popen | None = None
        self.net: netns.Network | None = None
        if namespaces:
            prefix = f"lpdecf{os.getpid()}x{next(_clusters)}"
            self.net = netns.Network(ELASTIC_MACHINES + 1, prefix, ELASTIC_SUBNET)
            netns.NETWORKS.append(self.net)
            self.net.create()
            self.address = f"{self.net.address(0)}:29600"
        else:
            self.address = f"127.0.0.1:{harness.free_port()}"
        self.started = time.monotonic()
        self.commit = harness.commit()

    def _in(self, host: int) -> list[str]:
        return self.net.exec_prefix(host) if self.net else []

    def _track(self, proc: subprocess.Popen) -> subprocess.Popen:
        netns.CHILDREN.append(proc)
        return proc

    def workdir(self, m: int) -> pathlib.Path:
        return self.root / f"m{m}"

    def start(self) -> None:
        self.service = self._track(
            _popen(
                [
                    *self._in(0), sys.executable, "-m", "lpdec.elastic", "serve",
                    "--bind", self.address, "--machines", str(ELASTIC_MACHINES),
                    "--heartbeat_timeout", str(ELASTIC_HEARTBEAT), "--token_file", str(self.token),
                    *self._trust("--credentials", "--private_network"),
                ],
                1,
                self.root / "service.log",
            )
        )  # fmt: skip
        for m in range(ELASTIC_MACHINES):
            self.start_machine(m)

    def _trust(self, credentials_flag: str, private_flag: str) -> list[str]:
        """The flags that let a process off loopback: the run's credentials, or (in the
        namespaces this harness made, which only its processes reach) a private network."""
        if self.credentials is not None:
            return [f"{credentials_flag}={self.credentials}"]
        return [private_flag]

    def machine_command(self, m: int, host: int, workdir: pathlib.Path, *extra: str) -> list:
        """train.py as machine slot m, run in host `host`'s namespace."""
        # The fault tests' pacing travels in the environment (train_lib.elastic_flags.pace).
        pace = [e for e in extra if e.startswith(f"{PACE_ENV}=")]
        extra = tuple(e for e in extra if e not in pace)
        command = [*self._in(host), *(["env", *pace] if pace else []), sys.executable]
        return command + [
            str(ROOT / "train.py"),
            f"--workdir={workdir}",
            *ELASTIC_FLAGS,
            f"--elastic_service={self.address}",
            f"--elastic_machines={ELASTIC_MACHINES}",
            f"--elastic_machine={m}",
            f"--elastic_heartbeat_timeout={ELASTIC_HEARTBEAT}",
            f"--elastic_join_timeout={ELASTIC_JOIN_TIMEOUT}",
            *extra,
        ]

    def start_machine(self, m: int) -> None:
        """Starts machine m (again: the same command, the same workdir)."""
        command = self.machine_command(
            m, m + 1, self.workdir(m),
            *self._trust("--elastic_credentials", "--elastic_private_network"),
            f"--elastic_token_file={self.token}", *self.machine_flags.get(m, ()),
        )  # fmt: skip
        log = self.root / f"m{m}-{len(self.procs[m])}.log"
        self.procs[m].append(self._track(_popen(command, 1, log)))

    def kill(self, m: int) -> None:
        harness.kill_group(self.procs[m][-1])
        self.procs[m][-1].wait()

    def link(self, m: int, up: bool) -> None:
        _ip("netns", "exec", self.net.names[m + 1], "ip", "link", "set", "eth0",
            "up" if up else "down")  # fmt: skip

    def rows(self, m: int) -> list[dict]:
        path = self.workdir(m) / "exchanges.csv"
        try:
            with open(path, newline="") as f:
                return list(csv.DictReader(f))
        except OSError:
            return []

    def wait_for_round(self, m: int, round_: int) -> bool:
        """Until machine m has logged exchange `round_`; False if the run ended first."""
        proc = self.procs[m][-1]
        deadline = self.started + self.bound
        while time.monotonic() < deadline and proc.poll() is None:
            rows = self.rows(m)
            if rows and int(rows[-1]["round"]) >= round_:
                return True
            time.sleep(0.05)
        return False

    def finish(self) -> tuple[list[int | None], list[int], float]:
        """Waits for every machine's last process until the trial's bound; returns their
        exit statuses, the machines that had to be killed (hung), and the seconds taken."""
        deadline = self.started + self.bound
        hung = []
        for m in range(ELASTIC_MACHINES):
            proc = self.procs[m][-1]
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                hung.append(m)
                harness.kill_group(proc)
                proc.wait()
        took = time.monotonic() - self.started
        return [self.procs[m][-1].returncode for m in range(ELASTIC_MACHINES)], hung, took

    def close(self) -> None:
        """Ends every process (the service with SIGTERM first) and removes the network."""
        for procs in self.procs.values():
            for proc in procs:
                harness.kill_group(proc)
                proc.wait()
        if self.service is not None:
            if self.service.poll() is None:
                self.service.send_signal(signal.SIGTERM)
                try:
                    self.service.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            harness.kill_group(self.service)
            self.service.wait()
        for procs in [*self.procs.values(), [self.service]]:
            for proc in procs:
                if proc in netns.CHILDREN:
                    netns.CHILDREN.remove(proc)
        if self.net is not None:
            self.net.destroy()
            netns.NETWORKS.remove(self.net)

    def restarts(self, m: int) -> int:
        """How many times train.py's supervisor restarted machine m's last process."""
        return stderr_of(self.procs[m][-1]).count("restarting it to rejoin")

    def tail(self, m: int, lines: int = 2) -> str:
        """The last lines of machine m's last log that say why it ended (error lines,
        jaxlib's fatal checks, C++ terminations), else its last lines."""
        text = [t.strip() for t in stderr_of(self.procs[m][-1]).splitlines() if t.strip()]
        why = re.compile(r"^(error:|F\d{4} |terminate called|  what\(\)|Fatal Python)")
        keep = [t for t in text if why.match(t) or "elastic:" in t] or text
        return " / ".join(line[-240:] for line in keep[-lines:])


def _final(cluster: Cluster) -> dict:
    """Final metrics of a finished cluster: the anchor's test accuracy, the machines'
    mean train loss, their anchors' digests."""
    summaries = [summary(cluster.workdir(m)) for m in range(ELASTIC_MACHINES)]
    accuracies, losses = [], []
    for m in range(ELASTIC_MACHINES):
        path = cluster.workdir(m) / "metrics.csv"
        if not path.exists():
            continue
        with open(path) as f:
            rows = [r for r in csv.DictReader(f) if r.get("test_loss_avg_model")]
        if rows:  # the anchor's last LAST_EVALS evaluations (see REFERENCE_SEEDS)
            accuracies.append(
                np.mean([float(r["test_accuracy_avg_model"]) for r in rows[-LAST_EVALS:]])
            )
            losses.append(np.mean([float(r["test_loss_avg_model"]) for r in rows[-LAST_EVALS:]]))
    return {
        "summaries": summaries,
        "accuracy": float(np.mean(accuracies)) if accuracies else float("nan"),
        "loss": float(np.mean(losses)) if losses else float("nan"),
        "digests": [s.get("final_anchor_digest") for s in summaries],
        "wall_s": max((s.get("wall_time_s", 0.0) for s in summaries), default=0.0),
    }


def elastic_reference(ctx: Context) -> dict:
    """The uninterrupted 3-machine runs, one per `REFERENCE_SEEDS` seed (trained once per
    invocation, on first use): their worst final test accuracy and test loss, and each."""
    if ctx._elastic is None:
        runs = []
        for seed in REFERENCE_SEEDS:
            flags = {m: (f"--config.seed={seed}",) for m in range(ELASTIC_MACHINES)}
            cluster = Cluster(ctx, ctx.root / f"elastic-straight-{seed}", flags)
            try:
                cluster.start()
                codes, hung, took = cluster.finish()
            finally:
                cluster.close()
            final = _final(cluster)
            if hung or any(codes) or len(set(final["digests"])) != 1:
                raise RuntimeError(
                    f"the uninterrupted elastic run (seed {seed}) failed: exits {codes}, "
                    f"hung {hung}: {cluster.tail(0)}"
                )
            rounds = (final["summaries"][0] or {}).get("rounds")
            runs.append(
                {
                    "seed": seed,
                    "accuracy": final["accuracy"],
                    "loss": final["loss"],
                    "took_s": round(took, 1),
                    "rounds": rounds,
                }
            )
            print(
                f"elastic reference, seed {seed}: test accuracy {final['accuracy']:.4f}, "
                f"test loss {final['loss']:.4f}, {took:.0f} s",
                flush=True,
            )
        ctx._elastic = {
            "accuracy": min(r["accuracy"] for r in runs),
            "loss": max(r["loss"] for r in runs),
            "runs": runs,
            "took_s": took,
            "commit": cluster.commit,
        }
    return ctx._elastic


def _judge(ctx: Context, cluster: Cluster, case: dict, checks: dict) -> Trial:
    """Runs a trial's cluster to its end and judges it (see `elastic_table`)."""
    codes, hung, took = cluster.finish()
    reference = elastic_reference(ctx)
    final = _final(cluster)
    rows = {m: cluster.rows(m) for m in range(ELASTIC_MACHINES)}
    restarted = {m: cluster.restarts(m) for m in range(ELASTIC_MACHINES)}
    victim = case.get("machine")
    others = [m for m in range(ELASTIC_MACHINES) if m != victim]
    waited = max((float(r["waited_s"]) for m in others for r in rows[m]), default=0.0)
    short = sum(len(r["members"].split()) < ELASTIC_MACHINES for m in others for r in rows[m])
    agree_rows = all(r["anchors_agree"] == "1" for m in rows for r in rows[m])
    digests = [d for d in final["digests"] if d is not None]
    missing = [m for m, d in enumerate(final["digests"]) if d is None]
    agree = agree_rows and len(set(digests)) == 1 and not missing
    d_accuracy = 100 * (final["accuracy"] - reference["accuracy"])
    d_loss = (final["loss"] - reference["loss"]) / reference["loss"]
    data = {
        **case,
        "exits": codes,
        "hung": hung,
        "took_s": round(took, 1),
        "short_rounds": short,
        "longest_wait_s": waited,
        "anchors_agree": agree,
        "digests": len(set(digests)),
        "no_summary": missing,
        "supervisor_restarts": restarted,
        "commit": cluster.commit,
        "accuracy": final["accuracy"],
        "loss": final["loss"],
        "d_accuracy_points": d_accuracy,
        "d_loss_relative": d_loss,
        # The run's length: rounds (of a machine not faulted) and the local steps its
        # exchanges took in (config.elastic_budget "samples": >= 3 x ELASTIC_STEPS).
        "rounds": (final["summaries"][others[0]] or {}).get("rounds"),
        "machine_steps": (final["summaries"][others[0]] or {}).get("machine_steps"),
    }
    ok = {
        "ended": not hung and all(c == 0 for c in codes),
        "no stall": waited <= ELASTIC_STALL,
        "anchors agree": agree,
        "accuracy": d_accuracy >= -ACCURACY_POINTS,
        "loss": d_loss <= LOSS_RELATIVE,
        **checks(rows, final["summaries"], data),
    }
    data["failed"] = [k for k, v in ok.items() if not v]
    notes = [case["what"]]
    if hung:
        notes.append(f"hung: machines {hung} killed at {cluster.bound:g} s")
    for m, code in enumerate(codes):
        if code != 0:
            notes.append(f"machine {m} exited {code}: {cluster.tail(m)}")
    if missing:
        notes.append(f"no summary from machine(s) {missing}")
    if len(set(digests)) > 1 or not agree_rows:
        notes.append(f"{len(set(digests))} different final anchors; rows agree={agree_rows}")
    notes.extend(data.pop("extra_notes", []))
    return Trial(not data["failed"], "; ".join(notes), data=data)


def _rejoin_checks(victim: int):
    """The victim joined again, and its first exchange after the join had everyone."""

    def checks(rows, summaries, data):
        data["restarts"] = data.pop("supervisor_restarts", {}).get(victim, 0)
        joins = summaries[victim].get("joined_at_rounds", []) if summaries[victim] else []
        data["joined_at"] = joins
        first = next((r for r in rows[victim] if joins and int(r["round"]) >= joins[-1]), None)
        data["first_after_join"] = (
            None
            if first is None
            else f"r{first['round']} members [{first['members']}] agree={first['anchors_agree']}"
        )
        return {
            "rejoined": bool(joins),
            "first exchange after the join agrees": first is not None
            and first["anchors_agree"] == "1"
            and str(victim) in first["members"].split(),
            "survivors saw short rounds": data["short_rounds"] > 0,
        }

    return checks


def elastic_kill(ctx: Context, rng: np.random.Generator) -> Trial:
    """kill -9 of one machine at a random round; the same command again 5-15 s later."""
    victim = int(rng.integers(0, ELASTIC_MACHINES))
    at = int(rng.integers(*FAULT_ROUNDS))
    down = float(rng.uniform(5, 15))
    elastic_reference(ctx)
    cluster = Cluster(ctx, ctx.scratch("elastic-kill"), PACED)
    try:
        cluster.start()
        if not cluster.wait_for_round(victim, at):
            return Trial(False, f"machine {victim} ended before round {at}", happened=False)
        time.sleep(float(rng.uniform(0, 0.2)))
        cluster.kill(victim)
        killed = len(cluster.rows(victim))
        time.sleep(down)
        cluster.start_machine(victim)
        case = {
            "machine": victim,
            "what": f"machine {victim} killed after round {killed - 1}, restarted {down:.1f} s "
            "later",
        }
        return _judge(ctx, cluster, case, _rejoin_checks(victim))
    finally:
        cluster.close()


def elastic_link(ctx: Context, rng: np.random.Generator) -> Trial:
    """One machine's link down for 10 s at a random round, then up again."""
    if not ctx.namespaces:
        return Trial(False, f"not run: {ctx.no_namespaces}", skipped=True)
    victim = int(rng.integers(0, ELASTIC_MACHINES))
    at = int(rng.integers(*FAULT_ROUNDS))
    elastic_reference(ctx)
    cluster = Cluster(ctx, ctx.scratch("elastic-link"), PACED)
    try:
        cluster.start()
        if not cluster.wait_for_round(victim, at):
            return Trial(False, f"machine {victim} ended before round {at}", happened=False)
        cluster.link(victim, up=False)
        cut = int(cluster.rows(victim)[-1]["round"])
        time.sleep(10.0)
        cluster.link(victim, up=True)
        case = {
            "machine": victim,
            "what": f"machine {victim}'s link down for 10 s after round {cut}",
        }
        return _judge(ctx, cluster, case, _rejoin_checks(victim))
    finally:
        cluster.close()


def _slow(ctx: Context, rng, name: str, same_h: bool) -> Trial:
    slow = int(rng.integers(0, ELASTIC_MACHINES))
    flags = {slow: (f"{PACE_ENV}=slowdown={SLOWDOWN}",)}
    if same_h:
        flags = {
            m: (f"--elastic_deadline={SLOW_DEADLINE}", *flags.get(m, ()))
            for m in range(ELASTIC_MACHINES)
        }
        what = (
            f"machine {slow} {SLOWDOWN}x slower, same H = 10, every machine's deadline "
            f"{SLOW_DEADLINE:g} s"
        )
    else:
        flags[slow] += ("--elastic_local_steps=1",)
        what = f"machine {slow} {SLOWDOWN}x slower with H = 1 (the others 10), deadline 60 s"
    elastic_reference(ctx)
    cluster = Cluster(ctx, ctx.scratch(name), flags)

    def checks(rows, summaries, data):
        s = summaries[slow] or {}
        seen, included = s.get("rounds_seen", 0), s.get("rounds_included", 0)
        data["slow_included"] = f"{included}/{seen}"
        other = (slow + 1) % ELASTIC_MACHINES
        data["slow_in_means"] = sum(str(slow) in r["members"].split() for r in rows[other])
        if same_h:
            # Its contributions come late: the others' means go on without some of them.
            return {"the others went on without it": data["short_rounds"] > 0}
        return {"it kept up (every round all 3)": data["short_rounds"] == 0}

    try:
        cluster.start()
        return _judge(ctx, cluster, {"machine": slow, "what": what}, checks)
    finally:
        cluster.close()


def elastic_slow_deadline(ctx: Context, rng: np.random.Generator) -> Trial:
    """One machine 10x slower with the others' H and a short deadline: its contributions
    come late and are dropped; the others go on without them."""
    return _slow(ctx, rng, "elastic-slow-deadline", same_h=True)


def elastic_slow_h(ctx: Context, rng: np.random.Generator) -> Trial:
    """One machine 10x slower with H / 10 local steps: it keeps up (how the mean weighs
    machines of different steps is lpdec.elastic's choice; the try measures the outcome)."""
    return _slow(ctx, rng, "elastic-slow-h", same_h=False)


def elastic_intruder(ctx: Context, rng: np.random.Generator) -> Trial:
    """Two processes claim a live machine's slot at a random round of a run with mutual
    TLS: one with the run's credentials but a wrong token, one with the right token but
    no credentials. Both must be refused in one line, and the run must not notice."""
    from lpdec.elastic import credentials  # noqa: PLC0415

    if why := credentials.mutual_tls_unavailable():
        return Trial(False, f"not run: {why}", skipped=True)
    victim = int(rng.integers(0, ELASTIC_MACHINES))
    at = int(rng.integers(*FAULT_ROUNDS))
    elastic_reference(ctx)
    cluster = Cluster(ctx, ctx.scratch("elastic-intruder"), PACED, credentials=True)
    try:
        cluster.start()
        if not cluster.wait_for_round(victim, at):
            return Trial(False, f"machine {victim} ended before round {at}", happened=False)
        wrong = cluster.root / "wrong-token"
        wrong.write_text(os.urandom(32).hex())
        # Under train.py's supervisor, as a user runs it: a child that ends before it
        # registers is not restarted; the supervisor says why in one line.
        once = ("--elastic_connect_timeout=20",)
        intruders = {
            "wrong token": cluster.machine_command(
                victim, victim + 1, cluster.root / "intruder-token",
                f"--elastic_credentials={cluster.credentials}", f"--elastic_token_file={wrong}",
                *once,
            ),
            "no credentials": cluster.machine_command(
                victim, victim + 1, cluster.root / "intruder-tls", "--elastic_private_network",
                f"--elastic_token_file={cluster.token}", *once,
            ),
        }  # fmt: skip
        procs = {
            name: cluster._track(_popen(command, 1, cluster.root / f"intruder-{i}.log"))
            for i, (name, command) in enumerate(intruders.items())
        }
        exits = {}
        for name, proc in procs.items():
            try:
                exits[name] = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                harness.kill_group(proc)
                exits[name] = "hung"
        lines = {
            name: [t for t in stderr_of(proc).splitlines() if t.startswith("error:")]
            for name, proc in procs.items()
        }
        case = {
            "machine": None,
            "what": f"two intruders for machine {victim}'s live slot after round {at}: "
            + "; ".join(
                f"{n}: exit {exits[n]}, {(lines[n] or ['no error line'])[-1][:160]}" for n in procs
            ),  # fmt: skip
        }

        def checks(rows, summaries, data):
            data["intruder_exits"] = exits
            return {
                "intruders refused in one line": all(
                    exits[n] not in (0, "hung") and len(lines[n]) == 1 for n in procs
                ),
                "no short round": data["short_rounds"] == 0,
                "no machine restarted": not any(data.get("supervisor_restarts", {}).values()),
            }

        return _judge(ctx, cluster, case, checks)
    finally:
        cluster.close()
