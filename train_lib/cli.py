"""`train.py`'s command line: flag parsing, the start of a multi-process run, exit statuses.

`train.py` defines the flags and calls these; each problem the user must fix is
one `error:` line on stderr and an exit status:

- 0: done, or halted by `config.halt_after_steps`;
- `EXIT_BAD_INPUT` (2): a bad flag, config, workdir or checkpoint;
- `EXIT_DIVERGED` (3): the loss diverged, summary.json says where;
- `EXIT_PEER_LOST` (4): another process of the run was lost, the line names it;
- 128 + the signal's number (143, 130) after SIGTERM/SIGINT, as the shell reports a death by it.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import signal
import sys
from typing import Any
from typing import NoReturn

from absl import flags
from absl import logging

from train_lib import elastic_flags
from train_lib import errors
from train_lib import processes
from train_lib import watchdog
from train_lib import workdir as workdir_lib
from train_lib.errors import ConfigError
from train_lib.errors import RunError

EXIT_BAD_INPUT = 2
EXIT_DIVERGED = 3
EXIT_PEER_LOST = 4

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs", "default.py")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad flag, config file or override reported in one line.

    The config file is loaded here (absl loads it lazily, at first use), so a
    missing file or a typo in `--config.FIELD` stops the run before anything
    starts, naming the flag and, for a typo, the closest field. `--help` also
    lists every `--config.FIELD` override with its default.
    """
    try:
        rest = flags.FLAGS(argv)
        flags.FLAGS.config.keys()  # loads the file and applies the overrides now
        return rest
    except SystemExit:
        if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
            _print_config_fields(argv)
        raise
    except Exception as error:  # noqa: BLE001 - ml_collections raises many types
        sys.stderr.write(f"error: {_explain_flag_error(argv, error)}\n")
        sys.exit(EXIT_BAD_INPUT)


def quiet_orbax() -> None:
    """Orbax logs every checkpoint step at INFO through absl; keep lpdec's lines readable."""
    logging.get_absl_handler().addFilter(lambda record: "orbax" not in record.pathname)


def start_processes(flag_values: flags.FlagValues) -> watchdog.PeerWatch | None:
    """The multi-process start the flags ask for (`--coordinator_address`...), or None.

    Checks the flags, starts `jax.distributed` and the handshake, and returns
    the watch over the other processes; a bad flag or a failed start exits 2.
    """
    f = flag_values
    try:
        processes.check_args(f.coordinator_address, f.num_processes, f.process_id)
        if not f.coordinator_address:
            return None
        return processes.start(
            f.coordinator_address,
            f.num_processes,
            f.process_id,
            {f"config.{k}": v for k, v in errors.flatten_config(f.config).items()},
            bind=f.coordinator_bind_address,
            timeout_s=f.peer_timeout,
            heartbeat_timeout_s=f.heartbeat_timeout,
            peer_lost_status=EXIT_PEER_LOST,
            process_sum=f.config.get("process_sum", "jax"),
            num_nodes=f.config.get("num_nodes", 0),
        )
    except RunError as error:
        sys.stderr.write(f"error: {error}\n")
        sys.exit(EXIT_BAD_INPUT)


def log_devices() -> None:
    """One line: this process among the others, and the devices it sees."""
    import jax  # noqa: PLC0415 - this module's checks run before jax is imported

    logging.info(
        "process %d of %d; %d local / %d global devices: %s",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
        jax.devices()[0].platform,
    )


def run_elastic(flag_values: flags.FlagValues) -> NoReturn:
    """One machine of an elastic run (`--elastic_service`); exits 0, 2, 3 or 4.

    With `--elastic_restarts` > 0 (the default) this process only supervises: it
    runs the machine as a child process (the same command with `--elastic_child`)
    and starts it again when it ends abnormally, so that it rejoins the run. That
    is how a machine comes back from its link going down: jaxlib's coordination
    client ends its process when the service has declared it lost (there is no
    reconnecting in place), and the restarted child joins with a live machine's
    state. The child dies with its supervisor (kill -9 of this process ends the
    machine).
    """
    if flag_values.elastic_restarts > 0 and not flag_values.elastic_child:
        _supervise(flag_values)
    from lpdec import elastic as lpdec_elastic  # noqa: PLC0415 - only elastic runs need it
    from train_lib import elastic  # noqa: PLC0415

    try:
        slowdown, min_round_s = elastic_flags.pace()  # fault tests only (the environment)
        options = elastic.ElasticOptions(
            service=flag_values.elastic_service,
            machine=_required(flag_values, "elastic_machine"),
            machines=_required(flag_values, "elastic_machines"),
            token=read_token(flag_values.elastic_token_file),
            local_steps=flag_values.elastic_local_steps,
            deadline=flag_values.elastic_deadline,
            join_timeout=flag_values.elastic_join_timeout,
            heartbeat_timeout=flag_values.elastic_heartbeat_timeout,
            connect_timeout=flag_values.elastic_connect_timeout,
            slowdown=slowdown,
            min_round_s=min_round_s,
            credentials=flag_values.elastic_credentials or "",
            private_network=flag_values.elastic_private_network,
            peer_address=flag_values.elastic_peer_address or "",
        )
        log_devices()
        summary = elastic.train_elastic(flag_values.config, flag_values.workdir, options)
        status = 0
        if summary["diverged"]:
            sys.stderr.write(f"error: {summary['stopped']}\n")
            status = EXIT_DIVERGED
    except elastic.ElasticLost as error:
        sys.stderr.write(f"error: {error}\n")
        status = EXIT_PEER_LOST
    except lpdec_elastic.JoinRefused as error:  # the gate: nothing of it registered
        sys.stderr.write(f"error: {error}\n")
        status = EXIT_BAD_INPUT
    except RunError as error:
        sys.stderr.write(f"error: {error}\n")
        status = EXIT_BAD_INPUT
    # The machine has left the service (train_elastic closes it on every path); the
    # membership thread may still sit in a call into jaxlib, which aborts the process
    # if the interpreter is torn down around it: nothing is left to flush but the logs.
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


# A child's exit statuses that end its machine for good: done, refused, diverged, and
# "the service could not be reached again" (restarting would not bring it back).
_FINAL = (0, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_PEER_LOST)


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervisor dies (Linux prctl)."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _supervise(flag_values: flags.FlagValues) -> NoReturn:
    """Runs this command as a child with --elastic_child, restarting it up to
    `--elastic_restarts` times when it ends abnormally after it had registered with
    the service (a signal, or jaxlib ending it after a lost link). A child that ends
    abnormally before registering is not restarted: one line, exit 4."""
    import subprocess  # noqa: PLC0415
    import time  # noqa: PLC0415

    restarts, machine = flag_values.elastic_restarts, flag_values.elastic_machine
    directory = os.path.abspath(flag_values.workdir or ".")
    marker = os.path.join(directory, workdir_lib.ELASTIC_CONNECTED)

    command = [sys.executable, *sys.argv, "--elastic_child"]
    child: list[subprocess.Popen] = []

    def forward(signum, _frame):
        if child and child[-1].poll() is None:
            child[-1].send_signal(signum)
        os._exit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    for attempt in range(restarts + 1):
        if os.path.exists(marker):
            os.remove(marker)
        child.append(subprocess.Popen(command, preexec_fn=_die_with_parent))
        status = child[-1].wait()
        if status in _FINAL:
            sys.exit(status)
        how = f"signal {-status}" if status < 0 else f"status {status}"
        if not os.path.exists(marker):
            sys.stderr.write(
                f"error: machine {machine} ended with {how} before it registered with the "
                f"service at {flag_values.elastic_service} (is it up, does it take only the "
                "run's credentials (--elastic_credentials), and did every machine of a new "
                "run start within the connect timeout?)\n"
            )
            sys.exit(EXIT_PEER_LOST)
        if attempt == restarts:
            sys.stderr.write(
                f"error: machine {machine} ended with {how} and was restarted {restarts} "
                "times (--elastic_restarts); giving up (if every restart ended a few seconds "
                "after it joined: is --elastic_heartbeat_timeout the service's "
                "--heartbeat_timeout?)\n"
            )
            sys.exit(EXIT_PEER_LOST)
        logging.warning(
            "elastic: machine %s ended with %s (its link lost, or it crashed); restarting it "
            "to rejoin the run (%d of %d)",
            machine,
            how,
            attempt + 1,
            restarts,
        )
        time.sleep(1.0)
    raise AssertionError("unreachable")


def _required(flag_values: flags.FlagValues, name: str) -> int:
    value = flag_values[name].value
    if value is None:
        raise ConfigError(f"--elastic_service needs --{name}.")
    return value


def read_token(path: str | None) -> bytes:
    """The run's secret from `path` or LPDEC_ELASTIC_TOKEN (b"" if neither)."""
    if path:
        try:
            with open(path, "rb") as f:
                return f.read().strip()
        except OSError as error:
            raise ConfigError(f"--elastic_token_file={path!r}: {error.strerror}") from None
    return os.environ.get("LPDEC_ELASTIC_TOKEN", "").encode()


def exit_for_error(error: RunError, peers: watchdog.PeerWatch | None) -> NoReturn:
    """Tells the other processes, prints `error: <message>` and exits 2."""
    if peers is not None:
        peers.leave(error=str(error))
    sys.stderr.write(f"error: {error}\n")
    sys.exit(EXIT_BAD_INPUT)


def exit_for_summary(summary: dict[str, Any], peers: watchdog.PeerWatch | None) -> None:
    """Leaves the other processes; exits 3 for a diverged run, 128 + signal for a stopped one."""
    if peers is not None:
        peers.leave()
    if summary["diverged"]:
        sys.stderr.write(f"error: {summary['stopped']}\n")
        sys.exit(EXIT_DIVERGED)
    if summary["interrupted"]:
        sys.stderr.write(f"{summary['stopped']}\n")
        sys.exit(128 + signal.Signals[summary["interrupted"]])


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
        argv = [*argv, f"--config={DEFAULT_CONFIG}"]
    config = _load_config_quietly(argv)
    if config is None:
        return
    print(f"\n  --config.FIELD=VALUE overrides (defaults from {_config_path(argv)}):")
    for name, value in errors.flatten_config(config).items():
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
