"""The experiments runner: every study runs end to end in quick mode (so it cannot rot),
its tables come from docs/experiments.json alone, and its cache follows the code.

Every study runs as a dry run (`--dry-run`: each config checked as train.py checks it
before its first step, placeholder numbers instead of training's), which exercises each
study's grid, tables, plots and experiments.json in seconds; two studies also train for
real in quick mode, which covers what a dry run leaves out (Runner._train's training
and metrics.csv: mx; the AD-PSGD simulator's runs: ad_psgd) and shows that a dry run checks the very
runs a real one trains, with the same fields.
"""

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STUDIES = (
    "gamma",
    "table2",
    "precision",
    "qgm",
    "moniqua",
    "theorem1",
    "centralized",
    "tradeoff",
    "mx",
    "ad_psgd",
    "lm",
    "scale",
)


def run_experiments(tmp_path, *args, check=True, optimized=False):
    """`python -m bench.experiments *args`; `optimized`: XLA's backend optimizations on
    (conftest turns them off for quicker compiles), for a run whose time is executing."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    if optimized:
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.experiments", *args, f"--workdir={tmp_path / 'runs'}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def sections(text, studies=STUDIES):
    found = {}
    for study in studies:
        start, end = f"<!-- study:{study}:start -->", f"<!-- study:{study}:end -->"
        assert start in text and end in text, study
        found[study] = text.split(start)[1].split(end)[0]
    return found


def check_quick_runs(data):
    """What every run of a quick experiments.json holds, trained or dry."""
    for r in data["runs"]:
        for field in ("method", "seed", "config", "steps", "schedule"):
            assert field in r, field
        assert r["steps"] == 20 and r["config"]["num_steps"] == 20
        if r["study"] in ("lm", "scale"):  # language models: bits per byte, not accuracy
            assert 0.0 < r["final_val_bits_per_byte"] < 16.0 and r["tokens_per_step"] > 0
        else:
            assert 0.0 <= r["final_test_accuracy"] <= 1.0
        assert r["bytes_per_node_total"] == r["bytes_per_node_per_step"] * r["steps"]
        assert r["code"] == data["code"]


def test_dry_run_writes_every_study_plot_and_run_and_renders_from_the_json(tmp_path):
    output = tmp_path / "EXPERIMENTS.md"
    run_experiments(tmp_path, "all", "--quick", "--dry-run", f"--output={output}")
    text = output.read_text()
    found = sections(text)
    for study, section in found.items():
        # Every study reports a table of results and states its command and time, and
        # that its numbers are placeholders.
        assert "| --- |" in section.replace("|---|", "| --- |"), study
        assert f"python -m bench.experiments {study} --quick --dry-run`" in section, study
        assert "DRY RUN, nothing trained" in section, study
    assert "DRY RUN: no run was trained" in text.split("<!-- runtime:start -->")[1]
    docs = tmp_path / "docs"
    plots = sorted(p for p in os.listdir(docs) if p.endswith(".png"))
    assert plots == sorted(
        [
            "curves.png",
            "lm_loss_vs_bytes.png",
            "lm_loss_vs_tokens.png",
            "moniqua_bytes.png",
            "table2.png",
            "theorem1.png",
            "tradeoff_bytes_skew09.png",
            "tradeoff_wallclock_skew09.png",
        ]
    )
    assert all((docs / p).stat().st_size > 1000 for p in plots)

    data = json.loads((docs / "experiments.json").read_text())
    runs = data["runs"]
    assert {r["study"] for r in runs} == set(STUDIES) - {"theorem1"}
    check_quick_runs(data)
    # Marked as a dry run, under a code no trained run has, and nothing cached.
    assert data["dry_run"] is True and data["code"].startswith("dry run (")
    assert all(r["dry_run"] is True for r in runs)
    assert not (tmp_path / "runs_quick").exists()
    # Each run's placeholders are its own (derived from its key).
    by_key = {
        r["key"]: r.get("final_test_accuracy", r.get("final_val_bits_per_byte")) for r in runs
    }
    assert len(set(by_key.values())) == len(by_key)
    # The local-step methods sit in the tradeoff study, with bytes.
    diloco = [r for r in runs if r["study"] == "tradeoff" and r["method"].startswith("DiLoCo")]
    assert diloco and all(r["bytes_per_node_per_step"] > 0 for r in diloco)
    # The language model's study tunes each method, then its sanity checks and ablations.
    lm_runs = [r for r in runs if r["study"] == "lm"]
    assert {r["config"]["algorithm"] for r in lm_runs} == {"allreduce", "diloco"}
    assert any(r["config"].get("machines") == 1 for r in lm_runs)  # DiLoCo with one replica
    assert "### Tuned, 3 seeds" in found["lm"] and "| claim | measured | verdict |" in found["lm"]
    # Beyond two machines: 4 and 8 machines, Muon inside them, the momentum's decay.
    scale_runs = [r for r in runs if r["study"] == "scale"]
    assert {r["config"].get("machines") for r in scale_runs} >= {4, 8}
    assert any(r["config"].get("optimizer") == "muon" for r in scale_runs)
    assert "| machines | recipe | setting |" in found["scale"]
    # The precision ablation crosses the arithmetic with the norm layer.
    crossed = {
        (r["config"].get("precision", "fp32"), r["config"].get("norm", ""))
        for r in runs
        if r["study"] == "precision"
    }
    assert crossed == {("fp32", ""), ("fp32", "range_evonorm"), ("int8", "evonorm"), ("int8", "")}
    # Moniqua's one-bit run uses stochastic rounding and the paper's theta and ratio.
    one_bit = [r for r in runs if r["method"] == "Moniqua 1-bit"]
    assert one_bit and one_bit[0]["config"]["rounding"] == "stochastic"
    assert one_bit[0]["config"]["theta"] == 2.0 and one_bit[0]["config"]["slack"] == 5e-3

    # The tables and plots come from experiments.json alone: --render writes the same
    # tables (only the timing line may differ), and says they are a dry run's.
    rendered = tmp_path / "rendered.md"
    run_experiments(tmp_path, "all", "--quick", "--render", f"--output={rendered}")
    again = sections(rendered.read_text())
    for study in STUDIES:

        def strip(text):
            return re.sub(r"_Command: .*?_\n", "", text)

        assert f"{study} --quick --dry-run`; DRY RUN, nothing trained" in again[study], study
        assert strip(again[study]) == strip(found[study]), study
    # A number changed in the json shows up in the rendered table.
    first = next(r for r in runs if r["study"] == "centralized")
    first["final_test_accuracy"] = 0.123456
    for r in runs:
        if r["key"] == first["key"]:
            r["final_test_accuracy"] = 0.123456
    (docs / "experiments.json").write_text(json.dumps(data))
    run_experiments(tmp_path, "centralized", "--quick", "--render", f"--output={rendered}")
    assert "| 12.3 |" in sections(rendered.read_text())["centralized"]  # one seed: no std


def train_quick_and_dry(tmp_path, study, optimized=False):
    """`study --quick` trained (`optimized`: see run_experiments), then its dry run;
    returns the trained runs and the trained output's path.

    The dry run lists the same runs under the same methods as the trained one, each
    record with the same fields.
    """
    output = tmp_path / "trained" / "EXPERIMENTS.md"
    run_experiments(tmp_path, study, "--quick", f"--output={output}", optimized=optimized)
    published = tmp_path / "trained" / "docs" / "experiments.json"
    trained = json.loads(published.read_text())
    section = sections(output.read_text(), (study,))[study]
    assert f"python -m bench.experiments {study} --quick`" in section
    assert "DRY RUN" not in section and "dry_run" not in trained
    check_quick_runs(trained)
    assert all("dry_run" not in r for r in trained["runs"])
    # Every run is cached under the code that trained it.
    cached = json.loads((tmp_path / "runs_quick" / "results.json").read_text())
    assert set(cached) == {r["key"] for r in trained["runs"]}
    assert {r["code"] for r in cached.values()} == {trained["code"]}

    dry_output = tmp_path / "dry" / "EXPERIMENTS.md"
    run_experiments(tmp_path, study, "--quick", "--dry-run", f"--output={dry_output}")
    dry = json.loads((tmp_path / "dry" / "docs" / "experiments.json").read_text())
    listing = [(r["study"], r["method"], r["seed"], r["key"]) for r in trained["runs"]]
    assert [(r["study"], r["method"], r["seed"], r["key"]) for r in dry["runs"]] == listing
    for real, placeholder in zip(trained["runs"], dry["runs"], strict=True):
        assert set(placeholder) == set(real) | {"dry_run"}, real["method"]
        assert placeholder["config"] == real["config"] and len(placeholder["curve"]) == len(
            real["curve"]
        )
    return trained["runs"], output


def test_quick_mode_trains_the_mx_study_as_its_dry_run_checks_it(tmp_path):
    """Runner._train's real path (train_lib.train_and_evaluate, its summary and its
    metrics.csv) on 4 runs: CHOCO's gossip and DiLoCo's compressed mean."""
    runs, output = train_quick_and_dry(tmp_path, "mx")
    # The local-step methods report the bytes they send.
    diloco = [r for r in runs if r["method"].startswith("DiLoCo")]
    assert diloco and all(r["bytes_per_node_per_step"] > 0 for r in diloco)
    for r in runs:  # metrics.csv's rows: every 2 steps, the last one the final accuracy
        assert [row[0] for row in r["curve"]] == list(range(2, 21, 2)), r["method"]
        assert r["curve"][-1][1] == r["final_test_accuracy"], r["method"]
    # A dry run refuses to write over trained runs, and leaves them as they are.
    published = output.parent / "docs" / "experiments.json"
    before = published.read_text()
    refused = run_experiments(
        tmp_path, "mx", "--quick", "--dry-run", f"--output={output}", check=False
    )
    assert refused.returncode != 0 and "holds trained runs" in refused.stderr, refused.stderr
    assert published.read_text() == before


def test_quick_mode_trains_the_ad_psgd_study_as_its_dry_run_checks_it(tmp_path):
    """The runs bench/experiments/async_train.py trains through lpdec.async_sim.

    Optimized: the simulator runs 160 iterations one by one per run, 14 runs, and without
    XLA's optimizations executing them is most of the time (102 -> 35 s on jax 0.12, the
    same accuracies). The other trained study (mx) is quicker unoptimized (70 against 76 s).
    """
    runs, _ = train_quick_and_dry(tmp_path, "ad_psgd", optimized=True)
    for r in runs:  # evaluated 5 times; the last one the final accuracy
        assert [row[0] for row in r["curve"]] == [4, 8, 12, 16, 20], r["method"]
        assert r["curve"][-1][1] == r["final_test_accuracy"], r["method"]
    asynchronous = [r for r in runs if r["config"]["async_sim"]["algorithm"] == "ad_psgd"]
    assert asynchronous and all(r["mean_delay"] > 0 for r in asynchronous)


def test_code_fingerprint_follows_code_not_comments(tmp_path):
    from bench import experiments

    (tmp_path / "lpdec").mkdir()
    module = tmp_path / "lpdec" / "mod.py"
    module.write_text('"""Doc."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 1  # one\n')
    (tmp_path / "train.py").write_text("x = 1\n")
    first = experiments.code_fingerprint(tmp_path)
    module.write_text(
        '"""Other doc."""\n\n\ndef f(x):\n    """Other."""\n    return x + 1  # two\n'
    )
    assert experiments.code_fingerprint(tmp_path) == first
    module.write_text('"""Doc."""\n\n\ndef f(x):\n    """Doc."""\n    return x - 1\n')
    assert experiments.code_fingerprint(tmp_path) != first
    module.write_text('"""Doc."""\n\n\ndef f(x):\n    """Doc."""\n    return x + 1\n')
    assert experiments.code_fingerprint(tmp_path) == first
    (tmp_path / "train.py").write_text("x = 2\n")
    assert experiments.code_fingerprint(tmp_path) != first


def fake_training(monkeypatch) -> list:
    """Runner._train replaced by a stub that records each config's learning rate."""
    from bench import experiments

    trained = []

    def fake_train(self, config):
        trained.append(config.learning_rate)
        return {
            "config": json.loads(json.dumps(config.to_dict(), default=str)),
            "seed": config.seed,
            "wall_clock_s": 1.0,
            "final_test_accuracy": config.learning_rate,
        }

    monkeypatch.setattr(experiments.Runner, "_train", fake_train)
    return trained


def test_cached_runs_of_other_code_or_config_are_not_reused(tmp_path, monkeypatch):
    from bench import experiments
    from bench.experiments import cache

    trained = fake_training(monkeypatch)
    runner = experiments.Runner(quick=True, seeds=1, workdir=str(tmp_path))
    runner.repeat("s", "m", experiments.seed002_config)
    runner.repeat("s", "m", experiments.seed002_config)  # cached
    runner.repeat("s", "m", experiments.seed002_config, learning_rate=0.05)  # another config
    assert trained == [0.1, 0.05]
    experiments.Runner(quick=True, seeds=1, workdir=str(tmp_path)).repeat(
        "s", "m", experiments.seed002_config
    )
    assert trained == [0.1, 0.05]  # read back from results.json
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "changed")
    experiments.Runner(quick=True, seeds=1, workdir=str(tmp_path)).repeat(
        "s", "m", experiments.seed002_config
    )
    assert trained == [0.1, 0.05, 0.1]
    with pytest.raises(KeyError, match="learnign_rate"):
        runner.config(experiments.seed002_config, learnign_rate=0.1)


def test_a_run_another_invocation_is_training_is_not_trained_twice(tmp_path, monkeypatch):
    """Invocations sharing a workdir: a run another one holds the claim of (is training)
    is not trained again. --train-only goes on without it; a plain invocation waits and
    takes the other's record; once the claim is let go with no record (its process
    died), the run trains."""
    import threading
    import time

    from bench import experiments
    from bench.experiments import cache
    from bench.experiments import runner

    trained = fake_training(monkeypatch)
    monkeypatch.setattr(runner, "CLAIM_POLL_S", 0.01)
    workdir = str(tmp_path)
    streams = experiments.Runner(quick=True, seeds=1, workdir=workdir)
    streams.train_only = ("m",)
    config = streams.config(experiments.seed002_config, seed=0)
    key = streams.key(config)
    claims = os.path.join(workdir, "claims")
    held, saved = threading.Event(), threading.Event()
    record = {"seed": 0, "wall_clock_s": 1.0, "final_test_accuracy": 0.5, "code": streams.code}

    def other_invocation(save: bool):
        with cache.claim(claims, key) as mine:
            assert mine
            held.set()
            time.sleep(0.3)
            if save:
                cache.save_results(streams.cache_path, {key: record})
                saved.set()

    trainer = threading.Thread(target=other_invocation, args=(True,))
    trainer.start()
    held.wait()
    assert streams.run("s", "m", config) is None  # --train-only: on to the next
    plain = experiments.Runner(quick=True, seeds=1, workdir=workdir)
    assert plain.run("s", "m", config)["final_test_accuracy"] == 0.5  # waited for it
    assert saved.is_set() and trained == []
    trainer.join()

    held.clear()
    config = plain.config(experiments.seed002_config, seed=0, learning_rate=0.05)
    key = plain.key(config)
    died = threading.Thread(target=other_invocation, args=(False,))
    died.start()
    held.wait()
    assert plain.run("s", "m", config)["final_test_accuracy"] == 0.05  # trained once free
    assert trained == [0.05]
    died.join()


def test_published_runs_of_the_same_code_count_as_cached(tmp_path, monkeypatch):
    from bench import experiments
    from bench.experiments import cache

    trained = fake_training(monkeypatch)
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v1")
    first = experiments.Runner(quick=True, seeds=1, workdir=str(tmp_path / "a"))
    (entry,) = first.repeat("s", "m", experiments.seed002_config)
    published = tmp_path / "experiments.json"
    published.write_text(json.dumps({"runs": [entry]}))
    assert trained == [0.1]
    # A fresh workdir (a fresh clone) reads the published run instead of training.
    fresh = experiments.Runner(
        quick=True, seeds=1, workdir=str(tmp_path / "b"), published=str(published)
    )
    (again,) = fresh.repeat("s", "other method", experiments.seed002_config)
    assert trained == [0.1]
    assert again["method"] == "other method" and again["final_test_accuracy"] == 0.1
    # Published runs of other code are stale like any cached run.
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v2")
    experiments.Runner(
        quick=True, seeds=1, workdir=str(tmp_path / "c"), published=str(published)
    ).repeat("s", "m", experiments.seed002_config)
    assert trained == [0.1, 0.1]


def test_keep_published_reuses_earlier_codes_runs_of_the_same_config(tmp_path, monkeypatch):
    """--keep-published: a run of earlier code counts, found by its key, or by its config
    where the config gained fields since at their configs/default.py values; a gained
    field at another value is another run."""
    from bench import experiments
    from bench.experiments import cache

    trained = fake_training(monkeypatch)
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v1")
    workdir = str(tmp_path / "w")
    experiments.Runner(quick=True, seeds=1, workdir=workdir).repeat(
        "s", "m", experiments.seed002_config
    )
    # The run as earlier code recorded it: without a field the config has now.
    path = os.path.join(workdir, "results.json")
    (record,) = json.loads(open(path).read()).values()
    del record["config"]["sync_steps"]
    record["key"] = "the key of the config without the field"
    open(path, "w").write(json.dumps({record["key"]: record}))
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v2")

    def runner(keep):
        return experiments.Runner(quick=True, seeds=1, workdir=workdir, keep_published=keep)

    (kept,) = runner(True).repeat("s", "another label", experiments.seed002_config)
    assert trained == [0.1] and kept["code"] == "v1"
    runner(True).repeat("s", "m", experiments.seed002_config, sync_steps=5)
    assert trained == [0.1, 0.1]  # a gained field away from its default: a new run
    runner(False).repeat("s", "m", experiments.seed002_config)
    assert trained == [0.1, 0.1, 0.1]  # without the flag, earlier code's runs are stale


def test_keep_published_finds_a_run_by_its_listing_when_the_workdir_holds_it_too(
    tmp_path, monkeypatch
):
    """A run whose config changed shape since (a nested field gained a key) is found by
    the study, method and seed docs/experiments.json lists it under, even where the
    workdir's cache holds the same record (which lists neither)."""
    from bench import experiments
    from bench.experiments import cache

    trained = fake_training(monkeypatch)
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v1")
    workdir = str(tmp_path / "w")
    experiments.Runner(quick=True, seeds=1, workdir=workdir).repeat(
        "s", "m", experiments.seed002_config
    )
    path = os.path.join(workdir, "results.json")
    (record,) = json.loads(open(path).read()).values()
    record["config"]["data_dir"] = {"a key the config has no more": 1}
    record["key"] = "the key of the config as it was"
    open(path, "w").write(json.dumps({record["key"]: record}))
    published = tmp_path / "published.json"
    published.write_text(json.dumps({"runs": [dict(record, study="s", method="m")]}))
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v2")
    (kept,) = experiments.Runner(
        quick=True, seeds=1, workdir=workdir, published=str(published), keep_published=True
    ).repeat("s", "m", experiments.seed002_config)
    assert trained == [0.1] and kept["code"] == "v1"


def test_keep_published_finds_a_run_two_studies_list_under_either(tmp_path, monkeypatch):
    """A run docs/experiments.json lists under two studies (the scale study lists the lm
    study's all-reduce) and whose config changed shape since is found by either listing,
    not trained again."""
    from bench import experiments
    from bench.experiments import cache

    trained = fake_training(monkeypatch)
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v1")
    (record,) = experiments.Runner(quick=True, seeds=1, workdir=str(tmp_path / "a")).repeat(
        "lm", "m", experiments.seed002_config
    )
    record["config"]["data_dir"] = {"a key the config has no more": 1}
    record["key"] = "the key of the config as it was"
    listed = [dict(record, study=study) for study in ("lm", "scale")]
    published = tmp_path / "published.json"
    published.write_text(json.dumps({"runs": listed}))
    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v2")
    for study in ("lm", "scale"):
        (kept,) = experiments.Runner(
            quick=True, seeds=1, workdir=str(tmp_path / study), published=str(published),
            keep_published=True,
        ).repeat(study, "m", experiments.seed002_config)  # fmt: skip
        assert kept["code"] == "v1", study
    assert trained == [0.1]


def test_a_dry_run_checks_each_config_and_its_records_never_count_as_trained(tmp_path, monkeypatch):
    import train_lib
    from bench import experiments
    from bench.experiments import cache

    monkeypatch.setattr(cache, "code_fingerprint", lambda root=None: "v1")
    dry = experiments.Runner(quick=True, seeds=1, workdir=str(tmp_path / "dry"), dry_run=True)
    (placeholder,) = dry.repeat("table2", "m", experiments.seed002_config)
    assert placeholder["dry_run"] is True and placeholder["code"] == "dry run (v1)"
    assert not (tmp_path / "dry").exists()  # no cache written, no workdir
    # A config train.py refuses fails its dry run the same way, before any step.
    with pytest.raises(train_lib.ConfigError, match="learning_rate"):
        dry.repeat("table2", "m", experiments.seed002_config, learning_rate=-1.0)

    # A dry run's record is no cached run, in results.json or in experiments.json, even
    # under the code of the trained runs (as an older bench/ would have written it).
    trained = fake_training(monkeypatch)
    marked = dict(placeholder, code="v1")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "results.json").write_text(json.dumps({marked["key"]: marked}))
    published = tmp_path / "published.json"
    published.write_text(json.dumps({"runs": [marked]}))
    runner = experiments.Runner(
        quick=True, seeds=1, workdir=str(tmp_path / "w"), published=str(published)
    )
    runner.repeat("gamma", "m", experiments.seed002_config)
    assert trained == [0.1]

    # Dry runs never share an experiments.json with trained runs: a file of trained
    # runs refuses them, and trained runs published over a dry run's file drop it.
    real_file, dry_file = str(tmp_path / "real.json"), str(tmp_path / "dry.json")
    cache.publish(real_file, "v1", runner.entries, ("gamma",))
    with pytest.raises(SystemExit, match="holds trained runs"):
        cache.publish(real_file, dry.code, dry.entries, ("table2",), dry_run=True)
    cache.publish(dry_file, dry.code, dry.entries, ("table2",), dry_run=True)
    assert json.loads(open(dry_file).read())["dry_run"] is True
    cache.publish(dry_file, "v1", runner.entries, ("gamma",))
    data = json.loads(open(dry_file).read())
    assert "dry_run" not in data and [r["study"] for r in data["runs"]] == ["gamma"]


def test_collapsed_runs_are_named_and_traced_to_the_norm_layer():
    from bench import experiments

    # Best 89%, ends at 41%: 48 points lost (a Table 2 torus run did this).
    fell = {"curve": [[200, 0.77, 0.4], [800, 0.89, 0.0], [2000, 0.41, 0.7]]}
    fell["final_test_accuracy"] = 0.41
    steady = {"curve": [[200, 0.77, 0.4], [2000, 0.95, 0.0]], "final_test_accuracy": 0.95}
    assert experiments.collapse(fell) == pytest.approx(48.0)
    assert experiments.collapse(steady) == pytest.approx(0.0)
    ranged_32, ranged_8 = "32-bit, Range EvoNorm", "8-bit, Range EvoNorm (T2)"
    both = {("torus", ranged_32): [2], ("torus", ranged_8): [2], ("ring", ranged_8): []}
    assert "torus: seed 2" in experiments.collapses(both)
    assert "ring" not in experiments.collapses(both)
    assert "at 32 bits as well as at 8" in experiments.norm_collapses(both)
    only_8 = {("torus", ranged_8): [2]}
    assert "Range EvoNorm;" in experiments.norm_collapses(only_8)
    # A collapse with EvoNorm (not Range) does not point at the norm layer.
    assert experiments.norm_collapses({**both, ("torus", "8-bit, EvoNorm"): [1]}) == ""
    assert experiments.norm_collapses({("torus", ranged_8): []}) == ""
    assert "No run" in experiments.collapses({("torus", ranged_8): []})


def test_the_scale_batch_sweep_runs_every_batch_it_ranks(monkeypatch):
    """The scale study's batch sweep, on a made-up loss that keeps falling as the batch
    shrinks: the winning edge grows twice (x0.25, then x0.125), every batch it ranks has
    its run, and the smallest is each side's best: 3 seeds, then 8 machines there. (The
    third round once appended x0.0625 without running it, so no batch was ever best.)"""
    from bench.experiments import scale

    def fake_seeds(runner, name, fields, count=3, base=None, study=None):
        factor = base(False).batch_size / 8  # lm_tiny's 8 windows a worker
        value = 2.0 + factor + (0.1 if name.startswith("DiLoCo") else 0.0)
        runs.append((name, factor, count, fields.get("machines")))
        return [{"final_val_bits_per_byte": value, "diverged": False}] * count

    runs: list = []
    monkeypatch.setattr(scale, "seeds", fake_seeds)
    at_one = [{"final_val_bits_per_byte": 3.0, "diverged": False}]
    out = {"muon allreduce": at_one, "muon diloco": at_one}
    setting = scale.at(4, 10, optimizer="muon", learning_rate=0.01, outer_momentum=0.8)
    scale.batch_runs(
        types.SimpleNamespace(quick=False), out, {"learning_rate": 0.02}, setting,
        {"optimizer": "muon"}, lambda grid: grid, {"study": "scale"},
    )  # fmt: skip
    assert out["batch factors"] == [0.125, 0.25, 0.5, 2.0]
    ranked = {(name.startswith("DiLoCo"), factor) for name, factor, _, _ in runs}
    assert ranked >= {(kind, f) for kind in (False, True) for f in out["batch factors"]}
    assert out["batch allreduce best factor"] == out["batch diloco best factor"] == 0.125
    assert (0.125, 3, 8) in {(factor, count, machines) for _, factor, count, machines in runs}


@pytest.mark.parametrize("best_h, eight_h", [(20, 20), (5, 10)])
def test_the_scale_retune_keeps_what_beats_the_recipe(best_h, eight_h):
    """The scale study's re-tune at the best batch, on a made-up loss (a bowl in each
    field, separable) whose minimum lies at outer lr 1.0, the recipe's momentum and
    rate, and H=`best_h`: the outer lr's winning edge is extended (1.4 then loses), H's
    top edge doubled while it wins, the two winners run together and that (the bowl's
    best point) goes to 3 seeds at 4 machines, at 8, where H stays at least 10 (the
    byte budget), and at 2; the all-reduce's rate, best at 0.04, goes to 3 seeds too."""
    from bench.experiments import scale

    def loss(config) -> float:
        if config["algorithm"] == "allreduce":
            return 2.0 + abs(math.log2(config["learning_rate"] / 0.04))
        h = config["local_steps"]
        return (
            2.1
            + (config["outer_lr"] - 1.0) ** 2
            + (config["outer_momentum"] - 0.8) ** 2
            + abs(math.log2(config["learning_rate"] / 0.01))
            + 0.01 * abs(math.log2(h / best_h))
        )

    runs: list = []

    class Runner:
        quick = False

        def config(self, base, seed, **fields):
            return dict(fields, seed=seed, batch_size=base(False).batch_size)

        def run(self, study, name, config, optional=False):
            runs.append((name, config))
            return {"final_val_bits_per_byte": loss(config), "diverged": False}

    setting = scale.at(4, 10, optimizer="muon", learning_rate=0.01, outer_momentum=0.8)
    ar = dict(scale.ALLREDUCE, optimizer="muon", learning_rate=0.02, muon_beta=0.9)
    recipe = [{"final_val_bits_per_byte": loss(setting), "diverged": False}]
    out = {"batch x0.125 diloco": recipe}
    scale.retune(Runner(), out, setting, ar, 0.125, 0.125, lambda g: g, {"study": "scale"})
    assert {c["outer_lr"] for _, c in runs if c["algorithm"] == "diloco"} >= {0.5, 0.7, 1.0, 1.4}
    swept_h = {c["local_steps"] for _, c in runs if c["algorithm"] == "diloco"}
    assert swept_h == ({5, 10, 20, 40} if best_h == 20 else {5, 10, 20})
    assert out["retune best from"] == "together"
    assert len(out["retune best"]) == 3 and len(out["retune 8 machines"]) == 3
    fours = [c for n, c in runs if "on 4 machines" in n and c["seed"] == 2]
    assert fours and fours[-1]["outer_lr"] == 1.0 and fours[-1]["local_steps"] == best_h
    assert fours[-1]["outer_warmup_rounds"] == scale.WARMUP_STEPS // best_h
    eights = [c for n, c in runs if "on 8 machines" in n]
    assert {c["seed"] for c in eights} == {0, 1, 2}
    assert all(c["machines"] == 8 and c["outer_lr"] == 1.0 for c in eights)
    assert all(c["local_steps"] == eight_h for c in eights)
    twos = [c for n, c in runs if "on 2 machines" in n]  # the summary's 2-machine best
    assert {c["seed"] for c in twos} == {0, 1, 2} and len(out["retune 2 machines"]) == 3
    assert all(c["machines"] == 2 and c["local_steps"] == best_h for c in twos)
    assert all(c["batch_size"] == 1 for _, c in runs)  # x0.125 of lm_tiny's 8 windows
    tuned_ar = [c for n, c in runs if c["algorithm"] == "allreduce" and c["seed"] == 2]
    assert tuned_ar and tuned_ar[-1]["learning_rate"] == 0.04
    assert tuned_ar[-1]["muon_beta"] == 0.9


def test_the_scale_retune_runs_the_recipe_at_2_machines_when_it_wins_every_sweep():
    """A bowl centred on the recipe (outer 0.7 / 0.8, Muon 0.01, H=10): no sweep has a
    winner, so no 3-seed or 8-machine runs, and the recipe itself goes to 2 machines."""
    from bench.experiments import scale

    def loss(config) -> float:
        return (
            2.1
            + (config["outer_lr"] - 0.7) ** 2
            + (config["outer_momentum"] - 0.8) ** 2
            + abs(math.log2(config["learning_rate"] / 0.01))
            + 0.01 * abs(math.log2(config["local_steps"] / 10))
        )

    runs: list = []

    class Runner:
        quick = False

        def config(self, base, seed, **fields):
            return dict(fields, seed=seed)

        def run(self, study, name, config, optional=False):
            runs.append((name, config))
            value = loss(config) if config["algorithm"] == "diloco" else 2.0
            return {"final_val_bits_per_byte": value, "diverged": False}

    setting = scale.at(4, 10, optimizer="muon", learning_rate=0.01, outer_momentum=0.8)
    ar = dict(scale.ALLREDUCE, optimizer="muon", learning_rate=0.02, muon_beta=0.9)
    out = {"batch x0.125 diloco": [{"final_val_bits_per_byte": 2.1, "diverged": False}]}
    scale.retune(Runner(), out, setting, ar, 0.125, 0.125, lambda g: g, {"study": "scale"})
    assert "retune best" not in out and "retune 8 machines" not in out
    twos = [c for n, c in runs if "on 2 machines" in n]
    assert len(twos) == 3 and all(c == dict(setting, machines=2, seed=c["seed"]) for c in twos)
