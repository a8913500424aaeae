"""lpdec.elastic.peers: the peer-to-peer reduce-scatter / all-gather of an elastic round.

Machines are threads of this process on loopback; the reference is numpy's mean of
the members' vectors (float64), cut and joined independently of the code under test.
"""

import pathlib
import socket
import threading

import numpy as np
import pytest

from lpdec.elastic import peers as p2p

TOKEN = b"the run's token"


def _round(machines, vectors, members, round_=0, timeout=20.0, stranger=None):
    """Each member's result: the mean of the members' vectors, through the peers."""
    addresses = {m: machines[m].address for m in members}
    size = vectors[members[0]].size
    cuts = p2p.split(size, len(members), align=4)

    def reduce(chunk, parts):
        return np.mean([np.frombuffer(p, np.float64) for p in parts], axis=0).tobytes()

    out, errors = {}, []

    def run(m):
        try:
            parts = [vectors[m][a:b].tobytes() for a, b in cuts]
            chunks = p2p.reduce_scatter_gather(
                machines[m], round_, members, addresses, parts, reduce, timeout
            )
            out[m] = np.concatenate([np.frombuffer(c, np.float64) for c in chunks])
        except Exception as error:  # noqa: BLE001 - the test reports it
            errors.append(error)

    if stranger is not None:
        stranger(addresses)
    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.fixture
def machines():
    made = {m: p2p.Peers(m, TOKEN) for m in range(5)}
    yield made
    for peer in made.values():
        peer.close()


def test_split_cuts_near_equal_aligned_chunks_that_cover_the_range():
    assert p2p.split(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert p2p.split(10, 3, align=4) == [(0, 4), (4, 8), (8, 10)]
    assert p2p.split(3, 5) == [(0, 0), (0, 1), (1, 1), (1, 2), (2, 3)]


def test_every_member_ends_with_the_members_mean(machines):
    rng = np.random.default_rng(0)
    vectors = {m: rng.normal(size=1001) for m in machines}
    for members in ([0, 1, 2, 3, 4], [1, 3, 4], [2]):
        out = _round(machines, vectors, members, round_=len(members))
        expected = np.mean([vectors[m] for m in members], axis=0)
        for m in members:
            np.testing.assert_allclose(out[m], expected, rtol=1e-12)
        assert len({out[m].tobytes() for m in members}) == 1  # the same bytes everywhere


def _forge(address, head, body):
    """Writes one message's bytes on a fresh connection; True if the receiver took it
    (acknowledged it), False if it closed the connection unanswered."""
    with socket.create_connection(address.rsplit(":", 1), timeout=10) as connection:
        try:
            connection.sendall(head + body)
            return connection.recv(1) != b""
        except ConnectionError:
            return False


def test_a_stranger_without_the_token_changes_nothing(machines):
    """Every message the members of round 7 will wait for (each part and each mean, from
    the very slot each is expected from) is forged first, under a guessed token: each is
    refused at its header (no acknowledgement, one rejection each), none is in an inbox,
    and the round's result is the members' mean."""
    rng = np.random.default_rng(1)
    vectors = {m: rng.normal(size=64) for m in machines}
    members = [0, 1, 2]
    strangers = {m: p2p.Peers(m, b"a guessed token") for m in members}
    try:
        forged = []  # (receiver, kind, chunk, claimed sender)
        for receiver in members:
            for sender in members:
                if sender != receiver:  # the receiver's chunk's part; the sender's chunk's mean
                    forged += [
                        (receiver, "part", receiver, sender),
                        (receiver, "mean", sender, sender),
                    ]
        assert len(forged) == 12
        for receiver, kind, chunk, sender in forged:
            body = np.ones(22).tobytes()
            head = strangers[sender].frame(7, kind, chunk, body)
            taken = _forge(machines[receiver].address, head, body)
            assert not taken, f"machine {receiver} took a forged {kind} {chunk} from {sender}"
        for receiver, kind, chunk, sender in forged:  # nothing of them waits in an inbox
            with pytest.raises(p2p.PeerTimeout):
                machines[receiver].wait(7, kind, chunk, [sender], timeout=0.01)
        assert [machines[m].rejected for m in members] == [4, 4, 4]
        out = _round(machines, vectors, members, round_=7)
    finally:
        for stranger in strangers.values():
            stranger.close()
    expected = np.mean([vectors[m] for m in members], axis=0)
    for m in members:
        np.testing.assert_allclose(out[m], expected, rtol=1e-12)
    assert [machines[m].rejected for m in members] == [4, 4, 4]


def test_the_inbox_keeps_a_senders_newest_rounds_within_its_share():
    """What a machine with the token sends and nobody takes stays bounded: at most
    INBOX_MESSAGES (8) messages and 2 max_message_bytes a sender, the oldest rounds
    dropped first (then the newcomer, if it is the oldest); a forgotten round's message
    is dropped; a length beyond max_message_bytes or a slot outside the run is refused
    at the header (no acknowledgement: the sender's one attempt fails)."""
    limits = {"machines": 2, "max_message_bytes": 1000}
    receiver, other = p2p.Peers(0, TOKEN, **limits), p2p.Peers(0, TOKEN, **limits)
    sender = p2p.Peers(1, TOKEN, machines=2, max_message_bytes=5000)
    stranger_slot = p2p.Peers(5, TOKEN)
    try:
        for r in range(12):
            sender.send(receiver.address, r, "part", 0, bytes([r]) * 100)
        assert receiver.inbox() == (8, 800) and receiver.dropped == 4
        sender.send(receiver.address, 2, "part", 0, b"late")  # older than all 8: dropped
        assert receiver.inbox() == (8, 800) and receiver.dropped == 5
        for r in range(4):
            with pytest.raises(p2p.PeerTimeout):
                receiver.wait(r, "part", 0, [1], timeout=0.01)
        for r in range(4, 12):
            assert receiver.wait(r, "part", 0, [1], timeout=1.0) == {1: bytes([r]) * 100}

        for r in range(3):  # 900 bytes each: two fit in 2 x 1000
            sender.send(other.address, r, "part", 0, bytes([r]) * 900)
        assert other.inbox() == (2, 1800) and other.dropped == 1
        assert other.wait(2, "part", 0, [1], timeout=1.0) == {1: bytes([2]) * 900}
        other.forget(30)
        sender.send(other.address, 29, "part", 0, b"x")
        assert other.inbox() == (0, 0) and other.dropped == 3  # round 1 forgotten, 29 too

        assert receiver.rejected == 0
        with pytest.raises(OSError):
            sender.send(receiver.address, 40, "part", 0, bytes(1001), timeout=0)
        with pytest.raises(OSError):
            stranger_slot.send(receiver.address, 40, "part", 0, b"x", timeout=0)
        assert receiver.rejected == 2 and receiver.inbox() == (0, 0)
    finally:
        for peer in (receiver, other, sender, stranger_slot):
            peer.close()


def test_a_member_that_never_sends_times_out_naming_it(machines):
    vectors = {m: np.zeros(8) for m in machines}
    peer = machines[0]
    with pytest.raises(p2p.PeerTimeout, match=r"from machine\(s\) \[1\]"):
        p2p.reduce_scatter_gather(
            peer, 0, [0, 1], {0: peer.address, 1: machines[1].address},
            [vectors[0][:4].tobytes(), vectors[0][4:].tobytes()],
            lambda chunk, parts: parts[0], timeout=0.5,
        )  # fmt: skip


def test_with_the_runs_credentials_a_peer_without_them_cannot_connect(tmp_path):
    pytest.importorskip("cryptography")
    from lpdec.elastic import credentials

    credentials.make(str(tmp_path / "run"), machines=2)
    credentials.make(str(tmp_path / "other"), machines=2)
    run = str(tmp_path / "run")
    ours = [p2p.Peers(m, TOKEN, credentials=credentials.load(run, m)) for m in (0, 1)]
    foreign = p2p.Peers(0, TOKEN, credentials=credentials.load(str(tmp_path / "other"), 0))
    # The run's own CA, but the service's certificate: no machine of the run.
    service = p2p.Peers(0, TOKEN, credentials=credentials.load(str(tmp_path / "run"), "service"))
    plain = p2p.Peers(0, TOKEN)
    try:
        vectors = {0: np.arange(10.0), 1: np.arange(10.0) * 3}
        out = _round(dict(enumerate(ours)), vectors, [0, 1])
        np.testing.assert_allclose(out[1], np.arange(10.0) * 2)
        # Another run's certificate, the service's, or none at all: no message gets in
        # (TLS 1.3 refuses a client's certificate after the client's first write, so the
        # intruder's send may or may not fail on its side; the receiver is what counts).
        for intruder in (foreign, service, plain):
            try:
                intruder.send(ours[1].address, 1, "part", 1, np.ones(5).tobytes(), timeout=0)
            except OSError:
                pass
        with pytest.raises(p2p.PeerTimeout):
            ours[1].wait(1, "part", 1, [0], timeout=1.0)
        assert ours[1].rejected == 3  # each connection refused at the handshake
    finally:
        for peer in (*ours, foreign, service, plain):
            peer.close()


def test_all_gather_hands_every_member_every_payload_in_member_order(machines):
    members = [0, 2, 3]
    payloads = {m: bytes([m]) * (100 + m) for m in members}
    addresses = {m: machines[m].address for m in members}
    out, threads = {}, []
    for m in members:

        def run(m=m):
            out[m] = p2p.all_gather(machines[m], 5, members, addresses, payloads[m], 20.0)

        threads.append(threading.Thread(target=run))
        threads[-1].start()
    for t in threads:
        t.join()
    for m in members:
        assert out[m] == [payloads[k] for k in members]


# -- train_lib.elastic_peers: a round of the trainer's peer-to-peer exchange ----------


def _exchangers(n, compressor=None, rounds=2):
    """n machines' PeerExchange on an in-process service (default: the float32 mean,
    reduce-scatter + all-gather)."""
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
    import lpdec
    from lpdec import elastic
    from train_lib import elastic_peers

    service = elastic.MemoryService(n)
    like = {"a": np.zeros((3, 5000), np.float32), "b": np.zeros(7, np.float32)}
    out = []
    for m in range(n):
        group = elastic.ElasticGroup(
            "127.0.0.1:1", m, n, TOKEN, "f", store=service.store(m), poll_s=0.01
        )
        group.connect()
        group.mark_active()
        out.append(
            elastic_peers.PeerExchange(
                group, p2p.Peers(m, TOKEN), like, compressor or lpdec.identity(),
                compressor is not None, rounds, elastic.step_weighted_mean,
            )
        )  # fmt: skip
    return out, like


def _rounds(exchangers, deltas, steps, deadline=20.0, residuals=None):
    """One round of every exchanger at once (`residuals`: each machine's incoming error
    feedback, or None: no feedback)."""
    import jax

    from lpdec import elastic

    out, threads = {}, []
    for m, ex in enumerate(exchangers):

        def run(m=m, ex=ex):
            out[m] = ex.round(
                0, deltas[m], residuals and residuals[m], residuals is not None, steps[m],
                jax.random.key(0),
                "anchor", deadline,
                # The one-round exchange's whole payload: here the float32 tree itself.
                whole_payload=lambda m=m: (elastic.pack(deltas[m]), residuals and residuals[m]),
                decode_whole=lambda blob, sender: elastic.unpack(blob, deltas[0]),
            )  # fmt: skip

        threads.append(threading.Thread(target=run))
        threads[-1].start()
    for t in threads:
        t.join()
    return out


def test_the_trainers_round_is_the_step_weighted_mean_of_the_finite_members():
    exchangers, like = _exchangers(3)
    rng = np.random.default_rng(3)
    deltas = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in like.items()} for _ in range(3)
    ]
    deltas[2]["b"][0] = np.nan  # machine 2's local steps went non-finite: left out
    try:
        out = _rounds(exchangers, deltas, steps=[10, 30, 20])
    finally:
        for ex in exchangers:
            ex.peers.close()
    for k in like:  # float64: (10 d0 + 30 d1) / 40, independently of the code
        expected = (10 * deltas[0][k].astype(np.float64) + 30 * deltas[1][k]) / 40
        for m in range(3):
            np.testing.assert_allclose(out[m].mean[k], expected, rtol=1e-5, atol=1e-6)
            assert out[m].mean[k].tobytes() == out[0].mean[k].tobytes()
    assert all(r.nonfinite == 1 and not r.void for r in out.values())


def test_a_member_that_sends_nothing_after_the_decision_voids_the_round():
    exchangers, like = _exchangers(2)
    silent = exchangers[1]
    try:
        # Machine 1 posts its header (so it is in the decision) and then dies.
        threading.Thread(
            target=silent.group.decide, args=(0, 10, "anchor", 20.0, silent.peers.address)
        ).start()
        delta = {k: np.ones(v.shape, np.float32) for k, v in like.items()}
        out = _rounds(exchangers[:1], [delta], [10], deadline=1.0)
    finally:
        for ex in exchangers:
            ex.peers.close()
    assert out[0].mean is None and "from machine(s) [1]" in out[0].void
    assert out[0].exchange.members == (0, 1)


def test_the_one_round_exchange_gathers_every_members_whole_payload():
    exchangers, like = _exchangers(3, rounds=1)
    rng = np.random.default_rng(4)
    deltas = [
        {k: rng.normal(size=v.shape).astype(np.float32) for k, v in like.items()} for _ in range(3)
    ]
    try:
        out = _rounds(exchangers, deltas, steps=[1, 1, 2])
    finally:
        for ex in exchangers:
            ex.peers.close()
    for k in like:
        expected = (deltas[0][k].astype(np.float64) + deltas[1][k] + 2 * deltas[2][k]) / 4
        for m in range(3):
            np.testing.assert_allclose(out[m].mean[k], expected, rtol=1e-5, atol=1e-6)
    assert out[0].sent == 2 * len(__import__("lpdec").elastic.pack(deltas[0]))


def _minmax4(x):
    """numpy's 4-bit min-max rounding to nearest, blocks of 4096 from x's start, and where
    x sits on a tie (half a step from two codes: float32's last bit decides, which this
    reference does not copy from the codec) the other code's value; elsewhere NaN."""
    out, other = np.empty_like(x), np.full_like(x, np.nan)
    for a in range(0, x.size, 4096):
        block = x[a : a + 4096]
        lo, hi = block.min(), block.max()
        u = (hi - lo) / np.float32(15)
        t = (block.astype(np.float64) - lo) / (np.float64(hi) - lo) * 15
        out[a : a + 4096] = lo + np.clip(np.rint(t), 0, 15) * u
        tie = np.abs(t - np.floor(t) - 0.5) < 1e-4
        flipped = np.where(np.rint(t) > t, np.floor(t), np.ceil(t))
        other[a : a + 4096] = np.where(tie, lo + flipped * u, np.nan)
    return out, other


def test_the_compressed_two_round_mean_is_the_mean_of_the_encoded_parts_encoded_again():
    """4-bit min-max (blocks of 4096) on two machines, each with error feedback coming in.

    The reference, in numpy: machine m sends v_m = its delta + its residual, cut in two
    chunks at a multiple of 4096 (15,007 values: [0, 8192) and [8192, 15007)), each
    chunk rounded to 4 bits; the owner averages the two rounded parts and rounds the
    mean again. The mean is that (on a tie of the second rounding, either code), and
    machine m's new residual is v_m minus its rounded v_m (what the first rounding lost),
    to float32's precision (1e-5 of values in [-1.1, 1.1]; a 4-bit step, what a wrong
    sign or a lost residual moves values by, is about 0.15)."""
    import lpdec

    exchangers, like = _exchangers(2, compressor=lpdec.minmax(4))
    rng = np.random.default_rng(5)

    def tree(scale):
        return {
            k: (scale * rng.uniform(-1, 1, v.shape)).astype(np.float32) for k, v in like.items()
        }

    deltas, residuals = [tree(1.0) for _ in range(2)], [tree(0.1) for _ in range(2)]
    try:
        out = _rounds(exchangers, deltas, steps=[1, 1], residuals=residuals)
    finally:
        for ex in exchangers:
            ex.peers.close()

    def flat(t):
        return np.concatenate([np.ravel(t["a"]), t["b"]])

    v = [flat(deltas[m]) + flat(residuals[m]) for m in range(2)]
    cuts = [(0, 8192), (8192, 15007)]
    sent = [np.concatenate([_minmax4(x[a:b])[0] for a, b in cuts]) for x in v]
    rounded = [_minmax4((sent[0][a:b] + sent[1][a:b]) / 2) for a, b in cuts]
    mean, other = (np.concatenate([r[i] for r in rounded]) for i in (0, 1))
    assert np.isnan(other).mean() > 0.99  # ties are rare: the reference decides the rest
    for m in range(2):
        got = flat(out[m].mean)
        near = np.abs(got - mean) <= 1e-5
        np.testing.assert_array_less(np.abs(got - other)[~near], 1e-5)  # NaN: not a tie
        np.testing.assert_allclose(flat(out[m].residual), v[m] - sent[m], rtol=0, atol=1e-5)
        assert all(out[m].mean[k].tobytes() == out[0].mean[k].tobytes() for k in like)
