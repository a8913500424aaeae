"""lpdec.data.text: the byte corpus of Python's standard library sources."""

import hashlib
import os
import pathlib
import sysconfig

import numpy as np
import pytest

from lpdec import data

# A tree of small "modules": 3 top-level ones and 4 packages (one with a subpackage).
LAYOUT = (
    [f"mod{i}.py" for i in range(3)]
    + [f"alpha/a{i}.py" for i in range(12)]
    + [f"beta/b{i}.py" for i in range(9)]
    + [f"beta/inner/c{i}.py" for i in range(6)]
    + [f"gamma/g{i}.py" for i in range(10)]
    + [f"delta/d{i}.py" for i in range(8)]
)
# Present under the root but not part of the corpus.
IGNORED = ["site-packages/x.py", "alpha/dist-packages/y.py", "alpha/__pycache__/z.py", "notes.txt"]


def write_tree(root, relatives=LAYOUT, size=None):
    """One file per relative path, its bytes unique to it (its name, then filler)."""
    rng = np.random.default_rng(0)
    for relative in relatives + IGNORED:
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        filler = b"x = 1\n" * (int(rng.integers(0, 40)) if size is None else 0)
        text = f"# {relative}\n".encode() + filler
        if size is not None:
            text = text.ljust(size, b"#")
        path.write_bytes(text)
    return root


def expected_group(relative):
    parts = relative.split("/")
    return parts[0] if len(parts) > 1 else parts[0][: -len(".py")]


def in_validation(relative, fraction, seed=0):
    """The documented rule: SHA-256("<seed>:<path>")'s first 8 bytes / 2^64 < fraction."""
    digest = hashlib.sha256(f"{seed}:{relative}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def files_of(array, spans, group_names):
    """{first line of the file: (bytes, group)} read back through the spans."""
    out = {}
    for start, end, group in spans:
        text = array[start:end].tobytes()
        out[text.split(b"\n")[0][2:].decode()] = (text, group_names[group])
    return out


def sides(corpus):
    train = files_of(corpus.train, corpus.train_spans, corpus.group_names)
    validation = files_of(corpus.validation, corpus.validation_spans, corpus.group_names)
    return train, validation


def test_the_files_are_the_py_files_sorted_by_relative_path(tmp_path):
    write_tree(tmp_path)
    files = data.python_stdlib_files(tmp_path)
    relatives = [f.relative_to(tmp_path).as_posix() for f in files]
    assert relatives == sorted(LAYOUT, key=lambda r: r.split("/"))


@pytest.mark.parametrize("fraction, seed", [(0.3, 0), (0.5, 1)])
def test_the_split_is_by_file_by_the_hash_rule(tmp_path, fraction, seed):
    write_tree(tmp_path)
    corpus = data.load_stdlib_corpus(root=tmp_path, validation_fraction=fraction, seed=seed)
    train, validation = sides(corpus)
    assert set(train) | set(validation) == set(LAYOUT) and not set(train) & set(validation)
    assert set(validation) == {r for r in LAYOUT if in_validation(r, fraction, seed)}
    assert 0 < len(validation) < len(LAYOUT)
    again = data.load_stdlib_corpus(root=tmp_path, validation_fraction=fraction, seed=seed)
    np.testing.assert_array_equal(again.train, corpus.train)
    np.testing.assert_array_equal(again.validation_spans, corpus.validation_spans)


def test_a_files_side_does_not_depend_on_the_other_files(tmp_path):
    write_tree(tmp_path)
    before_train, before_validation = sides(
        data.load_stdlib_corpus(root=tmp_path, validation_fraction=0.3)
    )
    removed = [sorted(before_train)[0], sorted(before_validation)[0], "mod1.py"]
    for relative in removed:
        (tmp_path / relative).unlink()
    after_train, after_validation = sides(
        data.load_stdlib_corpus(root=tmp_path, validation_fraction=0.3)
    )
    assert set(after_train) == set(before_train) - set(removed)
    assert set(after_validation) == set(before_validation) - set(removed)


def test_spans_tile_the_bytes_and_name_each_files_group(tmp_path):
    write_tree(tmp_path)
    corpus = data.load_stdlib_corpus(root=tmp_path, validation_fraction=0.3)
    assert corpus.group_names == tuple(sorted({expected_group(r) for r in LAYOUT}))
    assert corpus.root == str(tmp_path)
    for array, spans in [
        (corpus.train, corpus.train_spans),
        (corpus.validation, corpus.validation_spans),
    ]:
        assert array.dtype == np.uint8 and spans.dtype == np.int64 and spans.shape[1] == 3
        assert spans[0, 0] == 0 and spans[-1, 1] + 1 == array.size
        np.testing.assert_array_equal(spans[1:, 0], spans[:-1, 1] + 1)
        np.testing.assert_array_equal(array[spans[:, 1]], data.FILE_SEPARATOR)
        files = files_of(array, spans, corpus.group_names)
        for relative, (text, group) in files.items():
            assert text == (tmp_path / relative).read_bytes()
            assert group == expected_group(relative)
        # Files follow sorted relative paths.
        assert list(files) == sorted(files, key=lambda r: r.split("/"))


def test_max_bytes_keeps_whole_files_one_per_group_first(tmp_path):
    size = 100
    write_tree(tmp_path, size=size)
    full_train, full_validation = sides(
        data.load_stdlib_corpus(root=tmp_path, validation_fraction=0.2)
    )
    train_groups = {expected_group(r) for r in full_train}
    cap = len(train_groups) * (size + 1)
    corpus = data.load_stdlib_corpus(root=tmp_path, validation_fraction=0.2, max_bytes=cap)
    train, validation = sides(corpus)
    assert set(train) <= set(full_train) and set(validation) <= set(full_validation)
    # The cap holds one file of each group that has train files.
    assert sorted(expected_group(r) for r in train) == sorted(train_groups)
    # Each group's kept file is its train file of least hash place.
    for relative in train:
        group = [r for r in full_train if expected_group(r) == expected_group(relative)]
        assert relative == min(group, key=lambda r: hashlib.sha256(f"0:{r}".encode()).digest())
    validation_cap = int(cap * 0.2 / 0.8)
    assert len(validation) == min(len(full_validation), validation_cap // (size + 1))
    # Separators count: one byte less leaves a group out.
    short = data.load_stdlib_corpus(root=tmp_path, validation_fraction=0.2, max_bytes=cap - 1)
    assert len(short.train_spans) == len(train_groups) - 1 and short.train.size <= cap - 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_bytes=50), "max_bytes=50 allows 50 train bytes, fewer than the smallest"),
        (dict(validation_fraction=0.0), "validation_fraction must be in"),
        (dict(validation_fraction=1.0), "validation_fraction must be in"),
        (dict(max_bytes=0), "max_bytes"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_bad_arguments_raise_one_line_errors(tmp_path, kwargs, match):
    write_tree(tmp_path, size=100)
    with pytest.raises(ValueError, match=match) as error:
        data.load_stdlib_corpus(root=tmp_path, **kwargs)
    assert "\n" not in str(error.value)


def test_a_missing_or_empty_root_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="is not a directory"):
        data.load_stdlib_corpus(root=tmp_path / "missing")
    (tmp_path / "notes.txt").write_text("text\n")
    with pytest.raises(ValueError, match="no Python standard library sources.*point root="):
        data.load_stdlib_corpus(root=tmp_path)


def test_too_few_files_for_the_split_names_the_numbers(tmp_path):
    write_tree(tmp_path, relatives=["only.py"])
    with pytest.raises(ValueError, match=r"puts [01] of the 1 files .* and [01] in train"):
        data.load_stdlib_corpus(root=tmp_path, validation_fraction=0.5)


@pytest.mark.parametrize("length", [1, 7, 64, 10_000])
def test_windows_and_their_groups_match_a_loop(tmp_path, length):
    write_tree(tmp_path)
    corpus = data.load_stdlib_corpus(root=tmp_path, validation_fraction=0.3)
    stream, spans = corpus.train, corpus.train_spans
    owner = np.empty(stream.size, np.int64)  # each byte's group; a separator is its file's
    for start, end, group in spans:
        owner[start : end + 1] = group
    rows, groups = [], []
    offset = 0
    while offset + length <= stream.size:
        rows.append(stream[offset : offset + length])
        groups.append(owner[offset])
        offset += length
    got = data.windows(stream, length)
    assert got.shape == (len(rows), length) and got.dtype == np.uint8
    if rows:
        np.testing.assert_array_equal(got, np.stack(rows))
    got_groups = data.window_groups(spans, length)
    assert got_groups.dtype == np.int32
    np.testing.assert_array_equal(got_groups, np.array(groups, np.int64))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: data.windows(np.zeros((2, 3), np.uint8), 2), "data must be 1-D"),
        (lambda: data.windows(np.zeros(6, np.uint8), 0), "length"),
        (lambda: data.window_groups(np.zeros((2, 2), np.int64), 2), "spans"),
    ],
)
def test_window_arguments_are_checked(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_this_pythons_standard_library_loads():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir() or not (root / "os.py").is_file():
        pytest.skip(f"no standard library sources at {root}")
    corpus = data.load_stdlib_corpus()
    assert len(corpus.group_names) > 100
    assert corpus.validation.size > 1_000_000
    assert corpus.train.size > 10 * corpus.validation.size
    # No source file holds the separator, so the separators count the files.
    assert np.count_nonzero(corpus.train == data.FILE_SEPARATOR) == len(corpus.train_spans)
    names = {"asyncio", "email", "os", "test"}
    assert names <= set(corpus.group_names)
    assert not any("site-packages" in name for name in corpus.group_names)
    assert corpus.root == os.fspath(root)
