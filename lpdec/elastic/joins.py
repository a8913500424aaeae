"""Joining a run in progress: a signed request, answered after an exchange.

A machine that starts while the run goes on (or that lost the service and
reconnected) posts a signed request under `join/<m>` (`request`); after each
exchange the lowest-numbered machine of the decision answers every pending
request (`serve`) under `reply/<m>/<nonce>` with the state to start the next
round from (the caller's bytes: anchor, outer optimizer state, round), signed,
or with a refusal naming the reason; both sides log one line.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from lpdec.elastic.signing import digest

if TYPE_CHECKING:
    from lpdec.elastic.group import ElasticGroup


class JoinRefused(RuntimeError):
    """A live machine refused this machine's join (its message says why)."""


def request(group: ElasticGroup, model: str, timeout: float) -> tuple[int, bytes]:
    """Asks a live machine for the state to start from; returns (round, state).

    `model` is the model's signature (a join with another model is refused).
    The answer comes after the next exchange of the machines that train.

    Raises:
      JoinRefused: a live machine refused (wrong or missing token, another
        config or model), or nobody answered within `timeout` seconds.
      ServiceLost: the service went away.
    """
    # Not a trainer while it waits: its new incarnation is not the one under which
    # its slot is marked active (if at all), so no exchange waits for it. It does
    # not remove the mark: a process without the token must not be able to.
    nonce = secrets.token_hex(8)
    asked = {
        "machine": group.machine,
        "incarnation": group.incarnation,
        "nonce": nonce,
        "fingerprint": group.fingerprint,
        "model": model,
    }
    asked["mac"] = group.signer.sign("j", *(asked[k] for k in sorted(asked)))
    group.store.put(f"join/{group.machine}", json.dumps(asked).encode())
    waited = 0.0
    while True:
        group.check_lost()
        reply = group.store.get(f"reply/{group.machine}/{nonce}")
        if reply is not None:
            break
        if waited >= timeout:
            group.store.delete(f"join/{group.machine}")
            raise JoinRefused(
                f"no live machine answered machine {group.machine}'s join within "
                f"{timeout:g} s (is the run still going?)"
            )
        time.sleep(group.poll_s)
        waited += group.poll_s
    group.store.delete(f"reply/{group.machine}/{nonce}")
    size = int.from_bytes(reply[:4], "little")
    header, state = json.loads(reply[4 : 4 + size]), reply[4 + size :]
    if "refused" in header:
        raise JoinRefused(f"join refused by machine {header['by']}: {header['refused']}")
    if not group.signer.verify(header.get("mac"), "s", group.machine, nonce, header["round"]) or (
        digest(state) != header.get("digest")
    ):
        raise JoinRefused(
            f"the state machine {header.get('by')} sent does not verify under this machine's token"
        )
    return int(header["round"]), state


def serve(group: ElasticGroup, round_: int, model: str, state: Callable[[], bytes]) -> list[str]:
    """Answers pending join requests with `state()` to start round `round_` from.

    Call it after an exchange, on the lowest machine of the decision. Returns
    one log line per request answered (accepted or refused, and why).
    """
    lines, blob = [], None
    for name, raw in group.store.dir("join").items():
        try:
            request = json.loads(raw)
            machine, nonce = int(request["machine"]), str(request["nonce"])
        except (ValueError, KeyError, TypeError):
            group.store.delete(f"join/{name}")
            continue
        fields = (request.get(k) for k in sorted(request) if k != "mac")
        if not group.signer.verify(request.get("mac"), "j", *fields):
            refused = "wrong or missing token"
        elif request.get("fingerprint") != group.fingerprint:
            refused = "its config differs from the run's (fingerprint mismatch)"
        elif request.get("model") != model:
            refused = "its model differs from the run's (parameter shapes differ)"
        else:
            refused = None
        if refused:
            header = {"refused": refused, "by": group.machine}
            body = b""
            lines.append(f"refused machine {machine}'s join: {refused}")
        else:
            blob = state() if blob is None else blob
            header = {
                "by": group.machine,
                "round": round_,
                "digest": digest(blob),
                "mac": group.signer.sign("s", machine, nonce, round_),
            }
            body = blob
            # A trainer from the round it starts: the next exchange waits for it
            # (up to its deadline) instead of deciding rounds while it starts up.
            group.store.put(f"active/{machine}", str(request.get("incarnation")).encode())
            lines.append(f"machine {machine} joins at round {round_} ({len(blob)} bytes of state)")
        raw_header = json.dumps(header).encode()
        group.store.put(
            f"reply/{machine}/{nonce}",
            len(raw_header).to_bytes(4, "little") + raw_header + body,
        )
        group.store.delete(f"join/{name}")
    return lines
