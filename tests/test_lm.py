"""The language-model workload through train.py: configs/lm_tiny.py, its data, its errors."""

import csv
import math
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train_lib  # noqa: E402
from configs import lm_tiny  # noqa: E402
from train_lib import ConfigError  # noqa: E402
from train_lib import setup  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def config(**overrides):
    c = lm_tiny.get_config()
    for key, value in overrides.items():
        setattr(c, key, value)
    return c


def _rows(workdir):
    with open(pathlib.Path(workdir) / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _counting_averages(monkeypatch):
    """The calls of train.py's `average` program on the parameters, from now on: a list
    that grows by one per averaging of the models."""
    from train_lib import steps

    calls = []
    make_programs = steps.make_programs

    def counting(*args, **kwargs):
        programs = make_programs(*args, **kwargs)
        average = programs["average"]

        def counted(tree):
            if jax.tree.leaves(tree):  # the parameters (the transformer has no model state)
                calls.append(1)
            return average(tree)

        return dict(programs, average=counted)

    monkeypatch.setattr(steps, "make_programs", counting)
    return calls


def lm_tiny_run(shared_run):
    """configs/lm_tiny.py as CI runs it, trained once per test run: (workdir, summary,
    how many times the evaluation averaged the models)."""

    def make(directory):
        with pytest.MonkeyPatch.context() as monkeypatch:
            calls = _counting_averages(monkeypatch)
            summary = train_lib.train_and_evaluate(config(), str(directory))
        return summary, len(calls)

    workdir, (summary, averages) = shared_run("lm_tiny", make)
    return workdir, summary, averages


def test_lm_tiny_learns_the_bytes_of_the_standard_library(shared_run):
    """The config as CI runs it: the machines' model ends far below a uniform guess (8
    bits per byte) and below where it started, with the metrics a user reads."""
    workdir, summary, _ = lm_tiny_run(shared_run)
    rows = _rows(workdir)
    assert [int(r["step"]) for r in rows] == [20, 40, 60, 80, 100]
    bpb = [r["val_bits_per_byte_avg_model"] for r in rows]
    assert bpb[-1] < 5.0 and bpb[-1] < bpb[0], bpb
    last = rows[-1]
    # Bits per byte is the loss in nats over ln 2 (a byte is one token).
    assert last["val_bits_per_byte_avg_model"] == pytest.approx(
        last["val_loss_avg_model"] / math.log(2)
    )
    assert 0 < last["val_accuracy_avg_model"] < 1
    assert last["tokens_per_s_per_machine"] > 0
    assert not summary["diverged"] and summary["steps"] == 100


def test_the_sharded_language_model_lands_where_the_replicated_one_lands(tmp_path):
    """lm_tiny's transformer with DiLoCo and a full-precision mean, 2 rounds of 2 local
    steps: the machines' models split over their workers equal the replicated run's to
    float32 rounding. (Every step and exchange of the sharded run is the sharded program;
    lm_tiny's 2 rounds of 10 steps only ran the same programs longer.)

    With SGD: the key projection's bias has a gradient of exactly 0 in exact arithmetic
    (it shifts every logit of a query alike), so what it receives is rounding noise,
    which Adam's g / sqrt(v) scales up to full-size steps in either run differently."""
    common = dict(
        num_steps=4,
        local_steps=2,
        exchange="mean",
        error_feedback=False,
        save_final_params=True,
        optimizer="sgd",
        learning_rate=0.3,
    )
    finals = {}
    for name, sharded in (("replicated", False), ("sharded", True)):
        train_lib.train_and_evaluate(config(shard_model=sharded, **common), str(tmp_path / name))
        with np.load(tmp_path / name / "final_params.npz") as f:
            finals[name] = {k: f[k] for k in f.files}
    for name, whole in finals["replicated"].items():
        np.testing.assert_allclose(
            finals["sharded"][name], whole[[0, 4]], rtol=0, atol=2e-6, err_msg=name
        )


def test_a_skewed_split_gives_the_nodes_different_packages():
    """skew=1 sorts the windows by their file's package: the 8 nodes' windows come from
    (nearly) disjoint packages; skew=0 mixes every package into every node."""
    groups = {}
    for skew in (0.0, 1.0):
        experiment = train_lib.build(config(skew=skew))
        labels = experiment.dataset.y_train
        groups[skew] = [set(labels[p].tolist()) for p in experiment.partitions]
    shared = lambda sets: len(set.intersection(*sets))  # noqa: E731
    assert shared(groups[0.0]) > 10
    # Sorted by package, two nodes share at most the package at their boundary.
    for a, b in zip(groups[1.0], groups[1.0][1:], strict=False):
        assert len(a & b) <= 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(data_dir="/nonexistent/lpdec"), "config.data_dir='/nonexistent/lpdec' is not a"),
        (dict(model="mlp"), r"the language model \('transformer'\) trains on text"),
        (dict(sequence_length=0), "config.sequence_length=0 must be a positive integer"),
        (dict(text_bytes=-1), "config.text_bytes=-1 must be an integer >= 0"),
        (dict(sequence_length=128), "config.model='transformer' with config.model_kwargs"),
        (dict(mean_rounds=3), "config.mean_rounds=3 must be 2"),
        (dict(exchange="mean", error_feedback=False, error_decay=0.9), "needs config.exchange="),
        (dict(error_feedback=False, error_decay=0.9), "below 1 only with config.error_feedback"),
        (
            dict(algorithm="allreduce", local_steps=1, error_feedback=False, mean_rounds=1),
            "config.mean_rounds=1 needs config.algorithm='diloco'",
        ),
    ],
)
def test_bad_language_model_input_is_one_line_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        train_lib.train_and_evaluate(config(**overrides), str(tmp_path))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "metrics.csv").exists()


def test_a_corpus_too_small_for_a_window_is_one_line(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):  # enough files that both sides of the split get some
        (corpus / f"m{i}.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="fewer than one window") as info:
        train_lib.train_and_evaluate(config(data_dir=str(corpus)), str(tmp_path / "run"))
    assert "\n" not in str(info.value)


def test_sharding_holds_a_quarter_of_the_state_and_a_model_too_big_is_refused(monkeypatch):
    """Per device, lm_tiny's parameters + Adam + DiLoCo's anchor and momentum + error
    feedback, sharded over 4 workers, are at most 1.1 x a quarter of the replicated
    twin's; with less device memory than that estimate, the run stops at start in one
    line saying what would fit."""
    held = {}
    # Replicated: every worker holds the whole model and everything beside it (no
    # machines axis; the hierarchical twin already splits its error feedback over the
    # workers, which would flatter the ratio).
    variants = {False: dict(shard_model=False, hierarchical=False, machines=0), True: {}}
    for sharded, overrides in variants.items():
        experiment = train_lib.build(config(**overrides))
        shapes = jax.eval_shape(
            lambda e=experiment: e.model.init(
                jax.random.key(0), setup.example_input(e.dataset), train=False
            )
        )["params"]
        held[sharded], _ = setup.memory_estimate(
            shapes, experiment.tx, experiment.layout, experiment.shard_plan
        )
    assert held[True] <= 1.1 * held[False] / 4, held
    monkeypatch.setattr(setup, "device_memory_bytes", lambda: held[True])
    with pytest.raises(ConfigError, match="more workers .* or choose a smaller model") as info:
        train_lib.build(config())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("algorithm, averages", [("diloco", 0), ("allreduce", 0), ("dpsgd", 1 + 2)])
def test_evaluation_averages_the_models_at_most_once_per_log_interval(
    tmp_path, monkeypatch, shared_run, algorithm, averages
):
    """DiLoCo logging at its exchanges evaluates its anchor and the all-reduce each
    node's own model (the same bits everywhere): no model is averaged, nothing crosses
    the link; gossip averages the models once per log interval (and once before the
    first step, compiling the evaluation), shared by every metric.

    DiLoCo is lm_tiny as CI runs it (5 log intervals of 2 rounds each), counted in the
    run test_lm_tiny_learns_the_bytes_of_the_standard_library reads; the others run 2 log
    intervals of 2 steps each (the count depends on the intervals, not their length).
    Gossip is D-PSGD: the evaluation sees only that the algorithm is neither DiLoCo nor
    a mean (setup.LoopPlan), so every gossip method takes this path; CHOCO's sharded
    LM programs, which cost twice D-PSGD's to compile, are test_train_sharded's."""
    if algorithm == "diloco":
        assert lm_tiny_run(shared_run)[2] == averages
        return
    calls = _counting_averages(monkeypatch)
    overrides = dict(num_steps=4, log_every=2, checkpoint_every=4, algorithm=algorithm)
    overrides.update(local_steps=1, error_feedback=False)
    train_lib.train_and_evaluate(config(**overrides), str(tmp_path))
    assert len(calls) == averages


def test_sparseloco_trains_the_language_model(tmp_path):
    """SparseLoCo's exchange through train.py: top-64/4096 2-bit payloads all-gathered
    and averaged, the residual decayed by 0.95, a plain outer step: 20 steps (2 rounds)
    leave a finite model below a uniform guess."""
    overrides = dict(
        num_steps=20,
        compressor="chunked_top_k",
        ratio=64 / 4096,
        bits=2,
        chunk_size=4096,
        mean_rounds=1,
        error_decay=0.95,
        outer_momentum=0.0,
        outer_lr=1.0,
    )
    summary = train_lib.train_and_evaluate(config(**overrides), str(tmp_path))
    final = summary["final"]
    assert not summary["diverged"] and final["nonfinite_updates"] == 0
    assert final["val_bits_per_byte_avg_model"] < 7.0
