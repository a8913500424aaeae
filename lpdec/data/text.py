"""A byte-level text corpus that is present wherever lpdec runs: Python's own standard library.

The source files (`*.py`) of the running interpreter's standard library
(`sysconfig.get_paths()["stdlib"]`, without `site-packages`/`dist-packages`)
are real text that nobody here wrote, and they come with every Python: nothing
is downloaded. On CPython 3.11 they are 1,790 files, 31.5 MB, in 202 groups;
other Python versions hold other files, so a result names its interpreter
(`TextCorpus.root`). Any directory of `.py` files can stand in (`root=`).

- Bytes are tokens (vocabulary 256); files are read as bytes, not decoded.
- Each file is followed by one `FILE_SEPARATOR` byte (0, which Python source
  never contains), the corpus's end-of-document token.
- A file's group is its top-level importable name under the root: the package
  directory ("asyncio", "email", "test") or, for a top-level module, the module
  ("os" for os.py). Groups are what a non-IID partition splits by; note that
  on 3.11 "test" alone holds 54% of the bytes.
- The train/validation split is by file, decided by the file's own relative
  path and `seed` (a SHA-256 hash, see `load_stdlib_corpus`), so a file's side
  does not depend on which other files exist.

Example:
  >>> corpus = load_stdlib_corpus(max_bytes=1_000_000)
  >>> x = windows(corpus.train, 129)  # 128 inputs and 128 next-byte targets per row
  >>> groups = window_groups(corpus.train_spans, 129)
  >>> x.shape[0] == groups.shape[0]
  True
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig

import numpy as np

from lpdec.data import datasets

#: The byte written after every file of a `TextCorpus`.
FILE_SEPARATOR = 0

_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def _resolve_root(root: str | os.PathLike | None) -> pathlib.Path:
    path = pathlib.Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not path.is_dir():
        raise ValueError(f"root={str(path)!r} is not a directory.")
    return path


def python_stdlib_files(root: str | os.PathLike | None = None) -> list[pathlib.Path]:
    """The `*.py` files under `root` (default: this interpreter's stdlib), sorted by relative path.

    Directories named site-packages, dist-packages or __pycache__ are skipped,
    symbolic links to directories are not followed. The order is that of the
    relative paths' components, so a package's files are contiguous.

    Example:
      >>> files = python_stdlib_files()
      >>> any(f.name == "os.py" for f in files)
      True
    """
    base = _resolve_root(root)
    found = []
    for directory, subdirs, names in os.walk(base):
        subdirs[:] = [d for d in subdirs if d not in _EXCLUDED_DIRS]
        found.extend(pathlib.Path(directory, n) for n in names if n.endswith(".py"))
    return sorted(found, key=lambda path: path.relative_to(base).parts)


@dataclasses.dataclass(frozen=True, eq=False)
class TextCorpus:
    """Train and validation bytes of a corpus of text files, with each file's span and group.

    `train` and `validation` are the files of each side concatenated in
    sorted-path order, each followed by `FILE_SEPARATOR`; the arrays are
    read-only. Row i of a spans array is (start, end, group) of one file:
    `train[start:end]` is the file's bytes, `train[end]` its separator, and
    `group_names[group]` its group, so the rows tile the array exactly.

    Attributes:
      train: uint8 [train bytes].
      validation: uint8 [validation bytes].
      train_spans: int64 [train files, 3].
      validation_spans: int64 [validation files, 3].
      group_names: the sorted groups of all files under the root, both sides.
      root: the directory the files were read from.
    """

    train: np.ndarray
    validation: np.ndarray
    train_spans: np.ndarray
    validation_spans: np.ndarray
    group_names: tuple[str, ...]
    root: str


def _group(relative: pathlib.PurePath) -> str:
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _hash_fraction(relative: pathlib.PurePath, seed: int) -> float:
    """A file's place in [0, 1): the first 8 bytes of SHA-256("<seed>:<relative posix path>")."""
    digest = hashlib.sha256(f"{seed}:{relative.as_posix()}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _capped(
    indices: list[int],
    places: list[float],
    group_ids: list[int],
    sizes: list[int],
    cap: int,
    side: str,
    max_bytes: int,
) -> list[int]:
    """The files that fit in `cap` bytes (with separators), taken greedily round-robin.

    Round r holds every group's r-th file in increasing place u; within a
    round, files go in increasing u.
    """
    rank, seen = {}, {}
    for i in sorted(indices, key=lambda i: places[i]):
        rank[i] = seen.get(group_ids[i], 0)
        seen[group_ids[i]] = rank[i] + 1
    kept, left = [], cap
    for i in sorted(indices, key=lambda i: (rank[i], places[i])):
        if sizes[i] + 1 <= left:
            kept.append(i)
            left -= sizes[i] + 1
    if not kept:
        smallest = min(sizes[i] for i in indices) + 1
        raise ValueError(
            f"max_bytes={max_bytes} allows {cap} {side} bytes, fewer than the smallest "
            f"{side} file's {smallest} (with its separator)."
        )
    return sorted(kept)


def _concatenate(
    files: list[pathlib.Path], indices: list[int], group_ids: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    chunks, spans, start = [], [], 0
    separator = bytes([FILE_SEPARATOR])
    for i in indices:
        with open(files[i], "rb") as f:
            text = f.read()
        chunks += [text, separator]
        spans.append((start, start + len(text), group_ids[i]))
        start += len(text) + 1
    data = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    return data, np.array(spans, dtype=np.int64).reshape(-1, 3)


def load_stdlib_corpus(
    *,
    root: str | os.PathLike | None = None,
    validation_fraction: float = 0.05,
    max_bytes: int | None = None,
    seed: int = 0,
) -> TextCorpus:
    """The `*.py` files under `root` (default: this Python's stdlib) as a byte corpus.

    A file goes to validation when its place u = first 8 bytes of
    SHA-256("<seed>:<relative path>") / 2^64 is below `validation_fraction`,
    so the split depends on nothing but the file's path and `seed`.
    `max_bytes` caps the train bytes (separators included) and the validation
    bytes at max_bytes * validation_fraction / (1 - validation_fraction): each
    side keeps whole files, taken round-robin over the groups (every group's
    file of least u, then every group's second, ...) and skipping any file that
    no longer fits, so that a small corpus still spans many packages (1 MB of
    the 3.11 stdlib: 58 files from 48 groups; in u order alone, 16 groups).

    Args:
      root: a directory of `.py` files; None for `sysconfig`'s stdlib.
      validation_fraction: the expected share of files in validation, in (0, 1).
      max_bytes: None, or the most train bytes to keep.
      seed: salts the hash: another seed, another split.

    Returns:
      A `TextCorpus`.

    Example:
      >>> corpus = load_stdlib_corpus(max_bytes=100_000)
      >>> corpus.train.size <= 100_000
      True
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1); got {validation_fraction!r}.")
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1
    ):
        raise ValueError(f"max_bytes must be None or a positive integer; got {max_bytes!r}.")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer; got {seed!r}.")
    base = _resolve_root(root)
    files = python_stdlib_files(base)
    if not files:
        raise ValueError(
            f"no Python standard library sources (*.py) under {str(base)!r}; "
            "point root= at a directory of .py text files."
        )
    relatives = [f.relative_to(base) for f in files]
    groups = [_group(r) for r in relatives]
    group_names = tuple(sorted(set(groups)))
    group_id = {name: i for i, name in enumerate(group_names)}
    group_ids = [group_id[g] for g in groups]
    places = [_hash_fraction(r, seed) for r in relatives]
    validation = [i for i, u in enumerate(places) if u < validation_fraction]
    train = [i for i, u in enumerate(places) if u >= validation_fraction]
    if not train or not validation:
        raise ValueError(
            f"validation_fraction={validation_fraction} puts {len(validation)} of the "
            f"{len(files)} files under {str(base)!r} in validation and {len(train)} in train; "
            "each side needs a file (add files, or change validation_fraction or seed)."
        )
    if max_bytes is not None:
        sizes = [f.stat().st_size for f in files]
        validation_cap = int(max_bytes * validation_fraction / (1.0 - validation_fraction))
        train = _capped(train, places, group_ids, sizes, max_bytes, "train", max_bytes)
        validation = _capped(
            validation, places, group_ids, sizes, validation_cap, "validation", max_bytes
        )
    train_data, train_spans = _concatenate(files, train, group_ids)
    validation_data, validation_spans = _concatenate(files, validation, group_ids)
    return TextCorpus(
        train=train_data,
        validation=validation_data,
        train_spans=train_spans,
        validation_spans=validation_spans,
        group_names=group_names,
        root=str(base),
    )


def _check_length(length) -> None:
    if isinstance(length, bool) or not isinstance(length, int | np.integer) or length < 1:
        raise ValueError(f"length must be a positive integer; got {length!r}.")


def windows(data: np.ndarray, length: int) -> np.ndarray:
    """Non-overlapping windows [N, length] of a 1-D array, N = len(data) // length (tail dropped).

    Row i is data[i * length : (i + 1) * length], a view of `data`. For
    next-token prediction take length = context + 1: inputs row[:-1], targets
    row[1:].

    Example:
      >>> windows(np.arange(7, dtype=np.uint8), 3).tolist()
      [[0, 1, 2], [3, 4, 5]]
    """
    _check_length(length)
    data = np.asarray(data)
    if data.ndim != 1:
        raise ValueError(f"data must be 1-D; got shape {data.shape}.")
    count = data.shape[0] // length
    return data[: count * length].reshape(count, length)


def window_groups(spans: np.ndarray, length: int) -> np.ndarray:
    """int32 [N]: the group of the file that window i of `windows(data, length)` starts in.

    `spans` are a `TextCorpus`'s rows (start, end, group) for `data`; a
    separator byte belongs to the file before it, and len(data) is the last
    end + 1. Sorting windows by group gives nodes different packages.

    Example:
      >>> spans = np.array([[0, 4, 1], [5, 7, 0]])  # two files, data of 8 bytes
      >>> window_groups(spans, 3).tolist()  # windows start at bytes 0 and 3
      [1, 1]
    """
    _check_length(length)
    spans = np.asarray(spans)
    if spans.ndim != 2 or spans.shape[1] != 3 or spans.shape[0] == 0:
        raise ValueError(
            f"spans must be [files >= 1, 3] rows (start, end, group); got {spans.shape}."
        )
    count = (int(spans[-1, 1]) + 1) // length
    starts = np.arange(count, dtype=np.int64) * length
    file_index = np.searchsorted(spans[:, 0], starts, side="right") - 1
    return spans[file_index, 2].astype(np.int32)


def stdlib_text(
    *,
    context: int = 128,
    max_bytes: int | None = None,
    validation_windows: int | None = None,
    root: str | os.PathLike | None = None,
    seed: int = 0,
) -> datasets.Dataset:
    """The corpus as a next-token `Dataset`: windows of context + 1 bytes.

    x_train / x_test are uint8 windows [N, context + 1] (the model reads the first
    `context` bytes and predicts the last `context`); y_train is each training
    window's group (`window_groups`), which `skew_partition` sorts by, so a skewed
    partition gives the nodes different packages; y_test is 0.

    Args:
      context: T, the tokens a model reads per window.
      max_bytes: caps the train bytes (`load_stdlib_corpus`); None keeps them all.
      validation_windows: keep at most this many validation windows, evenly spaced
        over the validation bytes (so they span its packages); None keeps them all.
      root: a directory of `.py` files; None for this Python's standard library.
      seed: the split's salt (`load_stdlib_corpus`).

    Raises:
      ValueError: (one line) no sources under `root`, or too few bytes for one
        window on a side of the split.
    """
    _check_length(context)
    if validation_windows is not None and (
        isinstance(validation_windows, bool)
        or not isinstance(validation_windows, int)
        or validation_windows < 1
    ):
        raise ValueError(
            f"validation_windows must be None or a positive integer; got {validation_windows!r}."
        )
    corpus = load_stdlib_corpus(root=root, max_bytes=max_bytes, seed=seed)
    length = context + 1
    x_train, x_test = windows(corpus.train, length), windows(corpus.validation, length)
    for name, x, data in (
        ("train", x_train, corpus.train),
        ("validation", x_test, corpus.validation),
    ):
        if not len(x):
            raise ValueError(
                f"the {name} side of the corpus under {corpus.root!r} holds {data.size} bytes, "
                f"fewer than one window of context + 1 = {length}: raise max_bytes or "
                "lower the context."
            )
    if validation_windows is not None and validation_windows < len(x_test):
        # Evenly spaced over the validation files, so the subset spans their packages.
        x_test = x_test[np.linspace(0, len(x_test) - 1, validation_windows).astype(np.int64)]
    return datasets.Dataset(
        x_train=x_train,
        y_train=window_groups(corpus.train_spans, length),
        x_test=x_test,
        y_test=np.zeros(len(x_test), np.int32),
        num_classes=256,
        name="stdlib_text",
        task="next_token",
    )
