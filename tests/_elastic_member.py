"""One member of an elastic group for tests/test_elastic.py, with no training.

    python tests/_elastic_member.py ADDRESS MACHINE MACHINES ROUNDS [--token T]
        [--fingerprint F] [--model S] [--sleep S] [--deadline S] [--join_timeout S]

Each round's "pseudo-gradient" is the vector [machine + 1] * 4 (steps = 1 + machine
with --steps_by_machine); the state w follows w <- w + step-weighted mean. Prints one
JSON object per line: {"event": "round", ...}, {"event": "joined", ...},
{"event": "serve", "line": ...}, {"event": "refused", "error": ...} (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from lpdec import elastic


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("address")
    p.add_argument("machine", type=int)
    p.add_argument("machines", type=int)
    p.add_argument("rounds", type=int)
    p.add_argument("--token", default="secret")
    p.add_argument("--fingerprint", default="fp")
    p.add_argument("--model", default="model")
    p.add_argument("--sleep", type=float, default=0.2)
    p.add_argument("--deadline", type=float, default=20.0)
    p.add_argument("--join_timeout", type=float, default=30.0)
    p.add_argument("--steps_by_machine", action="store_true")
    p.add_argument("--slow_round", type=int, default=-1, help="sleep --slow_sleep before it")
    p.add_argument("--slow_sleep", type=float, default=0.0)
    p.add_argument("--finish", action="store_true", help="declare the run over at the end")
    a = p.parse_args()
    emit = lambda **kw: print(json.dumps(kw), flush=True)  # noqa: E731
    group = elastic.ElasticGroup(
        a.address, a.machine, a.machines, a.token.encode(), a.fingerprint,
        heartbeat_timeout=2, connect_timeout=30,
    )  # fmt: skip
    try:
        group.connect()
    except elastic.GateRefused as error:  # nothing of it registered
        emit(event="refused", error=str(error))
        return 2
    state = {"w": np.zeros(4, np.float32)}
    start = 0
    if group.latest_round() is not None:
        try:
            start, blob = group.join(a.model, timeout=a.join_timeout)
        except elastic.JoinRefused as error:
            emit(event="refused", error=str(error))
            group.close()
            return 2
        state = elastic.unpack(blob, state)
        emit(event="joined", round=start, w=float(state["w"][0]))
    group.mark_active()
    for r in range(start, a.rounds):
        time.sleep(a.slow_sleep if r == a.slow_round else a.sleep)
        steps = 1 + a.machine if a.steps_by_machine else 1
        delta = {"w": np.full(4, a.machine + 1, np.float32)}
        try:
            ex = group.exchange(
                r, elastic.pack(delta), steps, elastic.tree_digest(state), a.deadline
            )
        except elastic.Behind as error:
            emit(event="behind", error=str(error))
            group.close()
            return 5
        deltas = [elastic.unpack(c.payload, delta) for c in ex.contributions]
        mean = elastic.step_weighted_mean(deltas, [c.steps for c in ex.contributions])
        state = {"w": state["w"] + mean["w"]}
        emit(
            event="round",
            round=r,
            members=list(ex.members),
            included=ex.included,
            reason=ex.reason,
            agree=len({c.anchor_digest for c in ex.contributions}) == 1,
            waited=ex.waited_s,
            by=ex.closed_by,
            w=float(state["w"][0]),
        )
        if min(ex.members) == a.machine:
            for line in group.serve_joins(r + 1, a.model, lambda s=state: elastic.pack(s)):
                emit(event="serve", line=line)
    if a.finish:
        group.finish(a.rounds - 1)
    group.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as train.py: no interpreter teardown around jaxlib's client threads
