"""The application code of `train.py`, beside it as in the flax examples (not installed).

- `cli`: `train.py`'s command line: one-line flag errors, `--help`'s config fields, the
  multi-process start and the exit statuses.
- `loop`: the training loop, written once (`run(trainer, ...)`), and the synchronous
  run, `train_and_evaluate(config, workdir)`; `elastic` plugs a machine into it.
- `setup`: config -> `Experiment`, once; the checks of the config's values.
- `registry`: what the configs choose by name, one table per kind (`tables`: an entry,
  its fields and checks; `optimizers`: the schedule, local optimizer, outer step).
- `steps`: the per-node programs (train chunk, init, evaluation).
- `checkpoint`: orbax checkpoints of the train state and the data position, each with a
  checksum and a config fingerprint checked on restore (damaged steps set aside).
- `metrics`: metrics.csv, TensorBoard, the stderr line, the progress bar, summary.json,
  and the divergence check.
- `workdir`: the workdir's checks and its lock (one run per workdir).
- `processes`: a multi-process start: argument checks, the handshake, the shared workdir.
- `errors`: `RunError` and `ConfigError`, the one-line errors; `flatten_config`.
- `watchdog`: the end of a run that cannot end by itself: a lost process (over the
  handshake's connections, kept open) and SIGTERM/SIGINT (a stop at a step boundary that
  every process agrees on, bounded by a timeout).

`train.py` and the tests import it from the repository root. The names below are
imported on first use, so `from train_lib import cli` (the command line's checks, the
handshake, the elastic supervisor) does not import jax (see `errors`).
"""

import importlib

_EXPORTS = {
    "ConfigError": "train_lib.errors",
    "Experiment": "train_lib.setup",
    "build": "train_lib.setup",
    "train_and_evaluate": "train_lib.loop",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """`train_lib.<name>` for the names in `__all__`, imported when first asked for."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'train_lib' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
