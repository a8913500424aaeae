"""Offline classification data sets as numpy arrays; nothing here downloads anything.

Every loader returns a `Dataset` with float32 inputs and int32 labels:

- `digits`: scikit-learn's bundled 8x8 digits (1,797 images), flattened to 64
  features in [0, 1] (pixel / 16), with a stratified split.
- `mnist1d`: MNIST-1D (Greydanus, https://arxiv.org/abs/2011.14439) generated
  here from its ten digit templates: 40-long sequences, 10 classes, 4,000 train
  + 1,000 test by default, standardised to mean 0 and std 1 over the whole
  generated set as the reference generator does.
- `cifar10`: CIFAR-10 read from the binary files in a directory the user
  downloaded, NHWC float32 normalised per channel.
- `synthetic`: a Gaussian mixture, for tests and smoke runs.

`load(name, **kwargs)` picks one by name.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable
from collections.abc import Sequence

import numpy as np

TASKS = ("classification", "next_token")


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split of a classification data set.

    Attributes:
      x_train: float32 [N_train, ...] inputs.
      y_train: int32 [N_train] labels in [0, num_classes).
      x_test: float32 [N_test, ...] inputs.
      y_test: int32 [N_test] labels in [0, num_classes).
      num_classes: number of classes C (a language model's vocabulary).
      name: the data set's name, as `load` knows it.
      task: "classification", or "next_token": then x_* are windows of T + 1 tokens
        (the model reads the first T and predicts the last T) and y_* the group of
        each window (the corpus's package or directory), which non-IID partitions
        sort by.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str
    task: str = "classification"

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"{self.name}: task must be one of {TASKS}; got {self.task!r}")
        for split in ("train", "test"):
            x = getattr(self, f"x_{split}")
            y = getattr(self, f"y_{split}")
            if y.ndim != 1 or x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"{self.name}: x_{split} {x.shape} and y_{split} {y.shape} must have "
                    "the same number of samples and 1-D labels"
                )


def _check_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")


def _stratified_split(
    labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    # Per class, round(test_fraction * class size) random samples go to test, so
    # both splits keep the class proportions; each split is then shuffled so
    # that the classes are not in blocks.
    train, test = [], []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        num_test = round(test_fraction * members.size)
        test.append(members[:num_test])
        train.append(members[num_test:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(test))


def digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 handwritten digits (no download).

    Args:
      test_fraction: fraction of each class held out for test.
      seed: seed of the split; the result is a deterministic function of it.

    Returns:
      A `Dataset` named "digits" with x of shape [N, 64] (the 8x8 image
      flattened row-major, pixel value / 16 so in [0, 1]) and 10 classes; with
      the default fraction, 1,438 train and 359 test samples.
    """
    _check_fraction(test_fraction)
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "digits() reads the data bundled with scikit-learn: pip install scikit-learn"
        ) from err
    bunch = load_digits()
    # Pixels are integer intensities 0..16.
    x = (bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int32)
    train, test = _stratified_split(y, test_fraction, np.random.default_rng(seed))
    return Dataset(x[train], y[train], x[test], y[test], num_classes=10, name="digits")


# MNIST-1D digit templates, 12 points each, for digits 0..9: numeric data from
# the mnist1d package (mnist1d/data.py, get_templates) by Sam Greydanus,
# https://github.com/greydanus/mnist1d, Apache License 2.0.
_MNIST1D_TEMPLATES = np.array(
    [
        [5, 6, 6.5, 6.75, 7, 7, 7, 7, 6.75, 6.5, 6, 5],
        [5, 3, 3, 3.4, 3.8, 4.2, 4.6, 5, 5.4, 5.8, 5, 5],
        [5, 6, 6.5, 6.5, 6, 5.25, 4.75, 4, 3.5, 3.5, 4, 5],
        [5, 6, 6.5, 6.5, 6, 5, 5, 6, 6.5, 6.5, 6, 5],
        [5, 4.4, 3.8, 3.2, 2.6, 2.6, 5, 5, 5, 5, 5, 5],
        [5, 3, 3, 3, 3, 5, 6, 6.5, 6.5, 6, 4.5, 5],
        [5, 4, 3.5, 3.25, 3, 3, 3, 3, 3.25, 3.5, 4, 5],
        [5, 7, 7, 6.6, 6.2, 5.8, 5.4, 5, 4.6, 4.2, 5, 5],
        [5, 4, 3.5, 3.5, 4, 5, 5, 4, 3.5, 3.5, 4, 5],
        [5, 4, 3.5, 3.5, 4, 5, 5, 5, 5, 4.7, 4.3, 5],
    ]
)

# The reference generator's defaults (mnist1d.get_dataset_args()).
_MNIST1D_LENGTH = 40
_MNIST1D_PADDING = (36, 60)
_MNIST1D_SCALE_COEFF = 0.4
_MNIST1D_MAX_TRANSLATION = 48
_MNIST1D_CORR_NOISE_SCALE = 0.25
_MNIST1D_IID_NOISE_SCALE = 2e-2
_MNIST1D_SHEAR_SCALE = 0.75
_MNIST1D_NOISE_SIGMA = 2.0


def mnist1d_templates() -> np.ndarray:
    """The ten MNIST-1D digit templates as the generator uses them.

    Returns:
      float64 [10, 12]: each raw template standardised (mean 0, std 1), shifted
      so that it starts (and ends) at 0, and divided by 6.
    """
    x = _MNIST1D_TEMPLATES - _MNIST1D_TEMPLATES.mean(axis=1, keepdims=True)
    x /= x.std(axis=1, keepdims=True)
    x -= x[:, :1]
    return x / 6.0


@functools.cache
def _grid(start: float, stop: float, length: int) -> np.ndarray:
    # np.linspace's points, made once per length (a sample needs four): the generator's
    # time went to building them again for every sample. Read-only, as they are shared.
    points = np.linspace(start, stop, length)
    points.flags.writeable = False
    return points


def _resample(x: np.ndarray, length: int) -> np.ndarray:
    # Linear interpolation of x, read as samples on [0, 1], at `length` points.
    return np.interp(_grid(0.0, 1.0, length), _grid(0.0, 1.0, x.size), x)


@functools.cache
def _gaussian_weights(sigma: float) -> np.ndarray:
    # A Gaussian filter truncated at 4 sigma (scipy.ndimage.gaussian_filter's default).
    radius = int(4.0 * sigma + 0.5)
    offsets = np.arange(-radius, radius + 1)
    weights = np.exp(-0.5 * (offsets / sigma) ** 2)
    weights /= weights.sum()
    weights.flags.writeable = False
    return weights


def _gaussian_smooth(x: np.ndarray, sigma: float) -> np.ndarray:
    # The filter with half-sample symmetric edges (scipy.ndimage's default "reflect",
    # np.pad's "symmetric"), the edges copied by hand: the same values, without np.pad's
    # per-call overhead.
    weights = _gaussian_weights(sigma)
    radius = weights.size // 2
    padded = np.concatenate([x[radius - 1 :: -1], x, x[: -radius - 1 : -1]])
    return np.convolve(padded, weights, mode="valid")


def _roll(x: np.ndarray, shift: int) -> np.ndarray:
    # np.roll(x, shift) of a 1-D array with 0 <= shift < x.size, without its overhead.
    return np.concatenate([x[x.size - shift :], x[: x.size - shift]]) if shift else x.copy()


def _mnist1d_example(template: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
    # One sample, drawing from `rng` in the reference generator's order.
    low, high = _MNIST1D_PADDING
    dilated_length = template.size + high
    # Pad with a random number of zeros, then stretch back to a fixed length: a
    # random dilation. The 1e-8 keeps the template's end points (which are 0)
    # apart from the padding for the mask below.
    num_zeros = low + int(rng.rand() * (high - low + 1))
    x = _resample(np.concatenate([template + 1e-8, np.zeros(num_zeros)]), dilated_length)
    x = x * (1.0 + _MNIST1D_SCALE_COEFF * (rng.rand() - 0.5))
    x = _roll(x, int(rng.choice(_MNIST1D_MAX_TRANSLATION)))
    # Correlated noise fills the background only; iid noise goes everywhere.
    corr_noise = _gaussian_smooth(
        _MNIST1D_CORR_NOISE_SCALE * rng.randn(dilated_length), _MNIST1D_NOISE_SIGMA
    )
    x = np.where(x != 0, x, corr_noise)
    x = x + _MNIST1D_IID_NOISE_SCALE * rng.randn(dilated_length)
    x = x - _MNIST1D_SHEAR_SCALE * (rng.rand() - 0.5) * _grid(-0.5, 0.5, dilated_length)
    return _resample(x, _MNIST1D_LENGTH)


def mnist1d(num_samples: int = 5000, seed: int = 42, test_fraction: float = 0.2) -> Dataset:
    """MNIST-1D generated locally from its templates (no download, no cache file).

    The procedure of Greydanus (2020), per sample: take a digit's 12-point
    template, pad it with 36..60 zeros and resample to 72 points (random
    dilation), scale by a factor in [0.8, 1.2], translate circularly by 0..47,
    fill the background with Gaussian-smoothed noise (std 0.25, sigma 2), add iid
    noise (std 0.02), shear by a random linear ramp, resample to 40 points. The
    set is then shuffled and standardised to mean 0 and std 1 over all samples
    (train and test together), and the first ``1 - test_fraction`` of it is the
    training split.

    It draws its random numbers from a legacy ``np.random.RandomState(seed)``
    in the same order as the mnist1d package's ``make_dataset``, so with the
    defaults it reproduces that generator's default data set (seed 42, 5,000
    samples, 4,000 train + 1,000 test) to float32 precision, while leaving
    numpy's global random state alone.

    Args:
      num_samples: total number of samples, train and test; a positive
        multiple of 10 (each class gets num_samples / 10).
      seed: generator seed; 42 is the canonical data set.
      test_fraction: fraction of the shuffled set held out for test.

    Returns:
      A `Dataset` named "mnist1d" with x of shape [N, 40], 10 classes.

    References:
      Greydanus, "Scaling down Deep Learning", https://arxiv.org/abs/2011.14439
    """
    if num_samples <= 0 or num_samples % 10:
        raise ValueError(f"num_samples must be a positive multiple of 10, got {num_samples}")
    _check_fraction(test_fraction)
    templates = mnist1d_templates()
    # The legacy RandomState stream is what makes the canonical data set
    # reproducible; a Generator would give a different (equally valid) sample.
    rng = np.random.RandomState(seed)
    per_class = num_samples // 10
    x = np.stack(
        [_mnist1d_example(template, rng) for template in templates for _ in range(per_class)]
    )
    y = np.repeat(np.arange(10, dtype=np.int32), per_class)
    order = rng.permutation(num_samples)
    x, y = x[order], y[order]
    x = ((x - x.mean()) / x.std()).astype(np.float32)
    num_train = num_samples - round(test_fraction * num_samples)
    return Dataset(
        x[:num_train], y[:num_train], x[num_train:], y[num_train:], num_classes=10, name="mnist1d"
    )


# Per-channel (R, G, B) statistics of the CIFAR-10 training images in [0, 1]
# used by seed 002's code (and most CIFAR ResNet code): the mean is the pixel
# mean; the "std" is the mean of the per-image stds, smaller than the pixel
# std over the whole set, about (0.2470, 0.2435, 0.2616).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)
CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
CIFAR10_TEST_FILE = "test_batch.bin"
_CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
_CIFAR10_SUBDIR = "cifar-10-batches-bin"
_CIFAR10_RECORD = 1 + 3 * 32 * 32


def _cifar10_dir(data_dir: str | os.PathLike) -> str:
    expected = (*CIFAR10_TRAIN_FILES, CIFAR10_TEST_FILE)
    hint = (
        f"cifar10() reads the CIFAR-10 binary version: {', '.join(expected)}, in the "
        f"directory or in its {_CIFAR10_SUBDIR}/ subfolder. Download {_CIFAR10_URL} and "
        "extract it there (tar xzf); the python (pickle) version is not read."
    )
    data_dir = os.fspath(data_dir)
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(f"CIFAR-10 directory {data_dir!r} does not exist. {hint}")
    for candidate in (os.path.join(data_dir, _CIFAR10_SUBDIR), data_dir):
        missing = [f for f in expected if not os.path.isfile(os.path.join(candidate, f))]
        if not missing:
            return candidate
    raise FileNotFoundError(f"CIFAR-10 directory {data_dir!r} lacks {', '.join(missing)}. {hint}")


def _read_cifar10_file(
    path: str, mean: np.ndarray, std: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size == 0 or raw.size % _CIFAR10_RECORD:
        raise ValueError(
            f"{path}: {raw.size} bytes is not a whole number of {_CIFAR10_RECORD}-byte "
            "CIFAR-10 records (1 label byte + 3072 pixel bytes)"
        )
    records = raw.reshape(-1, _CIFAR10_RECORD)
    labels = records[:, 0].astype(np.int32)
    if labels.max() > 9:
        raise ValueError(f"{path}: label {labels.max()} is not a CIFAR-10 class (0..9)")
    # Each record stores the red, green and blue 32x32 planes one after another.
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    images = (images.astype(np.float32) / np.float32(255.0) - mean) / std
    return images, labels


def cifar10(
    data_dir: str | os.PathLike,
    *,
    mean: Sequence[float] = CIFAR10_MEAN,
    std: Sequence[float] = CIFAR10_STD,
) -> Dataset:
    """CIFAR-10 from its binary files in a local directory (no download).

    Args:
      data_dir: a directory holding data_batch_1.bin .. data_batch_5.bin and
        test_batch.bin, or one holding the cifar-10-batches-bin folder that
        https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz extracts to.
      mean: per-channel (R, G, B) mean subtracted from pixel / 255.
      std: per-channel std the centred values are divided by.

    Returns:
      A `Dataset` named "cifar10" with x of shape [N, 32, 32, 3] (NHWC,
      float32, (pixel / 255 - mean) / std), 50,000 train and 10,000 test
      samples in file order, 10 classes.

    Raises:
      FileNotFoundError: the directory or one of the files is missing.
      ValueError: a file is not a whole number of records.
    """
    directory = _cifar10_dir(data_dir)
    center, scale = np.asarray(mean, np.float32), np.asarray(std, np.float32)
    train = [
        _read_cifar10_file(os.path.join(directory, f), center, scale) for f in CIFAR10_TRAIN_FILES
    ]
    x_test, y_test = _read_cifar10_file(os.path.join(directory, CIFAR10_TEST_FILE), center, scale)
    return Dataset(
        np.concatenate([x for x, _ in train]),
        np.concatenate([y for _, y in train]),
        x_test,
        y_test,
        num_classes=10,
        name="cifar10",
    )


def synthetic(
    num_samples: int = 1000,
    num_features: int = 16,
    num_classes: int = 4,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> Dataset:
    """A Gaussian-mixture classification problem, for tests and smoke runs.

    Class c has centre mu_c with iid standard-normal entries; a sample of class
    c is mu_c plus standard-normal noise. Classes are balanced (sizes differ by
    at most one) and split stratified.

    Args:
      num_samples: total number of samples, train and test.
      num_features: input dimension d.
      num_classes: number of classes C.
      seed: the result is a deterministic function of all arguments.
      test_fraction: fraction of each class held out for test.

    Returns:
      A `Dataset` named "synthetic" with x of shape [N, d].
    """
    if num_samples < num_classes or num_features < 1 or num_classes < 2:
        raise ValueError(
            "synthetic needs num_samples >= num_classes >= 2 and num_features >= 1, got "
            f"num_samples={num_samples}, num_features={num_features}, num_classes={num_classes}"
        )
    _check_fraction(test_fraction)
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((num_classes, num_features))
    y = np.arange(num_samples, dtype=np.int32) % num_classes
    x = (centres[y] + rng.standard_normal((num_samples, num_features))).astype(np.float32)
    train, test = _stratified_split(y, test_fraction, rng)
    return Dataset(x[train], y[train], x[test], y[test], num_classes=num_classes, name="synthetic")


_LOADERS: dict[str, Callable[..., Dataset]] = {
    "cifar10": cifar10,
    "digits": digits,
    "mnist1d": mnist1d,
    "synthetic": synthetic,
}


def load(name: str, **kwargs) -> Dataset:
    """Loads a data set by name.

    Args:
      name: one of "cifar10", "digits", "mnist1d", "synthetic".
      **kwargs: passed to that loader (``data_dir=`` for "cifar10").

    Returns:
      The loader's `Dataset`.

    Example:
      >>> ds = load("synthetic", num_samples=100, num_features=4, num_classes=2, seed=0)
      >>> ds.x_train.shape
      (80, 4)
    """
    if name not in _LOADERS:
        raise ValueError(f"unknown data set {name!r}; valid names: {', '.join(sorted(_LOADERS))}")
    return _LOADERS[name](**kwargs)
