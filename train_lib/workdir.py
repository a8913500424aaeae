"""The run's workdir: checked before anything is written, and locked against a second run.

Two runs writing one workdir would interleave their metrics and checkpoints, so
every process of a run takes `workdir/.lock-p<process index>` (one file per
process, so the processes of one run sharing a disk do not trip over each
other; a second run's process with the same index does). The lock records the
owner's host, pid and the pid's start time. A lock left by a run that was
killed (kill -9 leaves it behind) is recognised as stale when its host is this
host and that pid is gone or is another process now, and is taken over with a
one-line warning; a lock held by a live run, or by another host, stops the new
run with a one-line `WorkdirError` naming the owner.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time

from absl import logging

from train_lib.errors import RunError

#: An elastic machine's marker in its workdir: it registered with the service (written
#: by `train_lib.elastic`, read by the supervisor in `train_lib.cli`).
ELASTIC_CONNECTED = ".elastic-connected"


class WorkdirError(RunError):
    """The workdir cannot be used: not a directory, not writable, or in use."""


def prepare(workdir: str) -> str:
    """Creates `workdir` if needed and checks it is a writable directory; returns its abspath."""
    path = os.path.abspath(workdir)
    if os.path.exists(path) and not os.path.isdir(path):
        raise WorkdirError(f"--workdir={workdir} is a file; expected a directory (or a new path).")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as error:
        raise WorkdirError(
            f"--workdir={workdir} is not a writable directory ({error.strerror or error}); "
            "expected a directory this user can create files in."
        ) from None
    return path


def _start_time(pid: int) -> str | None:
    """The pid's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces; the fields after it do not.
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(owner: dict) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by another user
    started = owner.get("start_time")
    return started is None or _start_time(pid) in (None, started)


class Lock:
    """`workdir/.lock-p<process>`, held from `acquire()` to `release()` (or a context)."""

    def __init__(self, workdir: str, process_index: int = 0):
        self.path = os.path.join(workdir, f".lock-p{process_index}")
        self.held = False

    def _owner(self) -> dict:
        try:
            with open(self.path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def acquire(self) -> Lock:
        me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_time": _start_time(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if owner.get("host") != me["host"]:
                    raise WorkdirError(
                        f"{os.path.dirname(self.path)} is in use by pid {owner.get('pid')} on "
                        f"host {owner.get('host')} since {owner.get('since')} ({self.path}); "
                        "use another --workdir, or delete that file if the run is dead."
                    ) from None
                if _alive(owner):
                    raise WorkdirError(
                        f"{os.path.dirname(self.path)} is in use by a running train.py "
                        f"(pid {owner['pid']} since {owner.get('since')}); use another --workdir "
                        "or wait for it to finish."
                    ) from None
                logging.warning(
                    "taking over the lock of a run that is gone (pid %s since %s): %s",
                    owner.get("pid"),
                    owner.get("since"),
                    self.path,
                )
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self
        raise WorkdirError(f"could not take {self.path}: another run took it at the same time.")

    def release(self) -> None:
        if self.held:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            self.held = False

    def __enter__(self) -> Lock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
