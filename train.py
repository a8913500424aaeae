r"""Low-precision decentralized training with lpdec, in the style of the flax examples.

    python train.py --config=configs/quickstart.py --workdir=/tmp/lpdec_quickstart
    python train.py --config=configs/quickstart.py --workdir=/tmp/q --config.algorithm=dcd

`main()` parses the flags, starts multi-host JAX when asked
(`--coordinator_address`, `--num_processes`, `--process_id`), logs the devices
and calls `train_and_evaluate(config, workdir)`, which does the work: per-node
non-IID partitions of an offline data set, the model (fp32 or 8-bit), the
optimizer chain (a local optimizer and an lpdec algorithm), the steps on every
node (`lpdec.layout`: one node per device, or several simulated nodes per
device), metrics (stdout, `metrics.csv`, TensorBoard event files), orbax
checkpoints that a restarted run resumes from exactly, and `summary.json`.

The config becomes objects in one place, `train_lib.setup.build` (names are
looked up in `train_lib.registry`); the per-node programs are in
`train_lib.steps`, checkpoints in `train_lib.checkpoint`, metric files in
`train_lib.metrics`.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import signal
import sys

import jax
from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from train_lib import checkpoint
from train_lib import processes
from train_lib import watchdog
from train_lib.loop import train_and_evaluate
from train_lib.registry import RunError

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
    60,
    "Multi-host: seconds without a heartbeat after which a connected process counts as lost "
    "(a killed process is noticed at once), then exit 4.",
)
flags.DEFINE_float(
    "stop_timeout",
    10,
    "Seconds after SIGTERM/SIGINT by which the run exits even if it has not reached a step "
    "boundary (a checkpoint still being written is then abandoned).",
)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError("Too many command-line arguments.")
    # Orbax logs every checkpoint step at INFO through absl; keep lpdec's lines readable.
    logging.get_absl_handler().addFilter(lambda record: "orbax" not in record.pathname)
    peers = None
    try:
        processes.check_args(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
        if FLAGS.coordinator_address:
            peers = processes.start(
                FLAGS.coordinator_address,
                FLAGS.num_processes,
                FLAGS.process_id,
                {f"config.{k}": v for k, v in checkpoint.flatten_config(FLAGS.config).items()},
                bind=FLAGS.coordinator_bind_address,
                timeout_s=FLAGS.peer_timeout,
                heartbeat_timeout_s=FLAGS.heartbeat_timeout,
                peer_lost_status=EXIT_PEER_LOST,
            )
    except RunError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(EXIT_BAD_INPUT)
    # After jax.distributed.initialize, whose preemption service takes SIGTERM.
    stop = watchdog.StopSignals(FLAGS.stop_timeout, peers).install()
    logging.info(
        "process %d of %d; %d local / %d global devices: %s",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )
    try:
        summary = train_and_evaluate(FLAGS.config, FLAGS.workdir, stop=stop)
    except RunError as error:
        if peers is not None:
            peers.leave(error=str(error))
        sys.stderr.write(f"error: {error}\n")
        sys.exit(EXIT_BAD_INPUT)
    if peers is not None:
        peers.leave()
    if summary["diverged"]:
        sys.stderr.write(f"error: {summary['stopped']}\n")
        sys.exit(EXIT_DIVERGED)
    if summary["interrupted"]:
        sys.stderr.write(f"{summary['stopped']}\n")
        sys.exit(128 + signal.Signals[summary["interrupted"]])


# Exit statuses besides 0 (done, or halted by config.halt_after_steps).
EXIT_BAD_INPUT = 2  # a bad flag, config, workdir or checkpoint: one `error:` line on stderr
EXIT_DIVERGED = 3  # the loss diverged; summary.json says where
EXIT_PEER_LOST = 4  # another process of the run was lost: one `error:` line names it
# SIGTERM/SIGINT: 128 + the signal's number (143, 130), as the shell reports a death by it.


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad flag, config file or override reported in one line.

    The config file is loaded here (absl loads it lazily, at first use), so a
    missing file or a typo in `--config.FIELD` stops the run before anything
    starts, naming the flag and, for a typo, the closest field.
    """
    try:
        rest = FLAGS(argv)
        FLAGS.config.keys()  # loads the file and applies the overrides now
        return rest
    except SystemExit:
        if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
            _print_config_fields(argv)
        raise
    except Exception as error:  # noqa: BLE001 - ml_collections raises many types
        sys.stderr.write(f"error: {_explain_flag_error(argv, error)}\n")
        sys.exit(EXIT_BAD_INPUT)


def _explain_flag_error(argv: list[str], error: Exception) -> str:
    path = _config_path(argv)
    if path and not os.path.isfile(path):
        return f"--config={path}: no such file; expected a config file such as configs/default.py"
    config = _load_config_quietly(argv)
    if config is not None:
        fields = sorted(_field_names(config.to_dict()))
        for arg in argv[1:]:
            if not arg.startswith("--config."):
                continue
            name = arg[len("--config.") :].split("=", 1)[0]
            if name not in fields:
                close = difflib.get_close_matches(name, fields, n=1, cutoff=0.6)
                hint = f"; did you mean config.{close[0]}?" if close else ""
                return f"{arg}: the config has no field {name!r}{hint}"
    causes, cause = [], error
    while cause is not None and len(causes) < 3:
        text = " ".join(str(cause).split()).strip("'\"") or type(cause).__name__
        if not any(text in earlier for earlier in causes):
            causes.append(text)
        cause = cause.__cause__ or cause.__context__
    return " <- ".join(causes)[:500]


def _load_config_quietly(argv: list[str]):
    """The config `--config=FILE` names, built by its get_config(), or None."""
    path = _config_path(argv)
    if not path or not os.path.isfile(path):
        return None
    try:
        spec = importlib.util.spec_from_file_location("lpdec_user_config", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()
    except Exception:  # noqa: BLE001 - the caller falls back to the error's own text
        return None


def _print_config_fields(argv: list[str]) -> None:
    """After absl's help: every `--config.FIELD` override with its default."""
    if not _config_path(argv):
        argv = [
            *argv,
            f"--config={os.path.join(os.path.dirname(__file__), 'configs', 'default.py')}",
        ]
    config = _load_config_quietly(argv)
    if config is None:
        return
    print(f"\n  --config.FIELD=VALUE overrides (defaults from {_config_path(argv)}):")
    for name, value in checkpoint.flatten_config(config).items():
        print(f"    --config.{name}: {value!r}")


def _config_path(argv: list[str]) -> str | None:
    """The file of the last `--config=FILE[:ARG]` flag, or None."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return values[-1].split(":")[0] if values else None


def _field_names(tree: dict, prefix: str = "") -> list[str]:
    names = []
    for key, value in tree.items():
        names.append(prefix + key)
        if isinstance(value, dict):
            names += _field_names(value, f"{prefix}{key}.")
    return names


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main, flags_parser=parse_flags)
