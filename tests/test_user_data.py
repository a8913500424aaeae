"""Your own corpus for the language model: a directory of text files, a pre-tokenized file.

lpdec.data.text_directory / token_file, and train.py's datasets "text_files" and
"token_file" on small files the tests write. Expected windows come from the files'
bytes sliced here, not from the loaders.
"""

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
