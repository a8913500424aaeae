"""The elastic machine's command-line flags, one group (`train.py --elastic_service=...`).

`train.py` imports this module for its side effect: the flags below are defined
on absl's global FLAGS, next to the run's `--config`. The elastic run's training
settings (how its rounds weigh, how long it lasts, its data, its transport) are
config fields (`configs/default.py`, `config.elastic_*`), checked with every other
field (`train_lib.setup.check_values`); these flags are what differs between the
machines of one run (the slot, the token, the addresses) and their timeouts.

Fault tests pace the rounds through the environment, not the command line
(`PACE_ENV`, read by `pace`): no user run wants a slowed-down machine.
"""

from __future__ import annotations

import os

from absl import flags

from train_lib.errors import ConfigError

#: Fault tests' pacing (bench/faults, tests/test_elastic.py): "slowdown=S" makes each
#: round's local steps take S times as long, "min_round_s=T" at least T seconds; both
#: may be given, comma-separated.
PACE_ENV = "LPDEC_ELASTIC_PACE"

flags.DEFINE_string(
    "elastic_service",
    None,
    "Elastic DiLoCo (issue 27): host:port of the run's coordinating service "
    "(`python -m lpdec.elastic serve`); this process is one machine of the run.",
)
flags.DEFINE_integer("elastic_machine", None, "Elastic: this machine's slot, 0 .. machines-1.")
flags.DEFINE_integer("elastic_machines", None, "Elastic: the run's machine slots.")
flags.DEFINE_string(
    "elastic_token_file",
    None,
    "Elastic: a file holding the run's secret (or set LPDEC_ELASTIC_TOKEN); never logged.",
)
flags.DEFINE_string(
    "elastic_credentials",
    None,
    "Elastic: the run's credentials directory (`python -m lpdec.elastic credentials DIR`): "
    "this machine's certificate and the run's CA, for mutual TLS with the service.",
)
flags.DEFINE_bool(
    "elastic_private_network",
    False,
    "Elastic: the service is off loopback without credentials, and only the run's machines "
    "reach it (else such a run is refused).",
)
flags.DEFINE_string(
    "elastic_peer_address",
    None,
    "Elastic, config.elastic_transport='peers': the host[:port] this machine listens on "
    "for the other machines' bytes, an address they reach (default on loopback: 127.0.0.1).",
)
flags.DEFINE_integer(
    "elastic_local_steps", 0, "Elastic: this machine's local steps per round (0: config's)."
)
flags.DEFINE_float("elastic_deadline", 60, "Elastic: seconds an exchange waits for late machines.")
flags.DEFINE_float(
    "elastic_join_timeout",
    600,
    "Elastic: seconds to wait for a live machine's answer to a join (or to reconnect).",
)
flags.DEFINE_integer(
    "elastic_heartbeat_timeout",
    10,
    "Elastic: seconds without a heartbeat before a machine counts as lost (as the service's).",
)
flags.DEFINE_integer(
    "elastic_connect_timeout",
    300,
    "Elastic: seconds to wait for the service (a new run: for every machine to register).",
)
flags.DEFINE_integer(
    "elastic_restarts",
    5,
    "Elastic: run the machine as a child process and restart it (to rejoin) up to this many "
    "times when it ends abnormally, e.g. after its link was down; 0: no supervisor.",
)
flags.DEFINE_bool("elastic_child", False, "Elastic, internal: this is the supervised child.")


def pace() -> tuple[float, float]:
    """(slowdown, min_round_s) from `PACE_ENV` ((1.0, 0.0) when unset); one-line error."""
    text = os.environ.get(PACE_ENV, "").strip()
    values = {"slowdown": 1.0, "min_round_s": 0.0}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        try:
            if name not in values:
                raise ValueError(f"unknown setting {name!r}")
            values[name] = float(value)
        except ValueError as error:
            raise ConfigError(
                f"{PACE_ENV}={text!r}: {error} (expected slowdown=S,min_round_s=T)"
            ) from None
    if not values["slowdown"] >= 1 or not values["min_round_s"] >= 0:
        raise ConfigError(f"{PACE_ENV}={text!r}: slowdown must be >= 1, min_round_s >= 0.")
    return values["slowdown"], values["min_round_s"]
