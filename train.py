r"""Low-precision decentralized training with lpdec, in the style of the flax examples.

    python train.py --config=configs/quickstart.py --workdir=/tmp/lpdec_quickstart
    python train.py --config=configs/quickstart.py --workdir=/tmp/q --config.algorithm=dcd

This file is intentionally kept short: the flags, then `main()`, which starts
multi-host JAX when asked (`--coordinator_address`, `--num_processes`,
`--process_id`), logs the devices and calls `train_and_evaluate(config, workdir)`
(`train_lib.loop`). That does the work: per-node non-IID partitions of an
offline data set, the model (fp32 or 8-bit), the optimizer chain (a local
optimizer and an lpdec algorithm), the steps on every node (`lpdec.layout`: one
node per device, or several simulated nodes per device), metrics (a line on stderr,
`metrics.csv`, TensorBoard event files), orbax checkpoints that a restarted run
resumes from exactly, and `summary.json`.

An elastic machine's flags (`--elastic_service=HOST:PORT` and the rest of the
group, `train_lib/elastic_flags.py`) are listed by `--helpfull`.

The config becomes objects in one place, `train_lib.setup.build` (names are
looked up in `train_lib.registry`); the command line's details (a bad flag in
one line, `--help` listing the config's fields, the exit statuses) are in
`train_lib.cli`.
"""

from __future__ import annotations

from absl import app
from absl import flags
from ml_collections import config_flags

from train_lib import cli
from train_lib import elastic_flags  # noqa: F401 - defines the --elastic_* flag group
from train_lib import watchdog
from train_lib.cli import EXIT_BAD_INPUT
from train_lib.cli import EXIT_DIVERGED
from train_lib.cli import EXIT_PEER_LOST
from train_lib.errors import RunError

# What tests and scripts use of this file besides the command line.
__all__ = ["EXIT_BAD_INPUT", "EXIT_DIVERGED", "EXIT_PEER_LOST", "main", "train_and_evaluate"]

FLAGS = flags.FLAGS


flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and summary.json.")
config_flags.DEFINE_config_file("config", None, "Training configuration file.", lock_config=True)
flags.DEFINE_string("coordinator_address", None, "Multi-host: address:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-host: number of processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: index of this process.")
flags.DEFINE_string(
    "coordinator_bind_address",
    None,
    "Multi-host: where process 0's coordinator listens (default: the host of "
    "--coordinator_address, so a loopback address stays on loopback; never all interfaces).",
)
flags.DEFINE_integer(
    "peer_timeout", 300, "Multi-host: seconds to wait for every process to connect, then exit 2."
)
flags.DEFINE_integer(
    "heartbeat_timeout",
    20,
    "Multi-host: seconds without a heartbeat after which a connected process counts as lost "
    "(a killed process is noticed at once), then exit 4.",
)
flags.DEFINE_float(
    "stop_timeout",
    10,
    "Seconds after SIGTERM/SIGINT by which the run exits even if it has not reached a step "
    "boundary (a checkpoint still being written is then abandoned).",
)


def train_and_evaluate(config, workdir, **kwargs):
    """`train_lib.loop.train_and_evaluate`, imported at the first call: the flags, the
    multi-process handshake and an elastic machine's supervisor run without jax, so a
    refused start or a bad flag costs no jax import (seconds)."""
    from train_lib import loop  # noqa: PLC0415 - the docstring says why

    return loop.train_and_evaluate(config, workdir, **kwargs)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    cli.quiet_orbax()
    if FLAGS.elastic_service:
        cli.run_elastic(FLAGS)
        return
    peers = cli.start_processes(FLAGS)
    # After jax.distributed.initialize, whose preemption service takes SIGTERM.
    stop = watchdog.StopSignals(FLAGS.stop_timeout, peers).install()
    cli.log_devices()
    try:
        summary = train_and_evaluate(FLAGS.config, FLAGS.workdir, stop=stop)
    except RunError as error:
        cli.exit_for_error(error, peers)
    # Exit 0, or 3 (diverged), or 128 + the signal that stopped the run.
    cli.exit_for_summary(summary, peers)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main, flags_parser=cli.parse_flags)
