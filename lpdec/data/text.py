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

import codecs
import dataclasses
import hashlib
import os
import pathlib
import sysconfig

import numpy as np
from absl import logging

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
    return _walk(_resolve_root(root), lambda name: name.endswith(".py"))


def text_files(
    root: str | os.PathLike, skipped: list[pathlib.Path] | None = None
) -> list[pathlib.Path]:
    """Every regular file under `root`, whatever its extension, sorted by relative path.

    Hidden files and directories (names starting with "."), site-packages,
    dist-packages and __pycache__ are skipped; symbolic links to directories
    are not followed. `skipped`, if given, receives the skipped files and
    directories (a skipped directory once, not its files).
    """
    return _walk(_resolve_root(root), lambda name: not name.startswith("."), skipped)


def _walk(
    base: pathlib.Path, keep, skipped: list[pathlib.Path] | None = None
) -> list[pathlib.Path]:
    found: list[pathlib.Path] = []
    left_out: list[pathlib.Path] = []
    for directory, subdirs, names in os.walk(base):
        kept = [d for d in subdirs if d not in _EXCLUDED_DIRS and not d.startswith(".")]
        left_out += [pathlib.Path(directory, d) for d in subdirs if d not in kept]
        subdirs[:] = kept
        for n in names:
            if os.path.isfile(os.path.join(directory, n)):
                (found if keep(n) else left_out).append(pathlib.Path(directory, n))
    if skipped is not None:
        skipped += sorted(left_out, key=lambda path: path.relative_to(base).parts)
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
    rank: dict[int, int] = {}
    seen: dict[int, int] = {}
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
    _check_validation_windows(validation_windows)
    corpus = load_stdlib_corpus(root=root, max_bytes=max_bytes, seed=seed)
    return _text_dataset(corpus, context, validation_windows, "stdlib_text")


def _check_validation_windows(validation_windows) -> None:
    if validation_windows is not None and (
        isinstance(validation_windows, bool)
        or not isinstance(validation_windows, int)
        or validation_windows < 1
    ):
        raise ValueError(
            f"validation_windows must be None or a positive integer; got {validation_windows!r}."
        )


def _text_dataset(
    corpus: TextCorpus, context: int, validation_windows: int | None, name: str
) -> datasets.Dataset:
    """The corpus as windows of context + 1 bytes (see `stdlib_text`)."""
    length = context + 1
    x_train, x_test = windows(corpus.train, length), windows(corpus.validation, length)
    for side, x, data in (
        ("train", x_train, corpus.train),
        ("validation", x_test, corpus.validation),
    ):
        if not len(x):
            raise ValueError(
                f"the {side} side of the corpus under {corpus.root!r} holds {data.size} bytes, "
                f"fewer than one window of context + 1 = {length}: raise max_bytes or "
                "lower the context."
            )
    return datasets.Dataset(
        x_train=x_train,
        y_train=window_groups(corpus.train_spans, length),
        x_test=_spaced(x_test, validation_windows),
        y_test=np.zeros(min(len(x_test), validation_windows or len(x_test)), np.int32),
        num_classes=256,
        name=name,
        task="next_token",
    )


def _spaced(x: np.ndarray, count: int | None) -> np.ndarray:
    """At most `count` rows of `x`, evenly spaced (so they span its files); None: all."""
    if count is None or count >= len(x):
        return x
    return np.asarray(x[np.linspace(0, len(x) - 1, count).astype(np.int64)])


def load_text_directory(
    root: str | os.PathLike,
    *,
    validation_fraction: float = 0.05,
    max_bytes: int | None = None,
) -> TextCorpus:
    """Every file under `root` (`text_files`), any extension, as a byte corpus.

    Unlike `load_stdlib_corpus`'s split by file, each file is split by position, so
    one file is enough: its first bytes go to train, its last
    round(validation_fraction x size) bytes to validation (as nanoGPT splits a
    text). A file's group is its top-level name under `root` (`window_groups`).
    `max_bytes` caps the train bytes: files are taken in sorted-path order while
    their train parts (and separators) fit, the first one cut to fit if none does.

    It logs (absl, INFO) the files and bytes it read and what it skipped (hidden
    files and directories, empty files), and warns when `max_bytes` left bytes out
    (how many, of how many) and when a file does not look like text: a NUL byte (the
    corpus's file separator) or invalid UTF-8 in its first `TEXT_CHECK_BYTES`. Such
    a file is read all the same: bytes are tokens, whatever they encode.

    Raises:
      ValueError: (one line) no files under `root`, or no bytes in them.
    """
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1); got {validation_fraction!r}.")
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1
    ):
        raise ValueError(f"max_bytes must be None or a positive integer; got {max_bytes!r}.")
    base = _resolve_root(root)
    hidden: list[pathlib.Path] = []
    files = text_files(base, hidden)
    if not files:
        raise ValueError(f"no files under {str(base)!r} (hidden ones are skipped).")
    groups = [_group(f.relative_to(base)) for f in files]
    group_names = tuple(sorted(set(groups)))
    sides: dict[str, tuple[list, list]] = {"train": ([], []), "validation": ([], [])}
    left = max_bytes
    read, empty, not_text, left_out = [], [], [], []
    trimmed = 0  # train bytes that max_bytes left out of the files it read
    for index, (path, group) in enumerate(zip(files, groups, strict=True)):
        if left is not None and left < 2:
            left_out = files[index:]
            break
        with open(path, "rb") as f:
            text = f.read()
        if not text:
            empty.append(path)
            continue
        read.append(path)
        if not _looks_like_text(text):
            not_text.append(path)
        cut = len(text) - round(validation_fraction * len(text))
        parts = {"train": text[:cut], "validation": text[cut:]}
        if left is not None:
            trimmed += max(0, len(parts["train"]) - (left - 1))
            parts["train"] = parts["train"][: left - 1]
            left -= len(parts["train"]) + 1
        for side, part in parts.items():
            chunks, spans = sides[side]
            start = spans[-1][1] + 1 if spans else 0
            chunks += [part, bytes([FILE_SEPARATOR])]
            spans.append((start, start + len(part), group_names.index(group)))
    train, validation = (
        (np.frombuffer(b"".join(chunks), dtype=np.uint8), np.array(spans, np.int64).reshape(-1, 3))
        for chunks, spans in sides.values()
    )
    if not train[0].size:
        raise ValueError(f"the files under {str(base)!r} are empty.")
    _log_text_directory(
        base, read, train[0].size, validation[0].size, hidden, empty, not_text, max_bytes
    )
    unread = [f for f in left_out if f.stat().st_size]
    if trimmed or unread:
        sizes = [f.stat().st_size for f in unread]
        total = train[0].size - len(read) + trimmed
        total += sum(s - round(validation_fraction * s) for s in sizes)
        logging.warning(
            "text corpus under %r: max_bytes=%d (train.py: config.text_bytes) kept %d of its "
            "%d train bytes: %d file(s) read%s, %d not read (%s); raise it (0 in train.py: "
            "all) to train on the rest.",
            str(base), max_bytes, train[0].size - len(read), total, len(read),
            ", the last one cut" if trimmed else "", len(unread), _some(base, unread),
        )  # fmt: skip
    return TextCorpus(
        train=train[0],
        validation=validation[0],
        train_spans=train[1],
        validation_spans=validation[1],
        group_names=group_names,
        root=str(base),
    )


#: How much of each file `load_text_directory` checks for text (a NUL byte, invalid UTF-8).
TEXT_CHECK_BYTES = 1024


def _looks_like_text(data: bytes) -> bool:
    """No NUL byte and valid UTF-8 in the first TEXT_CHECK_BYTES bytes (a character that
    the cut splits counts as valid)."""
    head = data[:TEXT_CHECK_BYTES]
    if bytes([FILE_SEPARATOR]) in head:
        return False
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(data) <= len(head))
    except UnicodeDecodeError:
        return False
    return True


def _some(base: pathlib.Path, paths: list[pathlib.Path], count: int = 5) -> str:
    """The first `count` of `paths`, relative to `base`, and how many more."""
    names = ", ".join(p.relative_to(base).as_posix() for p in paths[:count])
    return names + (f" and {len(paths) - count} more" if len(paths) > count else "")


def _log_text_directory(base, read, train_bytes, validation_bytes, hidden, empty, not_text, cap):
    """`load_text_directory`'s account of what it read: one INFO line, and a warning for
    files that do not look like text."""
    skipped = [
        f"{len(hidden)} hidden or excluded ({_some(base, hidden)})" if hidden else "",
        f"{len(empty)} empty ({_some(base, empty)})" if empty else "",
    ]
    logging.info(
        "text corpus under %r: read %d file(s), %d train and %d validation bytes "
        "(separators included; max_bytes=%s); skipped %s.",
        str(base), len(read), train_bytes, validation_bytes, cap,
        ", ".join(s for s in skipped if s) or "none",
    )  # fmt: skip
    if not_text:
        logging.warning(
            "text corpus under %r: %d file(s) do not look like text (a NUL byte or invalid "
            "UTF-8 in the first %d bytes), read as bytes all the same: %s.",
            str(base), len(not_text), TEXT_CHECK_BYTES, _some(base, not_text),
        )  # fmt: skip


def text_directory(
    root: str | os.PathLike,
    *,
    context: int = 128,
    max_bytes: int | None = None,
    validation_windows: int | None = None,
) -> datasets.Dataset:
    """A directory of your own text files as a next-token `Dataset` of bytes.

    Every file under `root` counts, whatever its extension (`text_files`); each is
    split by position (`load_text_directory`), then cut into windows of
    context + 1 bytes as `stdlib_text` does.

    Example:
      >>> data = text_directory("/path/to/my/texts", context=64)  # doctest: +SKIP

    Raises:
      ValueError: (one line) a missing or empty directory, or too few bytes for one
        window on a side of the split.
    """
    _check_length(context)
    _check_validation_windows(validation_windows)
    corpus = load_text_directory(root, max_bytes=max_bytes)
    return _text_dataset(corpus, context, validation_windows, "text_files")


def _other_dtype_hint(path: str, dtype: str, vocab_size: int) -> str:
    """A hint for an id beyond the vocabulary: the other token dtype, if the whole file
    read as that holds only ids below `vocab_size` (a uint16 file read as uint32 pairs
    its ids into ids of 2^16 and more); "" otherwise."""
    other = TOKEN_DTYPES[1 - TOKEN_DTYPES.index(dtype)]
    if os.path.getsize(path) % np.dtype(other).itemsize:
        return ""
    tokens = np.memmap(path, dtype=other, mode="r")
    for start in range(0, tokens.size, _SCAN_TOKENS):
        if int(tokens[start : start + _SCAN_TOKENS].max()) >= vocab_size:
            return ""
    return (
        f"; read as {other} its ids fit: the file may be {other}, set "
        f"dtype={other!r} (config.token_dtype={other!r})"
    )


def _warn_if_uint32(path: str, tokens: np.ndarray) -> None:
    """Warn when a file read as uint16 has 0 at every odd place of its first 64k ids, as a
    little-endian uint32 file of ids below 2^16 has (their upper halves): its ids then
    pass the vocabulary check, and half of them are 0."""
    head = np.asarray(tokens[: 1 << 16])
    if head.size >= _UINT32_SUSPECT_TOKENS and not head.size % 2 and not head[1::2].any():
        logging.warning(
            "%r read as uint16 holds id 0 at every second place of its first %d tokens, as "
            "a uint32 file read as uint16 does: the file may be uint32, set dtype='uint32' "
            "(config.token_dtype='uint32').",
            path, head.size,
        )  # fmt: skip


#: The token files of a pre-tokenized corpus, as nanoGPT's prepare scripts write them.
TOKEN_FILES = ("train.bin", "val.bin")
TOKEN_DTYPES = ("uint16", "uint32")
# Tokens checked against the vocabulary per read: the file is scanned, never loaded whole.
_SCAN_TOKENS = 1 << 24
# A uint16 file is taken for a uint32 one (`_warn_if_uint32`) from this many tokens on: a
# real corpus with every second id 0 over so many is not one anybody trains on.
_UINT32_SUSPECT_TOKENS = 64


def token_file(
    directory: str | os.PathLike,
    *,
    vocab_size: int,
    context: int = 128,
    dtype: str = "uint16",
    max_bytes: int | None = None,
    validation_windows: int | None = None,
) -> datasets.Dataset:
    """A pre-tokenized corpus: `directory`/train.bin and val.bin, flat arrays of token ids.

    The files are read through `np.memmap`, never whole: x_train is a view of
    train.bin cut into windows of context + 1 tokens, and a batch reads only its
    windows. Every id is checked to lie below `vocab_size` (in chunks of 16M
    tokens) before training starts. y_train is 0 (one group). It logs (absl, INFO)
    each file's tokens and windows, and warns when `max_bytes` leaves tokens of
    train.bin out and when a file read as uint16 looks like uint32 (id 0 at every
    second place).

    Args:
      directory: holds train.bin and val.bin (nanoGPT's layout).
      vocab_size: the model's vocabulary; the dataset's `num_classes`.
      context: T, the tokens a model reads per window.
      dtype: "uint16" (vocabularies up to 65,536, as GPT-2's) or "uint32".
      max_bytes: None, or read only the first max_bytes // itemsize tokens of
        train.bin.
      validation_windows: at most this many evenly spaced windows of val.bin
        (read into memory); None: all of them.

    Raises:
      ValueError: (one line) a missing or empty file, a size that is not a whole
        number of tokens, fewer tokens than one window, or an id >= vocab_size (which
        names the other dtype when the file read as that fits the vocabulary).
    """
    _check_length(context)
    _check_validation_windows(validation_windows)
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"dtype must be one of {TOKEN_DTYPES}; got {dtype!r}.")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive integer; got {vocab_size!r}.")
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1
    ):
        raise ValueError(f"max_bytes must be None or a positive integer; got {max_bytes!r}.")
    itemsize = np.dtype(dtype).itemsize
    x = {}
    for name in TOKEN_FILES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ValueError(f"no {path!r}: a token corpus is train.bin and val.bin there.")
        size = os.path.getsize(path)
        if size == 0:
            raise ValueError(f"{path!r} is empty.")
        if size % itemsize:
            raise ValueError(
                f"{path!r} holds {size} bytes, not a whole number of {dtype} tokens "
                f"({itemsize} bytes each): is dtype right?"
            )
        tokens: np.ndarray = np.memmap(path, dtype=dtype, mode="r")
        if name == TOKEN_FILES[0] and max_bytes is not None and max_bytes < size:
            tokens = tokens[: max_bytes // itemsize]
            logging.warning(
                "%r: max_bytes=%d (train.py: config.text_bytes) keeps %d of its %d tokens; "
                "raise it (0 in train.py: all) to train on the rest.",
                path, max_bytes, tokens.size, size // itemsize,
            )  # fmt: skip
        if tokens.size < context + 1:
            raise ValueError(
                f"{path!r} holds {tokens.size} tokens, fewer than one window of "
                f"context + 1 = {context + 1}: add tokens or lower the context."
            )
        for start in range(0, tokens.size, _SCAN_TOKENS):
            top = int(tokens[start : start + _SCAN_TOKENS].max())
            if top >= vocab_size:
                hint = _other_dtype_hint(path, dtype, vocab_size)
                raise ValueError(
                    f"{path!r} holds token id {top}, not below vocab_size={vocab_size} "
                    f"(config.model_kwargs.vocab_size){hint}."
                )
        if dtype == "uint16":
            _warn_if_uint32(path, tokens)
        x[name] = windows(tokens, context + 1)
        logging.info("%r: %d %s tokens, %d windows of %d", path, tokens.size, dtype,
                     tokens.size // (context + 1), context + 1)  # fmt: skip
    x_train, x_test = x[TOKEN_FILES[0]], _spaced(x[TOKEN_FILES[1]], validation_windows)
    return datasets.Dataset(
        x_train=x_train,
        y_train=np.zeros(len(x_train), np.int32),
        x_test=x_test,
        y_test=np.zeros(len(x_test), np.int32),
        num_classes=vocab_size,
        name="token_file",
        task="next_token",
    )
