"""train.py under faults: damaged checkpoints, a changed config on resume, a second run in
the workdir, divergence, and bad command lines (issue 14, points 1-5 and 12)."""

import csv
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_train import final_params
from test_train import tiny_config
from test_train import tiny_run

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from train_lib import checkpoint  # noqa: E402
from train_lib import metrics  # noqa: E402
from train_lib import workdir as workdir_lib  # noqa: E402
from train_lib.errors import ConfigError  # noqa: E402


def _array_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """The files holding the train state's array bytes (orbax's `d/` data files)."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, sorted(str(p) for p in step_dir.rglob("*"))
    return files


def _flip_bits(path: pathlib.Path, rng) -> None:
    data = bytearray(path.read_bytes())
    for i in rng.integers(0, len(data), 16):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _other_steps_state(step_dir: pathlib.Path, rng) -> None:
    """A valid state of another step in this step's place (a botched copy): only the
    checksum can tell, the storage layer reads it without complaint."""
    del rng
    shutil.rmtree(step_dir / "state")
    shutil.copytree(step_dir.parent / "30" / "state", step_dir / "state")


DAMAGE = {
    "flipped bits": lambda d, rng: [_flip_bits(f, rng) for f in _array_files(d)],
    "random bytes": lambda d, rng: [
        f.write_bytes(rng.bytes(f.stat().st_size)) for f in _array_files(d)
    ],
    "truncated": lambda d, rng: [
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3]) for f in _array_files(d)
    ],
    "another step's state": _other_steps_state,
}


def _copy_of(run, workdir):
    """A shared run (test_train.tiny_run) copied into `workdir`, to change and resume."""
    shutil.copytree(run[0], workdir, dirs_exist_ok=True)


@pytest.fixture(scope="module")
def straight_run(shared_run):
    """The uninterrupted 40-step run the resumed ones must equal."""
    return final_params(tiny_run(shared_run)[0])


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(
    tmp_path, rng, shared_run, straight_run, damage
):
    """Step 40's arrays damaged: the rerun says so, resumes from step 30, and ends
    bit-identical to the uninterrupted run (steps 30-40 trained again)."""
    _copy_of(tiny_run(shared_run), tmp_path)
    DAMAGE[damage](tmp_path / "checkpoints" / "40", rng)
    summary = train.train_and_evaluate(tiny_config(), str(tmp_path))
    assert summary["resumed_from_step"] == 30 and summary["steps"] == 40
    assert (tmp_path / "checkpoints" / "40.damaged").is_dir()
    resumed = final_params(tmp_path)
    for name, value in straight_run.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)


def test_no_intact_checkpoint_is_one_error_naming_the_steps(tmp_path, rng, shared_run):
    _copy_of(tiny_run(shared_run), tmp_path)
    for step in ("30", "40"):
        for path in _array_files(tmp_path / "checkpoints" / step):
            _flip_bits(path, rng)
    with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint.*step 40.*step 30"):
        train.train_and_evaluate(tiny_config(), str(tmp_path))


def test_a_checkpoint_holding_nan_is_not_loaded(tmp_path):
    """A NaN saved with a valid checksum (a run that diverged before the guard): refused."""
    state = {"w": jnp.array([1.0, jnp.nan]), "count": jnp.array(3)}
    config = tiny_config()
    mngr = checkpoint.manager(str(tmp_path))
    checkpoint.save(mngr, 5, state, {"step": 5}, config)
    mngr.wait_until_finished()
    with pytest.raises(checkpoint.CheckpointError, match="step 5.*NaN or Inf"):
        checkpoint.restore_latest(mngr, state, config)


def test_checksum_sees_every_bit_and_not_the_layout():
    """One flipped bit anywhere changes the checksum; the same values sharded over
    8 devices or held on one give the same checksum."""
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    tree = {"a": x, "b": np.arange(5, dtype=np.uint8), "c": jnp.bfloat16(2.5) * jnp.ones(3)}
    base = checkpoint.checksum(tree)
    for leaf in ("a", "b"):
        flat = np.array(tree[leaf]).reshape(-1)
        for index in (0, flat.size - 1):
            bits = flat.view(np.uint8 if flat.dtype == np.uint8 else np.uint32).copy()
            bits[index] ^= 1
            changed = dict(tree, **{leaf: bits.view(flat.dtype).reshape(tree[leaf].shape)})
            assert checkpoint.checksum(changed) != base, (leaf, index)
    # Swapping two leaves' values (same multiset of words) changes it too.
    swapped = dict(tree, a=x[::-1].copy())
    assert checkpoint.checksum(swapped) != base
    mesh = jax.make_mesh((8,), ("n",))
    sharded = dict(tree, a=jax.device_put(x, jax.NamedSharding(mesh, jax.P("n"))))
    assert checkpoint.checksum(sharded) == base


@pytest.mark.parametrize(
    "change,fields",
    [
        ({"bits": 4}, ["config.bits: 8 -> 4"]),
        ({"algorithm": "dcd"}, ["config.algorithm: 'choco' -> 'dcd'"]),
        ({"num_nodes": 4, "topology": "complete"}, ["config.num_nodes: 8 -> 4", "config.topology"]),
    ],
    ids=["compressor", "algorithm", "nodes"],
)
def test_resuming_with_a_different_config_is_refused(tmp_path, shared_run, change, fields):
    _copy_of(tiny_run(shared_run, halt_after_steps=20), tmp_path)
    with pytest.raises(ConfigError) as error:
        train.train_and_evaluate(tiny_config(**change), str(tmp_path))
    message = str(error.value)
    assert "\n" not in message and "different config" in message
    for field in fields:
        assert field in message, message


def test_resuming_may_change_the_length_and_logging(tmp_path, shared_run):
    _copy_of(tiny_run(shared_run, halt_after_steps=20), tmp_path)
    summary = train.train_and_evaluate(
        tiny_config(num_steps=60, log_every=20, checkpoint_every=20), str(tmp_path)
    )
    assert summary["resumed_from_step"] == 20 and summary["steps"] == 60


def test_a_second_run_in_a_workdir_in_use_is_refused(tmp_path):
    with workdir_lib.Lock(str(tmp_path)):
        with pytest.raises(
            workdir_lib.WorkdirError, match=f"in use by a running train.py \\(pid {os.getpid()}"
        ):
            train.train_and_evaluate(tiny_config(), str(tmp_path))
    # Released: the run can go on now, and releases it when done.
    train.train_and_evaluate(tiny_config(num_steps=10), str(tmp_path))
    assert not (tmp_path / ".lock-p0").exists()


def test_a_stale_lock_of_a_dead_run_is_taken_over(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(dead.stdout)
    (tmp_path / ".lock-p0").write_text(
        json.dumps({"host": os.uname().nodename, "pid": pid, "start_time": "1", "since": "then"})
    )
    summary = train.train_and_evaluate(tiny_config(num_steps=10), str(tmp_path))
    assert summary["steps"] == 10


def test_a_lock_held_on_another_host_is_refused(tmp_path):
    (tmp_path / ".lock-p0").write_text(json.dumps({"host": "elsewhere", "pid": 1, "since": "then"}))
    with pytest.raises(workdir_lib.WorkdirError, match="pid 1 on host elsewhere"):
        train.train_and_evaluate(tiny_config(num_steps=10), str(tmp_path))


def test_a_diverging_run_stops_and_says_why(tmp_path):
    """At lr 1e6 every interval of 10 steps is bad. Halted after 2 (patience 3: it goes
    on) and resumed, the run stops after the third, as an uninterrupted one would: the
    checkpoint carries the streak. The diverged state is not saved."""
    common = dict(learning_rate=1e6, num_steps=200, checkpoint_every=10)
    first = train.train_and_evaluate(tiny_config(halt_after_steps=20, **common), str(tmp_path))
    assert first["halted"] and not first["diverged"] and first["steps"] == 20
    summary = train.train_and_evaluate(tiny_config(**common), str(tmp_path))
    assert summary["resumed_from_step"] == 20
    assert summary["diverged"] and not summary["halted"] and summary["steps"] == 30
    assert summary["stopped"].startswith("diverged: train_loss")
    assert "at step 30" in summary["stopped"] and "3 log intervals in a row" in summary["stopped"]
    assert json.loads((tmp_path / "summary.json").read_text())["diverged"]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["10", "20"]


def test_one_bad_interval_does_not_stop_a_run():
    monitor = metrics.DivergenceMonitor(10.0, 2)
    assert monitor.update(10, 2.3) is None
    assert monitor.update(20, float("nan")) is None  # one bad interval
    assert monitor.update(30, 1.9) is None  # recovered: the count restarts
    assert monitor.update(40, 40.0) is None
    assert "above 10 x 2.3" in monitor.update(50, 50.0)
    off = metrics.DivergenceMonitor(0, 1)
    assert off.update(10, float("nan")) is None


def test_a_run_that_ends_on_a_bad_interval_has_diverged():
    """Patience spares a run that may still recover; its last interval has no later one
    (issue 26: 40 steps at lr 1e6, logged every 20, ended at train loss 1.9e34, exit 0)."""
    short = metrics.DivergenceMonitor(10.0, 3, reference=1.0)
    assert short.update(20, 1.9e34) is None  # mid-run, 1 bad interval of 3
    reason = short.update(40, 1.9e34, last=True)
    assert reason.startswith("diverged: train_loss 1.9e+34 at step 40 (above 10 x 1)")
    assert "its last 2 log interval" in reason
    one = metrics.DivergenceMonitor(10.0, 3, reference=1.0)
    assert one.update(10, 0.5) is None
    assert "not finite" in one.update(20, float("inf"), last=True)
    recovered = metrics.DivergenceMonitor(10.0, 3, reference=1.0)
    assert recovered.update(10, float("nan")) is None
    assert recovered.update(20, 9.9, last=True) is None  # below 10 x 1: good
    assert metrics.DivergenceMonitor(0, 3).update(10, float("nan"), last=True) is None


def test_the_bad_streak_survives_a_checkpoint():
    """The streak goes through the checkpoint's JSON meta; a checkpoint written before
    it was saved restores none."""
    before = metrics.DivergenceMonitor(10.0, 3, reference=1.0)
    assert before.update(10, 50.0) is None and before.update(20, 60.0) is None
    after = metrics.DivergenceMonitor(10.0, 3, reference=1.0)
    after.restore(json.loads(json.dumps(before.state())))
    assert "for 3 log intervals in a row" in after.update(30, 70.0)
    old = metrics.DivergenceMonitor(10.0, 3, reference=1.0)
    old.restore({})
    assert old.update(30, 70.0) is None


def test_a_loss_jump_far_above_its_minimum_is_a_warning():
    """With 10 classes the margin is 0.25 x ln 10 = 0.576 above the running minimum, and
    the loss must also be above 1.5 x it; one warning per episode of jumping intervals."""
    monitor = metrics.LossJumpMonitor(reference=math.log(10))
    history = [
        (10, 2.3, False),
        (20, 1.0, False),
        (30, 0.003, False),
        (40, 0.01, False),  # 3.3 x the minimum, but noise: 0.007 above it
        (50, 0.5, False),  # 0.497 above: under the margin
        (60, 0.9, True),  # EXPERIMENTS.md's torus collapse: 0.003 -> 0.9
        (70, 1.2, True),  # the same episode: no second warning
        (80, float("nan"), False),  # the divergence check's business
        (90, 0.002, False),
        (100, 2.0, True),
    ]
    lines = []
    for step, loss, jumping in history:
        line = monitor.update(step, loss)
        assert monitor.jumping == jumping, step
        lines.append(line)
    assert [i for i, line in enumerate(lines) if line] == [5, 9]
    assert lines[5].startswith("loss jump: train_loss 0.9 at step 60, up from its lowest 0.003")
    assert monitor.warnings == [
        {"step": 60, "train_loss": 0.9, "running_min": 0.003, "running_min_step": 30},
        {"step": 100, "train_loss": 2.0, "running_min": 0.002, "running_min_step": 90},
    ]
    # A high loss's wobble: 0.6 above the minimum (over the margin) but 1.375 x it.
    high = metrics.LossJumpMonitor(reference=math.log(10))
    assert high.update(10, 1.6) is None and high.update(20, 2.2) is None and not high.jumping


def test_loss_jumps_survive_a_checkpoint():
    """Restored from the JSON meta, the monitor goes on as if never interrupted: the
    minimum, the episode in progress and the warnings so far."""
    straight, first = (metrics.LossJumpMonitor(reference=1.0) for _ in range(2))
    for step, loss in ((10, 0.1), (20, 0.8), (30, 0.9)):
        straight.update(step, loss)
        first.update(step, loss)
    resumed = metrics.LossJumpMonitor(reference=1.0)
    resumed.restore(json.loads(json.dumps(first.state())))
    for step, loss in ((40, 1.0), (50, 0.05), (60, 0.9)):
        assert resumed.update(step, loss) == straight.update(step, loss)
    assert resumed.warnings == straight.warnings and len(straight.warnings) == 2
    old = metrics.LossJumpMonitor(reference=1.0)
    old.restore({})  # a checkpoint written before the monitor
    assert old.update(40, 1.0) is None and old.warnings == []


def test_a_collapsing_run_warns_and_goes_on(tmp_path):
    """The learning rate x 30 after step 20 (0.05 -> 1.5; fp32) throws the loss back up
    in the third interval (7.2 on 2 CPU cores, from 0.11), finite and under the
    divergence threshold (raised to 100 x ln 4, so as not to hang on how far): a warning,
    not a stop. Halted at 20 and resumed, the run keeps its minimum."""
    common = dict(
        precision="fp32",
        num_steps=30,
        lr_boundaries=(2 / 3,),
        lr_decay=30.0,
        divergence_factor=100.0,
    )
    train.train_and_evaluate(tiny_config(halt_after_steps=20, **common), str(tmp_path))
    summary = train.train_and_evaluate(tiny_config(**common), str(tmp_path))
    assert summary["resumed_from_step"] == 20 and summary["steps"] == 30
    assert not summary["diverged"] and summary["stopped"] is None
    with open(tmp_path / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert [rows[s]["loss_jump"] for s in (10, 20, 30)] == ["0", "0", "1"]
    losses = {s: float(r["train_loss"]) for s, r in rows.items()}
    assert losses[20] < losses[10] and losses[30] > 1.5 * losses[20] + 0.25 * math.log(4)
    assert summary["loss_jumps"] == [
        {"step": 30, "train_loss": losses[30], "running_min": losses[20], "running_min_step": 20}
    ]
    assert json.loads((tmp_path / "summary.json").read_text())["loss_jumps"][0]["step"] == 30


def test_an_existing_directory_that_cannot_be_written_is_refused():
    # /proc/self is a directory in which nobody, root included, can create a file.
    with pytest.raises(workdir_lib.WorkdirError, match="/proc/self is not a writable directory"):
        workdir_lib.prepare("/proc/self")


def _env():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["PYTHONPATH"] = str(ROOT)
    return env


CLI_ERRORS = [
    (
        ["--config.learnign_rate=0.1"],
        "no field 'learnign_rate'; did you mean config.learning_rate?",
    ),
    (["--config=configs/missing.py"], "--config=configs/missing.py: no such file"),
    (["--workdir={file}"], "is a file; expected a directory"),
    (["--workdir={file}/sub"], "is not a writable directory"),
]


@pytest.mark.parametrize(
    "args,message", CLI_ERRORS, ids=["typo", "no-config", "file", "under-file"]
)
def test_command_line_mistakes_are_one_line(tmp_path, args, message):
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [
        sys.executable,
        "train.py",
        "--config=configs/quickstart.py",
        f"--workdir={tmp_path / 'w'}",
    ]
    argv += [a.format(file=afile) for a in args] + ["--config.num_steps=1"]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == train.EXIT_BAD_INPUT, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if not line.startswith(("I1", "W1"))]
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], errors


def test_a_command_line_run_that_ends_diverged_exits_3(tmp_path):
    """2 bad intervals of 10 steps, fewer than the patience (3), but the run's last ones:
    exit 3, one line saying so, summary.json says so, and no final checkpoint."""
    argv = [sys.executable, "train.py", "--config=configs/default.py", f"--workdir={tmp_path}"]
    argv += ["--config.dataset=synthetic", "--config.num_samples=1200", "--config.model=mlp"]
    argv += ["--config.learning_rate=1e6", "--config.num_steps=20", "--config.log_every=10"]
    argv += ["--config.checkpoint_every=0", "--config.divergence_patience=3"]
    proc = subprocess.run(argv, env=_env(), capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == train.EXIT_DIVERGED, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: diverged: train_loss") and "at step 20" in last, last
    assert "when the run ended, bad for its last 2 log interval" in last, last
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["diverged"] and summary["steps"] == 20 and last == f"error: {summary['stopped']}"
    assert not os.listdir(tmp_path / "checkpoints")
