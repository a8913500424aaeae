"""Small models for the offline datasets: an MLP (digits) and a 1-D CNN (MNIST-1D).

Both follow the conventions of the CIFAR models: `QuantDense`/`QuantConv` of
the model's precision, `lpdec.nn.norm_act` after every hidden layer (EvoNorm-S0
for fp32 and Range EvoNorm-S0 for int8 unless `norm` says otherwise), no bias
before a norm, `__call__(x, train=True)`. Hidden widths must be multiples of
`groups` for the EvoNorms.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

from lpdec.models.resnet import he_normal
from lpdec.nn import norms
from lpdec.nn.quant import QuantConv
from lpdec.nn.quant import QuantDense


class MLP(nn.Module):
    """Dense -> NormAct per hidden layer, then a dense classifier.

    Inputs of any shape [batch, ...] are flattened (the digits data set's 64
    features, MNIST-1D's 40). With the default (128, 128) hidden layers, 64
    inputs and 10 classes: 26,634 parameters with (Range) EvoNorm (8,192 +
    16,384 + 1,290 dense parameters, 3 x 256 norm parameters).

    Attributes:
      hidden_sizes: widths of the hidden layers.
      num_classes: classifier outputs.
      precision: "fp32" or "int8" (differentiating int8 needs `rngs={"quant": key}`).
      norm: one of `lpdec.nn.NORMS`, or None for seed 002's choice.
      groups: channel groups of the EvoNorms.
    """

    hidden_sizes: Sequence[int] = (128, 128)
    num_classes: int = 10
    precision: str = "fp32"
    norm: str | None = None
    groups: int = 8

    def __post_init__(self):
        norms.resolve_norm(self.norm, self.precision)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        norm = norms.resolve_norm(self.norm, self.precision)
        x = x.reshape(x.shape[0], -1)
        for i, width in enumerate(self.hidden_sizes):
            x = QuantDense(
                width, use_bias=norm == "none", precision=self.precision, name=f"dense{i + 1}"
            )(x)
            x = norms.norm_act(norm, x, train=train, groups=self.groups, name=f"norm{i + 1}")
        return QuantDense(self.num_classes, precision=self.precision, name="classifier")(x)


class CNN1D(nn.Module):
    """A small 1-D CNN for MNIST-1D: strided Conv -> NormAct layers, flatten, dense.

    In the spirit of MNIST-1D's convolutional baseline: each convolution halves
    the length ("SAME" padding), so a 40-long signal becomes 5 positions of
    `channels[-1]` features (160 with the defaults) before the classifier.
    Defaults, 10 classes: 12,298 parameters with (Range) EvoNorm (160 + 5,120 +
    5,120 convolution weights, 1,610 classifier parameters, 3 x 96 norm
    parameters).

    Attributes:
      channels: output channels of the convolutions.
      kernel_size: width of every convolution kernel.
      num_classes: classifier outputs.
      precision: "fp32" or "int8" (differentiating int8 needs `rngs={"quant": key}`).
      norm: one of `lpdec.nn.NORMS`, or None for seed 002's choice.
      groups: channel groups of the EvoNorms.

    Inputs are [batch, length] or [batch, length, channels].
    """

    channels: Sequence[int] = (32, 32, 32)
    kernel_size: int = 5
    num_classes: int = 10
    precision: str = "fp32"
    norm: str | None = None
    groups: int = 8

    def __post_init__(self):
        norms.resolve_norm(self.norm, self.precision)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        norm = norms.resolve_norm(self.norm, self.precision)
        if x.ndim == 2:
            x = x[..., None]
        for i, width in enumerate(self.channels):
            x = QuantConv(
                width,
                (self.kernel_size,),
                strides=2,
                use_bias=norm == "none",
                kernel_init=he_normal,
                precision=self.precision,
                name=f"conv{i + 1}",
            )(x)
            x = norms.norm_act(norm, x, train=train, groups=self.groups, name=f"norm{i + 1}")
        x = x.reshape(x.shape[0], -1)
        return QuantDense(self.num_classes, precision=self.precision, name="classifier")(x)
