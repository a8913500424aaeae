"""Run-level faults: train.py killed, signalled or started twice, its checkpoints
damaged, one process of a 2 x 4 run lost; each judged against an uninterrupted run
(see bench/faults/__init__.py)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import time
from collections.abc import Callable

import numpy as np

from bench import harness
from bench.faults.common import EVERY
from bench.faults.common import STEPS
from bench.faults.common import Context
from bench.faults.common import Trial
from bench.faults.common import _one_error_line
from bench.faults.common import checkpoint_steps
from bench.faults.common import final_params
from bench.faults.common import finish
from bench.faults.common import identical
from bench.faults.common import start
from bench.faults.common import start_processes
from bench.faults.common import stderr_of
from bench.faults.common import summary
from bench.faults.common import train
from bench.faults.common import wait_for_checkpoint


def wait_past_random_checkpoint(ctx: Context, rng, workdir: pathlib.Path, proc) -> int | None:
    """Waits for a random checkpoint (10 .. STEPS - 20) and up to 0.5 s more; the
    checkpoint's step, or None if the run ended first."""
    after = int(rng.integers(1, STEPS // EVERY - 1)) * EVERY
    if not wait_for_checkpoint(workdir, after, proc, ctx.timeout):
        return None
    time.sleep(float(rng.uniform(0.0, 0.5)))
    return after


def kill9(ctx: Context, rng: np.random.Generator) -> Trial:
    """kill -9 at a random step after a checkpoint; the rerun must end identical."""
    workdir = ctx.scratch("kill9")
    proc = start(workdir)
    try:
        after = wait_past_random_checkpoint(ctx, rng, workdir, proc)
        if after is None:
            return Trial(False, "the run ended before its checkpoint")
    finally:
        harness.kill_group(proc)
        proc.wait()
    if final_params(workdir) is not None:
        return Trial(True, "finished before the kill", happened=False)
    rerun = train(workdir, timeout=ctx.timeout)
    resumed = summary(workdir).get("resumed_from_step")
    same = rerun.returncode == 0 and identical(workdir, ctx.straight())
    return Trial(same, f"killed after checkpoint {after}, resumed from {resumed}")


def _array_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The files holding the state's array bytes (orbax's `d/` data files)."""
    return sorted(
        p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"
    )


def _any_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """Every file of a checkpoint: arrays, orbax's metadata and manifests, lpdec's meta."""
    return sorted(p for p in step_dir.rglob("*") if p.is_file())


def _flip(path: pathlib.Path, rng) -> None:
    data = bytearray(path.read_bytes())
    for i in rng.integers(0, len(data), int(rng.integers(1, 64))):
        data[i] ^= 1 << int(rng.integers(0, 8))
    path.write_bytes(bytes(data))


DAMAGES: dict[str, Callable[[pathlib.Path, np.random.Generator], None]] = {
    "flipped bits": _flip,
    "random bytes": lambda f, rng: f.write_bytes(rng.bytes(f.stat().st_size)),
    "truncated": lambda f, rng: f.write_bytes(
        f.read_bytes()[: int(rng.integers(0, f.stat().st_size))]
    ),
    "deleted": lambda f, rng: f.unlink(),
}


def _damaged_copy(ctx: Context, name: str, rng, damage: str, files) -> pathlib.Path:
    """A copy of the finished reference run with `damage` done to `files(copy)`."""
    workdir = ctx.scratch(name)
    shutil.copytree(ctx.straight(), workdir, dirs_exist_ok=True)
    (workdir / "final_params.npz").unlink()
    (workdir / "summary.json").unlink()
    for path in files(workdir):
        DAMAGES[damage](path, rng)
    return workdir


def damaged_checkpoint(ctx: Context, rng: np.random.Generator) -> Trial:
    """One file of the latest checkpoint damaged (any file: arrays, orbax's metadata,
    lpdec's meta): the rerun ends identical, from that step if the damage did not touch
    what it reads (the checksum says so), else from the one before."""
    damage = list(DAMAGES)[int(rng.integers(0, len(DAMAGES)))]
    latest = checkpoint_steps(ctx.straight())[-1]
    candidates = _any_files(ctx.straight() / "checkpoints" / str(latest))
    victim = candidates[int(rng.integers(0, len(candidates)))].relative_to(ctx.straight())
    workdir = _damaged_copy(ctx, "damaged", rng, damage, lambda w: [w / victim])
    rerun = train(workdir, timeout=ctx.timeout)
    resumed = summary(workdir).get("resumed_from_step")
    set_aside = (workdir / "checkpoints" / f"{latest}.damaged").is_dir()
    same = rerun.returncode == 0 and identical(workdir, ctx.straight())
    what = "set aside" if set_aside else "not needed on restore"
    tail = "" if rerun.returncode == 0 else f", exit {rerun.returncode}: {rerun.stderr[-300:]}"
    name = str(victim.relative_to(pathlib.Path("checkpoints")))
    return Trial(same, f"{damage} in {name}: {what}, resumed from {resumed}{tail}")


def no_intact_checkpoint(ctx: Context, rng: np.random.Generator) -> Trial:
    """Every checkpoint's array files damaged: one error line, exit status 2, nothing loaded."""
    damage = list(DAMAGES)[int(rng.integers(0, len(DAMAGES)))]

    def every_array_file(workdir):
        return [
            f
            for s in checkpoint_steps(workdir)
            for f in _array_files(workdir / "checkpoints" / str(s))
        ]

    workdir = _damaged_copy(ctx, "all-damaged", rng, damage, every_array_file)
    rerun = train(workdir, timeout=ctx.timeout)
    line = _one_error_line(rerun.stderr)
    ok = rerun.returncode == 2 and line is not None and final_params(workdir) is None
    return Trial(ok, f"{damage}: exit {rerun.returncode}, {line or 'no one-line error'}")


def second_run(ctx: Context, rng: np.random.Generator) -> Trial:
    """A second train.py in a workdir in use: refused in one line; the first ends identical.

    The first run is paused (SIGSTOP) at a random point after its first logged step
    while the second runs, so it is certainly alive when the second looks at the
    workdir; then it is resumed (SIGCONT) and must end as if nothing happened.
    """
    workdir = ctx.scratch("second")
    first = start(workdir)
    try:
        deadline = time.monotonic() + ctx.timeout
        metrics = workdir / "metrics.csv"
        while first.poll() is None and time.monotonic() < deadline:
            if metrics.exists() and len(metrics.read_text().splitlines()) > 1:
                break
            time.sleep(0.02)
        time.sleep(float(rng.uniform(0.0, 0.2)))
        if first.poll() is not None:
            return Trial(True, "the first run ended before it could be paused", happened=False)
        os.kill(first.pid, signal.SIGSTOP)
        rows = len(metrics.read_text().splitlines()) - 1
        second = train(workdir, timeout=ctx.timeout)
        os.kill(first.pid, signal.SIGCONT)
        first.wait(timeout=ctx.timeout)
    finally:
        harness.kill_group(first)
        first.wait()
    line = _one_error_line(second.stderr)
    ok = (
        second.returncode == 2
        and line is not None
        and first.returncode == 0
        and identical(workdir, ctx.straight())
    )
    return Trial(
        ok,
        f"first paused after {rows} logged intervals: the second exited {second.returncode} "
        f"({line}); the first went on and exited {first.returncode}",
    )


def sigterm(ctx: Context, rng: np.random.Generator) -> Trial:
    """SIGTERM (or SIGINT) at a random step: exit 128 + signal within seconds, and the
    rerun ends identical."""
    workdir = ctx.scratch("signal")
    signum = (signal.SIGTERM, signal.SIGINT)[int(rng.integers(0, 2))]
    proc = start(workdir)
    try:
        after = wait_past_random_checkpoint(ctx, rng, workdir, proc)
        if after is None:
            return Trial(False, "the run ended before its checkpoint")
        sent = time.monotonic()
        proc.send_signal(signum)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            return Trial(False, f"{signum.name} after checkpoint {after}: still running at 60 s")
        took = time.monotonic() - sent
    finally:
        harness.kill_group(proc)
        proc.wait()
    code = proc.returncode
    if code == 0:
        return Trial(True, f"{signum.name} after checkpoint {after}: too late", happened=False)
    interrupted = summary(workdir).get("interrupted")
    rerun = train(workdir, timeout=ctx.timeout)
    same = rerun.returncode == 0 and identical(workdir, ctx.straight())
    ok = code == 128 + signum and took <= 15 and same
    return Trial(
        ok,
        f"{signum.name} after checkpoint {after}: exit {code} in {took:.1f} s "
        f"(summary: interrupted={interrupted}), rerun from "
        f"{summary(workdir).get('resumed_from_step')}",
    )


def lost_process(ctx: Context, rng: np.random.Generator) -> Trial:
    """kill -9 of one process of a 2 x 4 run at a random step: the other exits 4 within
    30 s naming it, and rerunning both ends identical to an uninterrupted 2 x 4 run."""
    reference = ctx.straight_two()
    workdir = ctx.scratch("lost")
    victim = int(rng.integers(0, 2))
    procs = start_processes(workdir)
    try:
        after = wait_past_random_checkpoint(ctx, rng, workdir, procs[0])
        if after is None:
            return Trial(False, "the run ended before its checkpoint")
        killed = time.monotonic()
        harness.kill_group(procs[victim])
        survivor = procs[1 - victim]
        try:
            survivor.wait(timeout=60)
        except subprocess.TimeoutExpired:
            return Trial(False, f"process {victim} killed: process {1 - victim} still up at 60 s")
        took = time.monotonic() - killed
        code, stderr = survivor.returncode, stderr_of(survivor)
    finally:
        for proc in procs:
            harness.kill_group(proc)
    if code == 0:
        return Trial(
            True, f"process {victim} killed after checkpoint {after}: too late", happened=False
        )
    line = _one_error_line(stderr) or ""
    results = finish(start_processes(workdir), ctx.timeout)
    same = all(c == 0 for c, _ in results) and identical(workdir, reference)
    ok = code == 4 and took <= 30 and f"process {victim}" in line and same
    return Trial(
        ok,
        f"process {victim} killed after checkpoint {after}: the other exited {code} in "
        f"{took:.1f} s ({line[:70]}...); rerun from {summary(workdir).get('resumed_from_step')}",
    )
