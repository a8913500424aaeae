"""Normalization layers of seed 002: EvoNorm-S0, Range EvoNorm-S0 and range batch-norm.

Seed 002 (section 4) replaces every "batch-norm + ReLU" pair of its networks with
EvoNorm-S0 for fp32 training and with Range EvoNorm-S0 for 8-bit training: both
normalize each sample by its own statistics, so they do not depend on the batch
statistics that differ between nodes holding non-IID data, and both include
their own non-linearity. Range batch-norm (Banner et al.) is the batch-statistics
layer Range EvoNorm is built from, kept here as a baseline.

The range layers estimate a standard deviation from the mean range of chunks of
n values (Banner et al.; the same constant in the seed-002 authors' code)::

    sigma ~= C(n) * (mean over chunks of max - mean over chunks of min)
    C(n) = 0.5 * 0.35 * (1 + sqrt(pi * ln 4)) / sqrt(2 * ln n)       (`range_constant`)

For n i.i.d. Gaussian samples E[max - min] grows like 2 sigma sqrt(2 ln n), which
gives C(n) ~ 0.5 / sqrt(2 ln n); Banner et al.'s released RangeBN multiplies that
by 0.35 (1 + sqrt(pi ln 4)) ~= 1.080, a finite-n correction that the seed-002
authors kept unchanged. The estimate stays biased low at practical n (Monte
Carlo: C(n) E[range] = 0.81 sigma at n = 16, 0.90 sigma at n = 128, 0.95 sigma at
n = 2048); gamma absorbs a constant factor, so only the layers' initial output
scale (10-20% above EvoNorm-S0's) depends on it.

Chunks: the values a statistic is taken over are split into c equal chunks of
n = size / c consecutive values, c the largest divisor of size that is at most
`num_chunks` (16, as in both codes) and leaves n >= 2. The authors' shapes are
all multiples of 16, where this is their split; the divisor rule lets any size
>= 2 work (a 2-D [batch, features] input, a batch of 2). "Consecutive" follows
the authors' NCHW order: within a sample's channel group the values run channel
by channel, each channel's spatial positions in row-major order; for range
batch-norm, a channel's values run over (batch, spatial) in row-major order.

The norms run in float32 and return the input dtype. seed 002's authors also
quantize the norms' inputs, scales and parameters in 8-bit training; lpdec keeps
norms in float32 in both precisions (only `QuantDense`/`QuantConv` quantize).

References:
  Liu et al., Evolving Normalization-Activation Layers, 2020,
  https://arxiv.org/abs/2004.02967
  Banner et al., Scalable methods for 8-bit training of neural networks, 2018,
  https://arxiv.org/abs/1805.11046
  seed 002 (Range EvoNorm), code at https://github.com/aparna-aketi/Low_Precision_DL
"""

from __future__ import annotations

import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from lpdec.nn import quant

#: Model-level normalization choices (`norm_act`).
NORMS = ("evonorm", "range_evonorm", "batchnorm", "range_batchnorm", "none")
_EVONORMS = ("evonorm", "range_evonorm")

Initializer = Callable[..., jax.Array]


def range_constant(n: int) -> float:
    """C(n) with sigma ~= C(n) * E[range of n Gaussian samples] (module docstring)."""
    return 0.5 * 0.35 * (1.0 + math.sqrt(math.pi * math.log(4.0))) / math.sqrt(2.0 * math.log(n))


def chunking(size: int, num_chunks: int) -> tuple[int, int]:
    """(c, n): the largest c <= num_chunks dividing `size` with n = size / c >= 2."""
    if size < 2:
        raise ValueError(f"a range statistic needs at least 2 values; got {size}.")
    c = max(d for d in range(1, min(num_chunks, size // 2) + 1) if size % d == 0)
    return c, size // c


def mean_range(values: jax.Array, num_chunks: int) -> jax.Array:
    """Mean chunk max minus mean chunk min over the last axis, scaled by C(n) to a sigma."""
    c, n = chunking(values.shape[-1], num_chunks)
    chunks = values.reshape(values.shape[:-1] + (c, n))
    chunk_max = jnp.max(chunks, axis=-1).mean(axis=-1)
    chunk_min = jnp.min(chunks, axis=-1).mean(axis=-1)
    return (chunk_max - chunk_min) * range_constant(n)


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")


def _channel_groups(x: jax.Array, groups: int) -> jax.Array:
    """[B, *spatial, C] -> float32 [B, groups, C / groups, prod(spatial)] (channel-major)."""
    if x.ndim < 2:
        raise ValueError(f"expected [batch, ..., channels]; got shape {x.shape}.")
    channels = x.shape[-1]
    if channels % groups:
        raise ValueError(f"groups={groups} must divide the number of channels {channels}.")
    grouped = x.astype(jnp.float32).reshape(x.shape[0], -1, groups, channels // groups)
    return jnp.transpose(grouped, (0, 2, 3, 1))


def _per_channel_params(module: nn.Module, channels: int):
    gamma = module.param("scale", module.scale_init, (channels,), jnp.float32)
    beta = module.param("bias", nn.initializers.zeros_init(), (channels,), jnp.float32)
    v = module.param("v", nn.initializers.ones_init(), (channels,), jnp.float32)
    return gamma, beta, v


def _from_groups(per_group: jax.Array, x: jax.Array) -> jax.Array:
    """[B, groups] statistic -> broadcastable against x [B, *spatial, C]."""
    batch, groups = per_group.shape
    stat = jnp.repeat(per_group, x.shape[-1] // groups, axis=1)
    return stat.reshape((batch,) + (1,) * (x.ndim - 2) + (x.shape[-1],))


class EvoNormS0(nn.Module):
    """EvoNorm-S0 (Liu et al. 2020): a sample-statistics norm and activation in one.

    .. math::

      y = \\frac{x\\,\\sigma(v x)}{\\sqrt{s^2_{b,g}(x) + \\epsilon}}\\,\\gamma + \\beta

    with sigma the logistic sigmoid and s^2_{b,g} the (biased) variance of sample
    b's channel group g over its spatial positions and C / groups channels.
    gamma, v init to 1 and beta to 0, one per channel ("scale", "v", "bias");
    `scale_init` changes gamma's (zeros: the layer outputs beta, 0, at init).

    Attributes:
      groups: channel groups; must divide the channel count.
      epsilon: added to the variance.
      scale_init: initializer of gamma ("scale"), ones by default.

    Inputs are [batch, *spatial, channels] (NHWC, NWC or [batch, features]).
    """

    groups: int = 8
    epsilon: float = 1e-5
    scale_init: Initializer = nn.initializers.ones_init()

    def __post_init__(self):
        _check_positive_int("groups", self.groups)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gamma, beta, v = _per_channel_params(self, x.shape[-1])
        grouped = _channel_groups(x, self.groups)
        var = jnp.var(grouped, axis=(2, 3))
        x32 = x.astype(jnp.float32)
        inv_std = _from_groups(jax.lax.rsqrt(var + self.epsilon), x)
        return (x32 * jax.nn.sigmoid(v * x32) * inv_std * gamma + beta).astype(x.dtype)


class RangeEvoNormS0(nn.Module):
    """Range EvoNorm-S0 (seed 002): EvoNorm-S0 with a range-based scale and hard-sigmoid.

    .. math::

      y = \\frac{x\\,\\mathrm{hs}(v x)}{C(n)\\,r_{b,g}(x) + \\epsilon}\\,\\gamma + \\beta,
      \\qquad \\mathrm{hs}(z) = \\max(0, \\min(1, (z + 3) / 6))

    with r_{b,g} the mean chunk max minus the mean chunk min of sample b's
    channel group g (its spatial positions times C / groups channels, split into
    chunks as in the module docstring) and C(n) = `range_constant(n)`. No
    squares, square roots or exponentials: the operations low-precision
    hardware does well. As in the authors' code, epsilon is added to the scaled
    range. Parameters as in `EvoNormS0`.

    Attributes:
      groups: channel groups; must divide the channel count.
      num_chunks: most chunks per group (16 in the authors' code).
      epsilon: added to the scaled range.
      scale_init: initializer of gamma ("scale"), ones by default.
    """

    groups: int = 8
    num_chunks: int = 16
    epsilon: float = 1e-5
    scale_init: Initializer = nn.initializers.ones_init()

    def __post_init__(self):
        _check_positive_int("groups", self.groups)
        _check_positive_int("num_chunks", self.num_chunks)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        gamma, beta, v = _per_channel_params(self, x.shape[-1])
        grouped = _channel_groups(x, self.groups)
        sigma = mean_range(grouped.reshape(grouped.shape[:2] + (-1,)), self.num_chunks)
        x32 = x.astype(jnp.float32)
        scale = _from_groups(1.0 / (sigma + self.epsilon), x)
        return (x32 * jax.nn.hard_sigmoid(v * x32) * scale * gamma + beta).astype(x.dtype)


class RangeBatchNorm(nn.Module):
    """Range batch-norm (Banner et al. 2018): batch statistics with a range-based scale.

    .. math::

      y = (x - \\mu_c)\\,s_c\\,\\gamma_c + \\beta_c,\\qquad
      s_c = 1 / (C(n)\\, r_c(x) + \\epsilon)

    with mu_c the batch mean of channel c and r_c its mean chunk range over
    (batch, spatial) (module docstring). In training mode the running averages
    mean <- m mean + (1 - m) mu and scale <- m scale + (1 - m) s (collection
    "batch_stats", initial 0 and 1) are updated, as in Banner et al.'s code,
    which averages the inverse scale s rather than a variance; with
    `use_running_average` they replace the batch statistics. Statistics are this
    program's batch only: under a node axis each node normalizes by its own data.

    Attributes:
      use_running_average: as in `nn.BatchNorm`; may be given at call time instead.
      momentum: m above.
      epsilon: added to the scaled range.
      num_chunks: most chunks per channel (16 in Banner et al.'s code).
      scale_init: initializer of gamma ("scale"), ones by default.
    """

    use_running_average: bool | None = None
    momentum: float = 0.9
    epsilon: float = 1e-5
    num_chunks: int = 16
    scale_init: Initializer = nn.initializers.ones_init()

    def __post_init__(self):
        _check_positive_int("num_chunks", self.num_chunks)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, use_running_average: bool | None = None) -> jax.Array:
        use_running_average = nn.merge_param(
            "use_running_average", self.use_running_average, use_running_average
        )
        channels = x.shape[-1]
        gamma = self.param("scale", self.scale_init, (channels,), jnp.float32)
        beta = self.param("bias", nn.initializers.zeros_init(), (channels,), jnp.float32)
        ra_mean = self.variable("batch_stats", "mean", jnp.zeros, (channels,), jnp.float32)
        ra_scale = self.variable("batch_stats", "scale", jnp.ones, (channels,), jnp.float32)
        x32 = x.astype(jnp.float32)
        if use_running_average:
            mean, scale = ra_mean.value, ra_scale.value
        else:
            per_channel = x32.reshape(-1, channels).T
            mean = jnp.mean(per_channel, axis=1)
            scale = 1.0 / (mean_range(per_channel, self.num_chunks) + self.epsilon)
            if not self.is_initializing():
                m = self.momentum
                ra_mean.value = m * ra_mean.value + (1 - m) * mean
                ra_scale.value = m * ra_scale.value + (1 - m) * scale
        return ((x32 - mean) * scale * gamma + beta).astype(x.dtype)


def default_norm(precision: str) -> str:
    """seed 002's choice: EvoNorm-S0 for "fp32" training, Range EvoNorm-S0 for "int8"."""
    return "range_evonorm" if precision == "int8" else "evonorm"


def check_norm(norm) -> str:
    """Returns `norm` if it is one of `NORMS`; raises ValueError otherwise."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}; got {norm!r}.")
    return norm


def resolve_norm(norm: str | None, precision: str) -> str:
    """Validates a model's (norm, precision) pair; None means `default_norm(precision)`."""
    quant.check_precision(precision)
    return default_norm(precision) if norm is None else check_norm(norm)


def is_evonorm(norm: str) -> bool:
    """Whether `norm` is a norm-activation layer (no ReLU of its own around it)."""
    return norm in _EVONORMS


def norm_act(
    norm: str,
    x: jax.Array,
    *,
    train: bool,
    relu: bool = True,
    groups: int = 8,
    zero_scale: bool = False,
    name: str | None = None,
) -> jax.Array:
    """The layer that stands where a network had "batch-norm + ReLU" (call inside `compact`).

    "evonorm" and "range_evonorm" are norm and activation in one and always
    apply their non-linearity, as in seed 002's networks; "batchnorm"
    (`nn.BatchNorm`), "range_batchnorm" and "none" are followed by a ReLU when
    `relu` (False where the original network has no ReLU, e.g. before a residual
    addition).

    Args:
      norm: one of `NORMS`.
      x: the activations, [batch, ..., channels].
      train: batch statistics (and running-average updates) when True.
      relu: whether this position has a ReLU in the batch-norm network.
      groups: channel groups of the EvoNorms.
      zero_scale: start the norm's scale (gamma) at 0 instead of 1, so that the
        layer outputs its bias (0) at init: the last norm of a residual branch,
        whose block then starts as the identity (`lpdec.models.ResNet`). No
        effect with "none".
      name: the norm module's name (so trees match across norm choices).

    Returns:
      The normalized (and activated) activations.
    """
    scale_init = nn.initializers.zeros_init() if zero_scale else nn.initializers.ones_init()
    if norm == "evonorm":
        return EvoNormS0(groups=groups, scale_init=scale_init, name=name)(x)
    if norm == "range_evonorm":
        return RangeEvoNormS0(groups=groups, scale_init=scale_init, name=name)(x)
    if norm == "batchnorm":
        x = nn.BatchNorm(
            use_running_average=not train, momentum=0.9, scale_init=scale_init, name=name
        )(x)
    elif norm == "range_batchnorm":
        x = RangeBatchNorm(use_running_average=not train, scale_init=scale_init, name=name)(x)
    else:
        check_norm(norm)
    return nn.relu(x) if relu else x
