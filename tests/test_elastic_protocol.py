"""The elastic protocol's races, deterministically, in one process (issue 42, item 4).

`lpdec.elastic.ElasticGroup` on an in-memory service (`MemoryService`): the test
plays the service (kills a slot, restarts one under a new incarnation) and
interleaves machines by hand (`before_put` runs one machine's exchange between
another's read and its write), so who decides a round, late contributions,
`Behind` and joins at the end of a run are checked without processes or clocks.
tests/test_elastic.py runs the same protocol on jax's service in real processes.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

from lpdec import elastic

TOKEN = b"the run's token"


def _group(service, machine, token=TOKEN, fingerprint="fp"):
    group = elastic.ElasticGroup(
        "memory:0",
        machine,
        service.machines,
        token,
        fingerprint,
        poll_s=0.001,
        store=service.store(machine),
    )
    group.connect()
    return group


def _run(machines=3):
    service = elastic.MemoryService(machines)
    groups = [_group(service, m) for m in range(machines)]
    for group in groups:
        group.mark_active()
    return service, groups


def _contribute(group, round_, deadline=0.0):
    """Machine m sends the bytes m+1, after m+1 local steps, from anchor "a"."""
    m = group.machine
    return group.exchange(round_, bytes([m + 1]), m + 1, "a", deadline)


def test_the_first_decision_written_is_the_one_every_machine_applies():
    """Machine 0 reads no decision, and before it writes its own ([0]) machine 1
    contributes and decides [0, 1]: the create-only write keeps machine 1's, which
    machine 0 reads back; machine 2, later, is dropped but applies the same mean."""
    service, (m0, m1, m2) = _run()
    ran = []

    def race(machine, key):
        if machine == 0 and key == "r0/d" and not ran:
            ran.append(_contribute(m1, 0))

    service.before_put = race
    seen0 = _contribute(m0, 0)
    service.before_put = None
    seen2 = _contribute(m2, 0, deadline=10.0)  # the decision exists: no wait
    (seen1,) = ran
    for seen in (seen0, seen1, seen2):
        assert seen.members == (0, 1) and seen.closed_by == 1 and seen.reason == "deadline"
        assert [c.payload for c in seen.contributions] == [b"\x01", b"\x02"]
        assert [c.steps for c in seen.contributions] == [1, 2]
    assert seen0.included and seen1.included and not seen2.included
    # Exactly one decision was written, machine 1's.
    assert json.loads(service.keys["r0/d"])["by"] == 1


def test_a_dead_machine_is_not_waited_for_and_a_restarted_one_only_once_it_trains():
    service, (m0, m1, m2) = _run()
    service.kill(2)
    # Machines 0 and 1 are all that is expected: the round closes on "all" as soon as
    # both contributed, although the deadline is 10 s.
    seen: dict[int, elastic.Exchange] = {}
    thread = threading.Thread(target=lambda: seen.__setitem__(0, _contribute(m0, 0, 10.0)))
    thread.start()
    seen[1] = _contribute(m1, 0, deadline=10.0)
    thread.join(timeout=5)
    for exchange in seen.values():
        assert exchange.reason == "all" and exchange.members == (0, 1)
        assert exchange.waited_s < 5
    # Restarted: a new incarnation that has not joined yet is not expected...
    back = _group(service, 2)
    assert back.incarnation == 2 and m0.expected() == {0, 1}
    # ...until it trains under it.
    back.mark_active()
    assert m0.expected() == {0, 1, 2}


def test_records_without_the_token_are_never_used():
    """The signatures' layer, below the gate: a process that wrote records without the
    token (here on a dead slot of the in-memory service, which has no gate) adds no
    header any machine reads, and its decision is refused, never applied."""
    service, (m0, m1, _) = _run()
    service.kill(2)
    stranger = _group(service, 2, token=b"guessed")
    stranger.mark_active()
    _contribute(stranger, 0)  # it decides [2] under its own token: nobody applies that
    assert set(m0._headers(0)) == set()  # noqa: SLF001 - the protocol's own view
    with pytest.raises(elastic.ServiceLost, match="not signed with this run's token"):
        _contribute(m0, 0)


HAND_WRITTEN = """
import sys
from lpdec.elastic import _runtime
client = _runtime.jax_runtime().get_distributed_runtime_client(
    sys.argv[1], int(sys.argv[2]), init_timeout=3, heartbeat_timeout=3,
    shutdown_on_destruction=False)
client.connect()
print("REGISTERED", flush=True)
"""


def _hand_written_client(address: str, slot: int) -> subprocess.CompletedProcess:
    """jaxlib's own client pointed straight at the run's address, skipping the gate
    (in a process of its own: jaxlib ends the process whose registration fails)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    return subprocess.run(
        [sys.executable, "-c", HAND_WRITTEN, address, str(slot)],
        capture_output=True, text=True, timeout=120, cwd=root,
        env=dict(os.environ, PYTHONPATH=str(root)),
    )  # fmt: skip


def test_a_stranger_claiming_a_live_slot_is_refused_at_the_gate_and_changes_nothing():
    """jax's service, in this process, behind its gate; three machines registered. On
    live slot 2: a wrong token, no token and jaxlib's own client skipping the gate.
    Without the gate each would register slot 2 again, and the service would end the
    live machine's incarnation; here each is refused before it registers, and slot 2
    keeps its incarnation and its rounds."""
    from bench import harness  # noqa: PLC0415

    address = f"127.0.0.1:{harness.free_port()}"
    service = elastic.start(address, 3, token=TOKEN, heartbeat_timeout=2)
    groups: dict[int, elastic.ElasticGroup] = {}

    def connect(m: int, token: bytes = TOKEN) -> elastic.ElasticGroup:
        group = elastic.ElasticGroup(
            address, m, 3, token, "fp", heartbeat_timeout=2, connect_timeout=20, poll_s=0.01
        )
        group.connect()
        return group

    threads = [
        threading.Thread(target=lambda m=m: groups.__setitem__(m, connect(m))) for m in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert sorted(groups) == [0, 1, 2]
        for group in groups.values():
            group.mark_active()
        live = groups[0].live()
        for token in (b"guessed", b""):
            with pytest.raises(elastic.GateRefused) as refused:
                connect(2, token)
            assert "refused machine 2: wrong or missing token" in str(refused.value)
            assert "\n" not in str(refused.value)
        ended = _hand_written_client(address, 2)
        assert "REGISTERED" not in ended.stdout and ended.returncode != 0
        assert "RegisterTask" in ended.stderr, ended.stderr[-2000:]  # its registration failed
        time.sleep(3)  # past the heartbeat timeout: a displaced machine would be gone
        assert groups[0].live() == live and not any(g.lost() for g in groups.values())
        # The next round is over all three, slot 2 included, decided on "all".
        seen: dict[int, elastic.Exchange] = {}
        rounds = [
            threading.Thread(
                target=lambda g=g: seen.__setitem__(g.machine, _contribute(g, 0, 20.0))
            )
            for g in groups.values()
        ]
        for thread in rounds:
            thread.start()
        for thread in rounds:
            thread.join(timeout=30)
        assert {m: (e.members, e.included, e.reason) for m, e in seen.items()} == {
            m: ((0, 1, 2), True, "all") for m in range(3)
        }
        # The run's end, said at the gate by a machine with the token, once.
        groups[0].finish(0)
        groups[0].close()
        assert service.finished is not None and service.finished[:2] == (0, 0)
        assert service.gate.refused == 2  # the hand-written client never got a reply
    finally:
        for group in groups.values():
            group.close()
        service.shutdown()


def test_a_machine_two_rounds_behind_or_past_the_end_is_told_to_join():
    service, (m0, m1) = _run(2)
    for round_ in range(3):
        _contribute(m0, round_)  # deadline 0: machine 0 decides each round alone
    with pytest.raises(elastic.Behind, match="decided round 2: it must join again"):
        _contribute(m1, 0)
    m0.finish(2)
    with pytest.raises(elastic.Behind, match="the run ended after round 2"):
        _contribute(m1, 3)


def test_a_join_at_the_end_of_a_run_gets_the_final_state_and_a_wrong_token_nothing():
    service, (m0, m1) = _run(2)
    _contribute(m0, 0)
    m0.finish(0)
    answers: dict[str, object] = {}

    def ask(name, group):
        try:
            answers[name] = group.join("model", timeout=5.0)
        except elastic.JoinRefused as error:
            answers[name] = str(error)

    asking = threading.Thread(target=ask, args=("m1", m1))
    asking.start()
    while "join/1" not in service.keys:
        threading.Event().wait(0.001)
    lines = m0.serve_joins(1, "model", lambda: b"final state")
    asking.join(timeout=5)
    assert lines == ["machine 1 joins at round 1 (11 bytes of state)"]
    assert answers["m1"] == (1, b"final state")
    # A process with a wrong token asks for slot 1's state: refused in one line, and
    # the slot's trainer (machine 1, active under its incarnation) is left alone.
    active_before = dict(service.keys)
    stranger = _group(service, 1, token=b"wrong")
    asking = threading.Thread(target=ask, args=("stranger", stranger))
    asking.start()
    while "join/1" not in service.keys:
        threading.Event().wait(0.001)
    (line,) = m0.serve_joins(1, "model", lambda: b"final state")
    asking.join(timeout=5)
    assert line == "refused machine 1's join: wrong or missing token"
    assert answers["stranger"] == "join refused by machine 0: wrong or missing token"
    assert service.keys.get("active/1") == active_before.get("active/1")


def test_a_write_the_service_refuses_is_service_lost():
    service, (m0, _, _) = _run()
    service.hold("r0/c/0")
    with pytest.raises(elastic.ServiceLost, match="refused"):
        _contribute(m0, 0)
    service.kill(0)
    assert m0.lost()


def test_resume_collects_every_live_machines_signed_round_and_ignores_forged_ones():
    """On a fresh service each machine posts the round of its saved state: `resume`
    returns once every live machine's record is in (or at its timeout), and a record
    not signed with the run's token does not count."""
    service, (m0, m1, m2) = _run()
    stranger = _group(service, 2, token=b"guessed")
    stranger.resume(99, "forged", timeout=0.0)  # the slot's record, forged: ignored
    m1.store.put("resume/1", b"not json")
    assert m0.resume(7, "d7", timeout=0.0) == {0: (7, "d7")}  # timed out: only its own
    assert m1.resume(7, "d7", timeout=0.0) == {0: (7, "d7"), 1: (7, "d7")}
    # The last live machine's record completes the set: no waiting for the timeout.
    started = time.monotonic()
    assert m2.resume(6, "d6", timeout=30.0) == {0: (7, "d7"), 1: (7, "d7"), 2: (6, "d6")}
    assert time.monotonic() - started < 5


def test_a_machine_decides_at_its_deadline_not_at_its_next_look():
    """The wait for the decision blocks in the service between looks (up to 0.25 s, or
    20 polls); it must still end at the exchange's deadline when a machine is silent."""
    service, (m0, _) = _run(2)
    m0.poll_s = 0.05  # 20 polls: 1 s, longer than the deadline
    exchange = _contribute(m0, 0, deadline=0.1)
    assert exchange.reason == "deadline" and exchange.members == (0,)
    assert 0.1 <= exchange.waited_s < 0.18, exchange.waited_s


def test_a_machine_the_run_left_behind_while_it_waited_joins_instead_of_deciding_alone():
    """Machine 1 passes the check at the start of round 1, then (while it writes its
    header) machine 0 decides rounds 1-3 alone and removes round 1's records. At its
    deadline machine 1 must not decide a round of its own: it is told to join."""
    service, (m0, m1) = _run(2)
    _contribute(m0, 0)

    def others_move_on(machine, key):
        if machine == 1 and key == "r1/c/1":
            service.before_put = None
            for round_ in (1, 2, 3):
                _contribute(m0, round_)

    service.before_put = others_move_on
    with pytest.raises(elastic.Behind):
        _contribute(m1, 1, deadline=0.05)
    assert service.before_put is None  # the race ran


def test_a_machine_the_run_left_behind_as_it_decided_does_not_apply_its_own_decision():
    """Machine 1 passes the last check before writing its decision of round 1 (its
    deadline came with only its own header), and before the write lands machine 0
    decides rounds 1-3 and removes round 1's records, the decision with them. Machine
    1's create-only write then succeeds: a decision of one member that no other machine
    applied. Reading it back, machine 1 must see that the run moved on and join."""
    service, (m0, m1) = _run(2)
    _contribute(m0, 0)

    def others_move_on(machine, key):
        if machine == 1 and key == "r1/d":
            service.before_put = None
            for round_ in (1, 2, 3):
                _contribute(m0, round_)
            assert "r1/d" not in service.keys  # removed with round 1's records

    service.before_put = others_move_on
    with pytest.raises(elastic.Behind):
        _contribute(m1, 1, deadline=0.0)
    assert service.before_put is None  # the race ran


def test_a_machine_a_round_behind_applies_the_round_and_leaves_the_newest_round_marked():
    """Machine 0 decides rounds 0 and 1 alone; machine 1, a round behind, contributes to
    round 0 late: it is not told to join, applies round 0's decision (without its
    contribution), and "latest" still names round 1 for the machines that check it."""
    service, (m0, m1) = _run(2)
    _contribute(m0, 0)
    _contribute(m0, 1)
    seen = _contribute(m1, 0)
    assert seen.members == (0,) and not seen.included
    assert m1.latest_round() == 1
