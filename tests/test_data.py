"""Tests for lpdec.data: skew partitions, offline data sets, per-node batching."""

import math
import os
import socket
from decimal import Decimal

import jax
import numpy as np
import pytest

from lpdec import data

NUM_CLASSES = 10
CLASS_SIZE = 5000


@pytest.fixture(scope="module")
def cifar_labels():
    """CIFAR-10-shaped training labels: 10 classes x 5000, in shuffled order."""
    labels = np.repeat(np.arange(NUM_CLASSES), CLASS_SIZE)
    return np.random.default_rng(1234).permutation(labels)


def _reference_assignment(labels, num_nodes, skew):
    """Which node must hold each *sorted-pool* sample, written from the definition.

    Walks the labels once in index order, giving each sample its rank within its
    class; a sample is in the sorted pool when its rank is below
    floor(skew * class size), and its place in the pool is the number of
    sorted-pool samples of smaller classes plus its rank. Node k holds pool
    places [k * a, (k + 1) * a) with a = floor(N * skew / n).

    Returns (owner, in_sorted_pool): owner[i] is the node for sorted-pool samples
    (-1 for pool samples left over and for random-pool samples).
    """
    skew_d = Decimal(str(skew))
    counts = {}
    rank = np.empty(len(labels), np.int64)
    for i, label in enumerate(labels.tolist()):
        rank[i] = counts.get(label, 0)
        counts[label] = rank[i] + 1
    sorted_sizes = {c: int(skew_d * n_c) for c, n_c in counts.items()}
    pool_offset = {}
    offset = 0
    for c in sorted(counts):
        pool_offset[c] = offset
        offset += sorted_sizes[c]
    per_node = int(len(labels) * skew_d / num_nodes)
    owner = np.full(len(labels), -1)
    in_pool = np.zeros(len(labels), bool)
    for i, label in enumerate(labels.tolist()):
        if rank[i] < sorted_sizes[label]:
            in_pool[i] = True
            place = pool_offset[label] + rank[i]
            if per_node and place < num_nodes * per_node:
                owner[i] = place // per_node
    return owner, in_pool


# ---------------------------------------------------------------- partition


@pytest.mark.parametrize("skew", [0.0, 0.4, 0.8, 0.9, 1.0])
def test_partition_sizes_cifar(cifar_labels, skew):
    parts = data.skew_partition(cifar_labels, num_nodes=8, skew=skew, seed=0)
    # 50,000 / 8 splits exactly into floor(N s / n) + floor(N (1 - s) / n) = 6250.
    assert [len(p) for p in parts] == [6250] * 8
    assert all(p.dtype == np.int64 for p in parts)
    everything = np.concatenate(parts)
    assert len(np.unique(everything)) == 50_000


def test_partition_iid_is_uniform(cifar_labels):
    parts = data.skew_partition(cifar_labels, num_nodes=8, skew=0.0, seed=3)
    hist = data.class_histogram(cifar_labels, parts, NUM_CLASSES)
    # Every sample is used once, so the margins are exact.
    np.testing.assert_array_equal(hist.sum(axis=0), [CLASS_SIZE] * NUM_CLASSES)
    np.testing.assert_array_equal(hist.sum(axis=1), [6250] * 8)
    # A random split of a balanced set: the 8x10 table's chi-square statistic
    # against 625 per cell follows chi2 with 63 degrees of freedom. Both tails at
    # 1e-6 (scipy.stats.chi2 quantiles): too large is skew, too small is a
    # deterministic (e.g. strided) split rather than a shuffle.
    chi_square = ((hist - 625.0) ** 2 / 625.0).sum()
    assert 23.16 < chi_square < 131.37, chi_square
    assert np.abs(hist - 625).max() < 150


def test_partition_skew_one_histogram_by_hand(cifar_labels):
    parts = data.skew_partition(cifar_labels, num_nodes=8, skew=1.0, seed=0)
    # Node k holds places [6250 k, 6250 (k + 1)) of the label-sorted set, whose
    # classes are blocks of 5000.
    expected = np.zeros((8, 10), np.int64)
    for k in range(8):
        for place in range(6250 * k, 6250 * (k + 1)):
            expected[k, place // 5000] += 1
    np.testing.assert_array_equal(data.class_histogram(cifar_labels, parts, 10), expected)
    assert expected[0].tolist() == [5000, 1250, 0, 0, 0, 0, 0, 0, 0, 0]
    assert expected[1].tolist() == [0, 3750, 2500, 0, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize(
    "num_nodes,skew", [(8, 0.8), (8, 0.9), (8, 0.4), (7, 0.8), (16, 0.9), (8, 1.0), (2, 0.29)]
)
def test_partition_matches_reference(cifar_labels, num_nodes, skew):
    parts = data.skew_partition(cifar_labels, num_nodes=num_nodes, skew=skew, seed=11)
    owner, in_pool = _reference_assignment(cifar_labels, num_nodes, skew)
    per_node_random = int(len(cifar_labels) * (1 - Decimal(str(skew))) / num_nodes)
    held = np.full(len(cifar_labels), -1)
    for k, part in enumerate(parts):
        assert np.all(held[part] == -1), "partitions overlap"
        held[part] = k
        # The sorted-pool share is exactly the reference's; the rest comes from
        # the random pool, floor(N (1 - s) / n) of it.
        np.testing.assert_array_equal(np.sort(part[in_pool[part]]), np.flatnonzero(owner == k))
        assert np.count_nonzero(~in_pool[part]) == per_node_random
    # Leftovers (pool samples beyond the last node) are held by nobody.
    assert np.all(held[in_pool & (owner == -1)] == -1)


def test_partition_skew_08_histogram(cifar_labels):
    parts = data.skew_partition(cifar_labels, num_nodes=8, skew=0.8, seed=0)
    hist = data.class_histogram(cifar_labels, parts, 10)
    # Sorted pool: 4000 per class in label order; node k takes places
    # [5000 k, 5000 (k + 1)). Random pool: 1000 per class, 1250 per node.
    sorted_share = np.zeros((8, 10), np.int64)
    for k in range(8):
        for c in range(10):
            lo, hi = max(5000 * k, 4000 * c), min(5000 * (k + 1), 4000 * (c + 1))
            sorted_share[k, c] = max(hi - lo, 0)
    random_share = hist - sorted_share
    assert random_share.min() >= 0
    np.testing.assert_array_equal(random_share.sum(axis=1), [1250] * 8)
    np.testing.assert_array_equal(random_share.sum(axis=0), [1000] * 10)
    assert hist[0, 0] >= 4000 and hist[0, 1] >= 1000


def test_partition_leftovers_dropped(cifar_labels):
    # n = 7, s = 0.8: floor(40000 / 7) = 5714 sorted + floor(10000 / 7) = 1428
    # random per node; 40000 - 39998 = 2 sorted and 4 random samples are left.
    parts = data.skew_partition(cifar_labels, num_nodes=7, skew=0.8, seed=0)
    assert [len(p) for p in parts] == [7142] * 7
    used = np.concatenate(parts)
    assert len(np.unique(used)) == 49_994
    unused = np.setdiff1d(np.arange(50_000), used)
    # The two sorted leftovers are the last two class-9 samples of its pool
    # (class-9 ranks 3998 and 3999).
    class9 = np.flatnonzero(cifar_labels == 9)
    assert set(class9[[3998, 3999]]) <= set(unused)


def test_partition_exact_decimal_skew():
    labels = np.repeat(np.arange(10), 5000)
    # In floating point 0.29 * 50000 / 2 is just below 7250.
    assert math.floor(0.29 * 50000 / 2) == 7249
    parts = data.skew_partition(labels, num_nodes=2, skew=0.29, seed=0)
    # 7250 sorted + 17750 random each: all 50000 samples are used.
    assert [len(p) for p in parts] == [25_000] * 2


@pytest.mark.parametrize(
    "sizes,num_nodes,skew",
    [
        ([7, 30, 2, 11], 3, 0.5),
        ([7, 30, 2, 11], 4, 0.9),
        # Classes of one sample: the sorted pool is empty although floor(N s / n) = 2.
        ([1] * 10, 2, 0.5),
    ],
)
def test_partition_uneven_classes(sizes, num_nodes, skew):
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(len(sizes)), sizes))
    owner, in_pool = _reference_assignment(labels, num_nodes, skew)
    per_node_random = int(len(labels) * (1 - Decimal(str(skew))) / num_nodes)
    parts = data.skew_partition(labels, num_nodes=num_nodes, skew=skew, seed=5)
    assert len(np.unique(np.concatenate(parts))) == sum(len(p) for p in parts)
    for k, part in enumerate(parts):
        np.testing.assert_array_equal(np.sort(part[in_pool[part]]), np.flatnonzero(owner == k))
        assert np.count_nonzero(~in_pool[part]) == per_node_random


def test_partition_deterministic(cifar_labels):
    a = data.skew_partition(cifar_labels, 8, 0.8, seed=4)
    b = data.skew_partition(cifar_labels, 8, 0.8, seed=4)
    c = data.skew_partition(cifar_labels, 8, 0.8, seed=5)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(a, c, strict=True))
    # Skew 1 has no random pool, so the seed plays no part.
    for x, y in zip(
        data.skew_partition(cifar_labels, 8, 1.0, seed=1),
        data.skew_partition(cifar_labels, 8, 1.0, seed=2),
        strict=True,
    ):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize(
    "labels,num_nodes,skew,match",
    [
        (np.zeros(10, int), 2, -0.1, "skew"),
        (np.zeros(10, int), 2, 1.5, "skew"),
        (np.zeros(10, int), 2, float("nan"), "skew"),
        (np.zeros(10, int), 0, 0.5, "num_nodes"),
        (np.zeros(10, int), 11, 0.5, "num_nodes"),
        (np.zeros(10, int), 2.0, 0.5, "num_nodes"),
        (np.zeros((5, 2), int), 2, 0.5, "labels"),
        (np.zeros(10, np.float32), 2, 0.5, "labels"),
        (np.zeros(3, int), 3, 0.5, "no samples"),
    ],
)
def test_partition_bad_arguments(labels, num_nodes, skew, match):
    with pytest.raises(ValueError, match=match):
        data.skew_partition(labels, num_nodes, skew, seed=0)


def test_class_histogram():
    labels = np.array([0, 1, 1, 2, 2, 2])
    hist = data.class_histogram(labels, [np.array([0, 3]), np.array([1, 2, 4, 5])], 4)
    np.testing.assert_array_equal(hist, [[1, 0, 1, 0], [0, 2, 2, 0]])
    with pytest.raises(ValueError, match="num_classes"):
        data.class_histogram(labels, [np.arange(6)], 2)


# ---------------------------------------------------------------- data sets


def test_digits():
    from sklearn.datasets import load_digits

    ds = data.digits()
    assert ds.name == "digits" and ds.num_classes == 10
    assert ds.x_train.shape == (1438, 64) and ds.x_test.shape == (359, 64)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
    assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    # Stratified: each class contributes round(0.2 * its size) test samples.
    raw = load_digits()
    per_class = np.bincount(raw.target)
    np.testing.assert_array_equal(np.bincount(ds.y_test), np.round(0.2 * per_class))
    np.testing.assert_array_equal(np.bincount(ds.y_train) + np.bincount(ds.y_test), per_class)
    # Together the splits are the whole set (as a multiset of (row, label)).
    ours = np.c_[np.concatenate([ds.x_train, ds.x_test]) * 16, np.r_[ds.y_train, ds.y_test]]
    theirs = np.c_[raw.data, raw.target]
    np.testing.assert_array_equal(
        ours[np.lexsort(ours.T[::-1])], theirs[np.lexsort(theirs.T[::-1])]
    )
    again = data.digits()
    np.testing.assert_array_equal(ds.x_train, again.x_train)
    assert not np.array_equal(ds.y_test, data.digits(seed=1).y_test)


def test_mnist1d_matches_reference_generator(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("mnist1d tried to open a connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    global_state = np.random.get_state()[1].copy()  # noqa: NPY002
    files_before = set(os.listdir("."))
    ds = data.mnist1d()
    # Unlike the mnist1d package: no global seeding, no cache file in the cwd.
    np.testing.assert_array_equal(np.random.get_state()[1], global_state)  # noqa: NPY002
    assert set(os.listdir(".")) == files_before
    assert ds.name == "mnist1d" and ds.num_classes == 10
    assert ds.x_train.shape == (4000, 40) and ds.x_test.shape == (1000, 40)
    assert ds.x_train.dtype == np.float32 and ds.y_test.dtype == np.int32
    # Values of mnist1d 0.0.2.post1's make_dataset(get_dataset_args()) (seed 42),
    # the canonical data set, printed once from that package.
    np.testing.assert_allclose(
        ds.x_train[0, :6],
        [-0.3320056674, -0.4719103657, -0.7786970763, -1.0097408265, -0.8823525654, 0.1039348126],
        atol=1e-6,
    )
    np.testing.assert_allclose(
        ds.x_test[-1, -4:], [0.4472328851, 0.6598756471, 0.8777343498, 1.1931518368], atol=1e-6
    )
    assert ds.y_train[:10].tolist() == [2, 6, 4, 5, 6, 6, 6, 0, 3, 1]
    assert ds.y_test[-10:].tolist() == [8, 3, 3, 6, 1, 2, 5, 9, 6, 4]
    everything = np.concatenate([ds.x_train, ds.x_test])
    assert abs(everything.mean()) < 1e-5 and abs(everything.std() - 1) < 1e-5
    np.testing.assert_array_equal(
        np.bincount(np.r_[ds.y_train, ds.y_test], minlength=10), [500] * 10
    )


def test_mnist1d_class_structure():
    ds = data.mnist1d(num_samples=2000, seed=3)
    x = np.concatenate([ds.x_train, ds.x_test])
    y = np.concatenate([ds.y_train, ds.y_test])
    # Nearest template under translation and a few dilations (normalised
    # correlation of each template with every window): far above chance (0.1).
    score = np.full((len(x), 10), -np.inf)
    for width in (8, 9, 10):
        grid = np.linspace(0, 1, width)
        templates = np.stack(
            [np.interp(grid, np.linspace(0, 1, 12), t) for t in data.mnist1d_templates()]
        )
        templates -= templates.mean(axis=1, keepdims=True)
        templates /= np.linalg.norm(templates, axis=1, keepdims=True)
        for start in range(40 - width + 1):
            window = x[:, start : start + width]
            window = window - window.mean(axis=1, keepdims=True)
            corr = window @ templates.T / (np.linalg.norm(window, axis=1, keepdims=True) + 1e-9)
            score = np.maximum(score, corr)
    assert (score.argmax(axis=1) == y).mean() > 0.5
    # ...while a linear classifier stays weak, as in the paper (logistic
    # regression 32%): the random translations are really there.
    design = np.c_[ds.x_train, np.ones(len(ds.x_train))]
    weights = np.linalg.lstsq(design, np.eye(10)[ds.y_train], rcond=None)[0]
    linear = (np.c_[ds.x_test, np.ones(len(ds.x_test))] @ weights).argmax(axis=1)
    assert 0.12 < (linear == ds.y_test).mean() < 0.45


def test_mnist1d_seed_and_arguments():
    a = data.mnist1d(num_samples=200, seed=1)
    b = data.mnist1d(num_samples=200, seed=1)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.x_train.shape == (160, 40) and a.x_test.shape == (40, 40)
    assert not np.array_equal(a.x_train, data.mnist1d(num_samples=200, seed=2).x_train)
    with pytest.raises(ValueError, match="multiple of 10"):
        data.mnist1d(num_samples=105)


def _write_cifar(directory, rng, records=2):
    """Writes fake CIFAR-10 binary files; returns {file name: raw records}."""
    directory.mkdir(parents=True, exist_ok=True)
    written = {}
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for name in names:
        raw = rng.integers(0, 256, size=(records, 3073), dtype=np.uint8)
        raw[:, 0] = rng.integers(0, 10, size=records)
        (directory / name).write_bytes(raw.tobytes())
        written[name] = raw
    return written


def test_cifar10_reader_layout(tmp_path):
    written = _write_cifar(tmp_path, np.random.default_rng(0))
    ds = data.cifar10(tmp_path)
    assert ds.name == "cifar10" and ds.num_classes == 10
    assert ds.x_train.shape == (10, 32, 32, 3) and ds.x_test.shape == (2, 32, 32, 3)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
    train_raw = np.concatenate([written[f"data_batch_{i}.bin"] for i in range(1, 6)])
    np.testing.assert_array_equal(ds.y_train, train_raw[:, 0])
    np.testing.assert_array_equal(ds.y_test, written["test_batch.bin"][:, 0])
    # Byte 1 + c * 1024 + h * 32 + w of a record is channel c, row h, column w.
    mean = [0.4914, 0.4822, 0.4465]
    std = [0.2023, 0.1994, 0.2010]
    record = written["test_batch.bin"][1]
    for c, h, w in [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 5, 7), (2, 31, 31), (2, 0, 31)]:
        expected = (record[1 + c * 1024 + h * 32 + w] / 255.0 - mean[c]) / std[c]
        assert ds.x_test[1, h, w, c] == pytest.approx(expected, abs=1e-5)
    red_plane = record[1:1025].reshape(32, 32) / 255.0
    np.testing.assert_allclose(ds.x_test[1, :, :, 0], (red_plane - mean[0]) / std[0], atol=1e-5)


def test_cifar10_reader_subfolder_and_errors(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere") as err:
        data.cifar10(missing)
    assert "data_batch_1.bin" in str(err.value) and "cifar-10-binary.tar.gz" in str(err.value)

    _write_cifar(tmp_path / "cifar-10-batches-bin", np.random.default_rng(1))
    assert data.cifar10(tmp_path).x_train.shape == (10, 32, 32, 3)

    (tmp_path / "cifar-10-batches-bin" / "test_batch.bin").unlink()
    with pytest.raises(FileNotFoundError, match="test_batch.bin"):
        data.cifar10(tmp_path)

    _write_cifar(tmp_path / "other", np.random.default_rng(2))
    (tmp_path / "other" / "data_batch_3.bin").write_bytes(b"\x00" * 3000)
    with pytest.raises(ValueError, match="3073"):
        data.cifar10(tmp_path / "other")


def test_synthetic_and_load():
    ds = data.load("synthetic", num_samples=400, num_features=8, num_classes=4, seed=2)
    assert ds.x_train.shape == (320, 8) and ds.x_test.shape == (80, 8)
    np.testing.assert_array_equal(np.bincount(ds.y_test), [20] * 4)
    same = data.synthetic(num_samples=400, num_features=8, num_classes=4, seed=2)
    np.testing.assert_array_equal(ds.x_test, same.x_test)
    # Learnable: nearest class mean of the training split.
    centres = np.stack([ds.x_train[ds.y_train == c].mean(axis=0) for c in range(4)])
    guess = ((ds.x_test[:, None] - centres) ** 2).sum(axis=-1).argmin(axis=1)
    assert (guess == ds.y_test).mean() > 0.8
    with pytest.raises(ValueError, match="cifar10, digits, mnist1d, synthetic"):
        data.load("mnist")


# ---------------------------------------------------------------- batching


def _index_dataset(num_samples):
    """x[i] = (i, -i) and y[i] = i, so a batch shows which samples it drew."""
    x = np.stack([np.arange(num_samples), -np.arange(num_samples)], axis=1).astype(np.float32)
    return x, np.arange(num_samples, dtype=np.int32)


def test_batcher_shapes_and_own_partition(cifar_labels):
    x, y = _index_dataset(len(cifar_labels))
    parts = data.skew_partition(cifar_labels, num_nodes=4, skew=0.8, seed=0)
    batcher = data.NodeBatcher(x, y, parts, batch_size=32, seed=7)
    for _ in range(20):
        xb, yb = batcher.next()
        assert xb.shape == (4, 32, 2) and yb.shape == (4, 32)
        np.testing.assert_array_equal(xb[..., 0], yb)
        for k in range(4):
            assert np.isin(yb[k], parts[k]).all()


def test_batcher_epochs_without_replacement():
    x, y = _index_dataset(30)
    parts = [np.arange(0, 12), np.arange(12, 30)]  # 12 and 18 samples
    batcher = data.NodeBatcher(x, y, parts, batch_size=6, seed=0)
    drawn = np.concatenate([batcher.next()[1] for _ in range(6)], axis=1)  # 36 per node
    # Node 0: three epochs of 12; node 1: two epochs of 18, each a permutation.
    for epoch in range(3):
        assert sorted(drawn[0, 12 * epoch : 12 * (epoch + 1)]) == list(range(12))
    for epoch in range(2):
        assert sorted(drawn[1, 18 * epoch : 18 * (epoch + 1)]) == list(range(12, 30))
    assert not np.array_equal(drawn[0, :12], drawn[0, 12:24])


def test_batcher_straddles_epochs_and_small_parts():
    x, y = _index_dataset(10)
    # Node 0 has fewer samples than a batch: every batch repeats samples.
    batcher = data.NodeBatcher(x, y, [np.arange(3), np.arange(3, 10)], batch_size=5, seed=1)
    stream = np.concatenate([batcher.next()[1] for _ in range(3)], axis=1)
    for epoch in range(5):
        assert sorted(stream[0, 3 * epoch : 3 * (epoch + 1)]) == [0, 1, 2]
    for epoch in range(2):
        assert sorted(stream[1, 7 * epoch : 7 * (epoch + 1)]) == list(range(3, 10))


def test_batcher_nodes_have_independent_orders():
    x, y = _index_dataset(100)
    same = [np.arange(100)] * 3
    yb = data.NodeBatcher(x, y, same, batch_size=100, seed=0).next()[1]
    assert not np.array_equal(yb[0], yb[1]) and not np.array_equal(yb[1], yb[2])
    other_seed = data.NodeBatcher(x, y, same, batch_size=100, seed=1).next()[1]
    assert not np.array_equal(yb, other_seed)


def test_batcher_resume_is_exact():
    x, y = _index_dataset(50)
    parts = [np.arange(0, 17), np.arange(17, 50)]
    run = data.NodeBatcher(x, y, parts, batch_size=8, seed=3)
    for _ in range(7):
        run.next()
    checkpoint = run.state()
    assert checkpoint == {"step": 7, "seed": 3, "batch_size": 8, "num_nodes": 2}
    assert all(isinstance(v, int) for v in checkpoint.values())
    continued = [run.next() for _ in range(6)]

    resumed = data.NodeBatcher(x, y, parts, batch_size=8, seed=3)
    resumed.restore(checkpoint)
    for (xa, ya), (xb, yb) in zip(continued, [resumed.next() for _ in range(6)], strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)

    with pytest.raises(ValueError, match="seed"):
        data.NodeBatcher(x, y, parts, batch_size=8, seed=4).restore(checkpoint)


def test_batcher_bad_arguments():
    x, y = _index_dataset(10)
    with pytest.raises(ValueError, match="parts"):
        data.NodeBatcher(x, y, [np.arange(5), np.array([], np.int64)], 2, seed=0)
    with pytest.raises(ValueError, match="outside"):
        data.NodeBatcher(x, y, [np.arange(5, 11)], 2, seed=0)
    with pytest.raises(ValueError, match="NHWC"):
        data.NodeBatcher(x, y, [np.arange(10)], 2, seed=0, augment=True)


def test_batcher_augmentation():
    rng = np.random.default_rng(0)
    images = rng.standard_normal((20, 32, 32, 3)).astype(np.float32)
    labels = np.arange(20, dtype=np.int32)
    parts = [np.arange(10), np.arange(10, 20)]
    batcher = data.NodeBatcher(images, labels, parts, batch_size=8, seed=5, augment=True)
    xb, yb = batcher.next()
    assert xb.shape == (2, 8, 32, 32, 3) and xb.dtype == np.float32
    # Each output is a 32x32 window of its source zero-padded by 4, maybe mirrored.
    found = []
    for k in range(2):
        for m in range(8):
            padded = np.pad(images[yb[k, m]], ((4, 4), (4, 4), (0, 0)))
            windows = {
                (dy, dx, flip): padded[dy : dy + 32, dx : dx + 32][:, :: -1 if flip else 1]
                for dy in range(9)
                for dx in range(9)
                for flip in (False, True)
            }
            matches = [key for key, window in windows.items() if np.array_equal(xb[k, m], window)]
            assert len(matches) == 1
            found.append(matches[0])
    # Over 16 draws both flips and several offsets occur.
    assert {flip for _, _, flip in found} == {False, True}
    assert len({(dy, dx) for dy, dx, _ in found}) > 4
    again = data.NodeBatcher(images, labels, parts, batch_size=8, seed=5, augment=True)
    np.testing.assert_array_equal(again.next()[0], xb)
    # The next step draws new crops.
    assert not np.array_equal(batcher.next()[0], again.next()[0][:, ::-1])


def test_shard_places_node_axis():
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("nodes",))
    x = np.arange(len(devices) * 2 * 3, dtype=np.float32).reshape(len(devices), 2, 3)
    y = np.arange(len(devices) * 2, dtype=np.int32).reshape(len(devices), 2)
    xs, ys = data.shard((x, y), mesh, "nodes")
    assert xs.sharding.spec == jax.P("nodes")
    assert len(xs.addressable_shards) == len(devices)
    assert xs.addressable_shards[-1].data.shape == (1, 2, 3)
    np.testing.assert_array_equal(np.asarray(xs), x)
    np.testing.assert_array_equal(np.asarray(ys), y)
