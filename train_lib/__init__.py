"""The application code of `train.py`, beside it as in the flax examples (not installed).

- `cli`: `train.py`'s command line: one-line flag errors, `--help`'s config fields, the
  multi-process start and the exit statuses.
- `loop`: `train_and_evaluate(config, workdir)`, the training loop.
- `setup`: config -> `Experiment`, once; the checks of the config's values.
- `registry`: what the configs choose by name, one table per kind.
- `steps`: the per-node programs (train chunk, init, evaluation).
- `checkpoint`: orbax checkpoints of the train state and the data position, each with a
  checksum and a config fingerprint checked on restore (damaged steps set aside).
- `metrics`: metrics.csv, TensorBoard, the stdout line, the progress bar, summary.json,
  and the divergence check.
- `workdir`: the workdir's checks and its lock (one run per workdir).
- `processes`: a multi-process start: argument checks, the handshake, the shared workdir.
- `watchdog`: the end of a run that cannot end by itself: a lost process (over the
  handshake's connections, kept open) and SIGTERM/SIGINT (a stop at a step boundary that
  every process agrees on, bounded by a timeout).

`train.py` and the tests import it from the repository root.
"""

from train_lib.loop import train_and_evaluate
from train_lib.registry import ConfigError
from train_lib.setup import Experiment
from train_lib.setup import build

__all__ = [
    "ConfigError",
    "Experiment",
    "build",
    "train_and_evaluate",
]
