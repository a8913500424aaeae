"""What the fault families share: a try's record (Trial), the context of a bench run
(Context: scratch directory, limits, the reference runs) and the helpers that run
train.py on the run-level faults' small config (TRAIN_FLAGS)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench import harness

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
STEPS, EVERY = 60, 10
TRAIN_FLAGS = (
    f"--config={ROOT / 'configs' / 'default.py'}",
    "--config.dataset=synthetic",
    "--config.num_samples=1200",
    "--config.model=mlp",
    "--config.precision=int8",
    "--config.algorithm=choco",
    f"--config.num_steps={STEPS}",
    f"--config.log_every={EVERY}",
    f"--config.checkpoint_every={EVERY}",
    "--config.learning_rate=0.05",
    "--config.save_final_params=True",
)


@dataclasses.dataclass
class Trial:
    """One try of a fault: whether nothing was lost, and what happened."""

    survived: bool
    note: str
    happened: bool = True  # False: the fault came too late to hit the run (not counted)
    skipped: bool = False  # True: the fault cannot be made here (not run, not counted)
    data: dict = dataclasses.field(default_factory=dict)  # the elastic cases' measurements


@dataclasses.dataclass
class Context:
    """What the faults share: a scratch directory, limits, and the reference run."""

    root: pathlib.Path
    timeout: float
    _straight: pathlib.Path | None = None
    no_namespaces: str | None = None  # why the elastic cases run on loopback (None: they don't)
    _elastic: dict | None = None

    @property
    def namespaces(self) -> bool:
        return self.no_namespaces is None

    def scratch(self, name: str) -> pathlib.Path:
        return pathlib.Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))

    def straight_two(self) -> pathlib.Path:
        """The uninterrupted run as 2 processes x 4 devices (trained once, on first use)."""
        workdir = self.root / "straight-2x4"
        if not workdir.exists():
            results = finish(start_processes(workdir), self.timeout)
            if any(code != 0 for code, _ in results):
                raise RuntimeError(f"the 2x4 reference run failed:\n{results[0][1][-2000:]}")
        return workdir

    def straight(self) -> pathlib.Path:
        """The workdir of the uninterrupted run (trained once, on first use)."""
        if self._straight is None:
            workdir = self.root / "straight"
            proc = train(workdir, timeout=self.timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"the reference run failed:\n{proc.stderr[-2000:]}")
            self._straight = workdir
        return self._straight


# ---------------------------------------------------------------------------
# Running train.py.
# ---------------------------------------------------------------------------


def _env(devices: int = 8) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def _command(workdir: pathlib.Path, extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), f"--workdir={workdir}", *TRAIN_FLAGS, *extra]


def train(workdir: pathlib.Path, *extra: str, timeout: float) -> subprocess.CompletedProcess:
    """train.py to the end (or its error), bounded by `timeout` seconds."""
    workdir.parent.mkdir(parents=True, exist_ok=True)
    log = workdir.with_name(f"{workdir.name}-{time.monotonic_ns()}.log")
    ((code, stderr),) = finish([_popen(_command(workdir, extra), 8, log)], timeout)
    return subprocess.CompletedProcess([], code, "", stderr)


def _popen(command: list[str], devices: int, log: pathlib.Path) -> subprocess.Popen:
    """A process in its own process group, stderr to `log` (never an unread pipe that
    fills and blocks a chatty process)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(
            command,
            env=_env(devices),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    proc.log = log
    return proc


def stderr_of(proc: subprocess.Popen) -> str:
    return proc.log.read_text(errors="replace")


def start(workdir: pathlib.Path, *extra: str) -> subprocess.Popen:
    """train.py in the background; its stderr goes to `<workdir>.log`."""
    return _popen(_command(workdir, extra), 8, workdir.with_suffix(".log"))


def start_processes(workdir: pathlib.Path, count: int = 2) -> list[subprocess.Popen]:
    """`count` train.py processes of 8 / count CPU devices each on loopback, one job."""
    address = f"127.0.0.1:{harness.free_port()}"
    flags = [(f"--num_processes={count}", f"--process_id={i}") for i in range(count)]
    return [
        _popen(
            _command(workdir, (*flags[i], f"--coordinator_address={address}")),
            8 // count,
            workdir.with_name(f"{workdir.name}-p{i}.log"),
        )
        for i in range(count)
    ]


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    """(exit status, stderr) of each process; any still running after `timeout` is killed."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            harness.kill_group(proc)
    return [(proc.returncode, stderr_of(proc)) for proc in procs]


def wait_for_checkpoint(workdir: pathlib.Path, step: int, proc, timeout: float) -> bool:
    """Waits until checkpoint `step` (or a later one) is written; False if the run ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(s >= step for s in checkpoint_steps(workdir)):
            return True
        time.sleep(0.02)
    return False


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def final_params(workdir: pathlib.Path) -> dict[str, np.ndarray] | None:
    path = workdir / "final_params.npz"
    if not path.exists():
        return None
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def identical(a: pathlib.Path, b: pathlib.Path) -> bool:
    pa, pb = final_params(a), final_params(b)
    return (
        pa is not None
        and pb is not None
        and pa.keys() == pb.keys()
        and all(np.array_equal(pa[k], pb[k]) for k in pa)
    )


def summary(workdir: pathlib.Path) -> dict:
    path = workdir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _one_error_line(stderr: str) -> str | None:
    """The `error: ...` line train.py prints for a refused run, if it is the only one."""
    lines = [line for line in stderr.strip().splitlines() if line.startswith("error:")]
    return lines[0] if len(lines) == 1 else None
