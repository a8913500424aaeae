"""Your own corpus for the language model: a directory of text files, a pre-tokenized file.

lpdec.data.text_directory / token_file, and train.py's datasets "text_files" and
"token_file" on small files the tests write. Expected windows come from the files'
bytes sliced here, not from the loaders.
"""

import logging
import mmap
import os

import numpy as np
import pytest

from lpdec import data

SEP = bytes([data.FILE_SEPARATOR])


def write(root, files: dict[str, bytes]):
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
    return root


def text(seed: int, size: int) -> bytes:
    """Printable bytes (never the separator 0)."""
    return bytes(np.random.default_rng(seed).integers(32, 127, size, dtype=np.uint8))


FILES = {
    "book.txt": text(0, 4000),
    "notes/a.md": text(1, 3000),
    "notes/b": text(2, 2001),  # no extension
    "data.csv": text(3, 1000),
}
HIDDEN = {".secret": text(4, 500), ".git/config": text(5, 500)}


def expected_sides(files: dict[str, bytes], fraction: float = 0.05) -> tuple[bytes, bytes]:
    """Each file (sorted by path parts) cut by position, its last round(f x size) to validation."""
    train, validation = b"", b""
    for relative in sorted(files, key=lambda r: r.split("/")):
        body = files[relative]
        cut = len(body) - round(fraction * len(body))
        train += body[:cut] + SEP
        validation += body[cut:] + SEP
    return train, validation


def test_every_file_of_any_extension_is_split_by_position(tmp_path):
    write(tmp_path, FILES | HIDDEN)
    corpus = data.load_text_directory(tmp_path)
    train, validation = expected_sides(FILES)
    assert corpus.train.tobytes() == train
    assert corpus.validation.tobytes() == validation
    # Groups: the top-level name (a directory, or the file's stem).
    assert corpus.group_names == ("book", "data", "notes")


def test_one_file_is_a_corpus_and_its_windows_are_its_bytes(tmp_path):
    body = text(7, 5000)
    write(tmp_path, {"input.txt": body})
    dataset = data.text_directory(tmp_path, context=15)
    cut = 5000 - 250
    stream = np.frombuffer(body[:cut] + SEP, np.uint8)
    count = stream.size // 16
    np.testing.assert_array_equal(dataset.x_train, stream[: count * 16].reshape(count, 16))
    held = np.frombuffer(body[cut:] + SEP, np.uint8)
    np.testing.assert_array_equal(dataset.x_test, held[: (held.size // 16) * 16].reshape(-1, 16))
    assert dataset.task == "next_token" and dataset.num_classes == 256
    assert dataset.name == "text_files"


def test_max_bytes_caps_the_train_bytes(tmp_path):
    write(tmp_path, FILES)
    corpus = data.load_text_directory(tmp_path, max_bytes=5000)
    train, _ = expected_sides(FILES)
    assert corpus.train.size == 5000
    assert corpus.train.tobytes()[:-1] == train[:4999]


@pytest.mark.parametrize(
    "files, context, match",
    [
        ({}, 8, "no files under"),
        ({"a.txt": b""}, 8, "are empty"),
        ({"a.txt": b"0123456789"}, 64, "fewer than one window"),
    ],
)
def test_a_missing_empty_or_small_directory_is_a_one_line_error(tmp_path, files, context, match):
    root = write(tmp_path / "corpus", files) if files else tmp_path / "corpus"
    root.mkdir(exist_ok=True)
    with pytest.raises(ValueError, match=match) as info:
        data.text_directory(root, context=context)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="is not a directory"):
        data.text_directory(tmp_path / "missing")


def write_tokens(root, train, val, dtype="uint16"):
    root.mkdir(parents=True, exist_ok=True)
    np.asarray(train, dtype).tofile(root / "train.bin")
    np.asarray(val, dtype).tofile(root / "val.bin")
    return root


def mapped(array) -> bool:
    """Whether `array` is a view of a memory-mapped file (along its chain of bases)."""
    while array is not None:
        if isinstance(array, np.memmap | mmap.mmap):
            return True
        array = getattr(array, "base", None)
    return False


@pytest.mark.parametrize("dtype, vocab", [("uint16", 50257), ("uint32", 100_000)])
def test_token_files_are_memory_mapped_windows_of_the_ids(tmp_path, dtype, vocab):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, vocab, 1000), rng.integers(0, vocab, 300)
    root = write_tokens(tmp_path / "tok", train, val, dtype)
    dataset = data.token_file(root, vocab_size=vocab, context=9, dtype=dtype, validation_windows=5)
    # A view of the file, never read whole.
    assert mapped(dataset.x_train)
    np.testing.assert_array_equal(dataset.x_train, train[:1000].reshape(100, 10))
    rows = np.linspace(0, 29, 5).astype(int)
    np.testing.assert_array_equal(dataset.x_test, val.reshape(30, 10)[rows])
    assert dataset.num_classes == vocab and dataset.x_train.dtype == np.dtype(dtype)
    capped = data.token_file(root, vocab_size=vocab, context=9, dtype=dtype, max_bytes=500)
    assert capped.x_train.shape == (500 // np.dtype(dtype).itemsize // 10, 10)


def test_bad_token_files_are_one_line_errors(tmp_path):
    good = np.arange(100) % 7
    cases = {
        "missing": (None, "no '.*val.bin'"),
        "empty": ([], "is empty"),
        "small": ([1, 2, 3], "fewer than one window"),
        "vocab": (np.arange(100), "token id 99, not below vocab_size=7"),
    }
    for name, (val, match) in cases.items():
        root = write_tokens(tmp_path / name, good, [] if val is None else val)
        if val is None:
            os.remove(root / "val.bin")
        with pytest.raises(ValueError, match=match) as info:
            data.token_file(root, vocab_size=7, context=8)
        assert "\n" not in str(info.value)
    root = write_tokens(tmp_path / "odd", good, good)
    with open(root / "train.bin", "ab") as f:
        f.write(b"\x01")
    with pytest.raises(ValueError, match="not a whole number of uint16 tokens"):
        data.token_file(root, vocab_size=7, context=8)


def lm_config(**fields):
    from configs import lm_tiny

    config = lm_tiny.get_config()
    config.num_steps, config.log_every, config.checkpoint_every = 4, 2, 0
    for key, value in fields.items():
        config[key] = value
    return config


def test_train_lib_builds_both_datasets_and_refuses_bad_ones_in_one_line(tmp_path):
    import train_lib

    write(tmp_path / "txt", FILES)
    exp = train_lib.build(lm_config(dataset="text_files", data_dir=str(tmp_path / "txt")))
    assert exp.dataset.name == "text_files"
    rng = np.random.default_rng(1)
    root = write_tokens(tmp_path / "tok", rng.integers(0, 300, 20_000), rng.integers(0, 300, 2000))
    config = lm_config(dataset="token_file", data_dir=str(root), text_bytes=0)
    config.model_kwargs.vocab_size = 300
    exp = train_lib.build(config)
    assert exp.dataset.num_classes == 300 and exp.dataset.name == "token_file"
    config.model_kwargs.vocab_size = 200
    with pytest.raises(train_lib.ConfigError, match="token id 299, not below vocab_size=200"):
        train_lib.build(config)
    with pytest.raises(train_lib.ConfigError, match="needs config.data_dir"):
        train_lib.build(lm_config(dataset="text_files"))
    with pytest.raises(train_lib.ConfigError, match="token_dtype='int8' is not one of"):
        train_lib.build(lm_config(dataset="token_file", data_dir=str(root), token_dtype="int8"))


def train_part(body: bytes, fraction: float = 0.05) -> int:
    """The bytes of a file that go to train: all but its last round(f x size)."""
    return len(body) - round(fraction * len(body))


def records(caplog, level):
    return [r.getMessage() for r in caplog.records if r.levelno == level]


def test_the_text_corpus_logs_what_it_read_and_what_it_skipped(tmp_path, caplog):
    write(tmp_path, FILES | HIDDEN | {"notes/empty.txt": b""})
    with caplog.at_level(logging.INFO):
        data.load_text_directory(tmp_path)
    train, validation = expected_sides(FILES)
    (line,) = [m for m in records(caplog, logging.INFO) if "text corpus" in m]
    assert f"read 4 file(s), {len(train)} train and {len(validation)} validation bytes" in line
    assert "skipped 2 hidden or excluded (.git, .secret), 1 empty (notes/empty.txt)" in line
    # Every file is read whole and all of them are text: nothing to warn about.
    assert not records(caplog, logging.WARNING)


def test_a_size_limit_that_trims_the_corpus_warns_with_what_it_left_out(tmp_path, caplog):
    write(tmp_path, FILES)
    total = sum(train_part(body) for body in FILES.values())
    with caplog.at_level(logging.INFO):
        data.load_text_directory(tmp_path, max_bytes=5000)
    # In path order: book.txt's 3,800 train bytes and data.csv's 950, each with its
    # separator, leave 248 of 5,000: notes/a.md's first 247 and a separator; notes/b unread.
    (warning,) = records(caplog, logging.WARNING)
    kept = 3800 + 950 + 247
    assert f"max_bytes=5000 (train.py: config.text_bytes) kept {kept} of its {total}" in warning
    assert "3 file(s) read, the last one cut, 1 not read (notes/b)" in warning
    caplog.clear()
    with caplog.at_level(logging.INFO):
        data.load_text_directory(tmp_path, max_bytes=total + len(FILES))  # all, separators too
    assert not records(caplog, logging.WARNING)


@pytest.mark.parametrize(
    "head, is_text",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", False),  # an image
        (b"UTF-8 but for a \x00 byte", False),  # a NUL byte, the corpus's separator
        (b"caf\xe9 latin-1", False),  # not UTF-8
        (b"a" + "é".encode() * 600, True),  # UTF-8, a 2-byte character cut at byte 1,024
        (b"a" * 1024 + b"\x00", True),  # a NUL past the bytes looked at
    ],
    ids=["png", "nul", "latin1", "utf8_cut", "nul_late"],
)
def test_a_file_that_is_not_text_is_named_in_a_warning(tmp_path, caplog, head, is_text):
    write(tmp_path, {"book.txt": FILES["book.txt"], "odd/file.bin": head + text(9, 200)})
    with caplog.at_level(logging.INFO):
        corpus = data.load_text_directory(tmp_path)
    warnings = records(caplog, logging.WARNING)
    if is_text:
        assert not warnings
    else:
        (warning,) = warnings
        assert "1 file(s) do not look like text" in warning and warning.endswith("odd/file.bin.")
    # Read all the same: bytes are tokens.
    bodies = (FILES["book.txt"], head + text(9, 200))
    assert corpus.train.size == sum(train_part(body) for body in bodies) + 2


def test_an_id_beyond_the_vocabulary_names_the_dtype_the_file_may_be(tmp_path):
    ids = np.random.default_rng(2).integers(0, 50257, 2000)
    root = write_tokens(tmp_path / "u16", ids, ids[:500], "uint16")
    # Two uint16 ids a, b read as one uint32: a + 2^16 b, far beyond the vocabulary.
    top = int((ids[0::2] + (ids[1::2] << 16)).max())
    with pytest.raises(ValueError, match=f"token id {top}, not below vocab_size=50257") as info:
        data.token_file(root, vocab_size=50257, context=8, dtype="uint32")
    assert str(info.value).endswith(
        "read as uint16 its ids fit: the file may be uint16, set dtype='uint16' "
        "(config.token_dtype='uint16')."
    )
    # Ids that fit neither way: no dtype to suggest.
    with pytest.raises(ValueError, match="not below vocab_size=100") as info:
        data.token_file(root, vocab_size=100, context=8, dtype="uint16")
    assert "may be" not in str(info.value)


def test_a_uint32_file_read_as_uint16_and_a_trimmed_token_file_warn(tmp_path, caplog):
    ids = np.random.default_rng(3).integers(1, 50257, 2000)
    root = write_tokens(tmp_path / "u32", ids, ids[:500], "uint32")
    with caplog.at_level(logging.INFO):
        data.token_file(root, vocab_size=50257, context=8, dtype="uint16", max_bytes=1000)
    warnings = records(caplog, logging.WARNING)
    assert any("train.bin': max_bytes=1000 (train.py: config.text_bytes) keeps 500 of its 4000"
               in w for w in warnings), warnings  # fmt: skip
    suspect = [w for w in warnings if "the file may be uint32, set dtype='uint32'" in w]
    assert len(suspect) == 2, warnings  # train.bin (its first 500 ids) and val.bin
    caplog.clear()
    with caplog.at_level(logging.INFO):
        data.token_file(root, vocab_size=50257, context=8, dtype="uint32")
    assert not records(caplog, logging.WARNING)
    assert any("train.bin': 2000 uint32 tokens, 222 windows of 9" in m
               for m in records(caplog, logging.INFO))  # fmt: skip


def test_train_py_s_text_bytes_trimming_a_directory_is_a_warning(tmp_path, caplog):
    """lm_tiny reads 1 MB (config.text_bytes) of a directory: train_lib's build says so."""
    import train_lib

    write(tmp_path / "txt", FILES)
    config = lm_config(dataset="text_files", data_dir=str(tmp_path / "txt"), text_bytes=5000)
    with caplog.at_level(logging.INFO):
        train_lib.build(config)
    assert any("config.text_bytes) kept" in w for w in records(caplog, logging.WARNING))
    assert any("read 3 file(s)" in m for m in records(caplog, logging.INFO))
