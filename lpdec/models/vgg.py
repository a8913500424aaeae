"""VGG-11 for CIFAR-10 in fp32 or 8-bit precision (seed 002, section 4.1).

Simonyan & Zisserman's configuration "A" of 3x3 convolutions (64, M, 128, M,
256, 256, M, 512, 512, M, 512, 512, M; M a 2x2 max-pool), each followed by a
norm-activation layer (`lpdec.nn.norm_act`), then seed 002's classifier: dropout,
a dense layer of 512, ReLU, and a dense layer of `num_classes` outputs. A 32x32
input leaves a 1x1x512 feature map, which is flattened.

As in the seed-002 authors' code: convolutions have no bias (a norm follows;
with norm="none" they have one), He-normal fan-out init, dropout 0.5 before the
hidden layer. Parameters for 10 classes: 9,493,770 with (Range) EvoNorm
(9,217,728 convolution weights, 267,786 classifier parameters, 3 x 2,752 norm
parameters); seed 002's Table 1: 9.49M.

References:
  Simonyan & Zisserman, Very Deep Convolutional Networks for Large-Scale Image
  Recognition, 2014, https://arxiv.org/abs/1409.1556
"""

from __future__ import annotations

import flax.linen as nn
import jax

from lpdec.models.resnet import he_normal
from lpdec.nn import norms
from lpdec.nn.quant import QuantConv
from lpdec.nn.quant import QuantDense

#: Convolution widths and max-pools ("M") of VGG-11 (configuration "A").
VGG11_LAYERS = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG11(nn.Module):
    """VGG-11 with a 512-wide hidden layer (module docstring).

    Attributes:
      num_classes: classifier outputs.
      precision: "fp32" or "int8" (every convolution and dense layer).
        Differentiating an int8 model needs `rngs={"quant": key}`.
      norm: one of `lpdec.nn.NORMS`, or None for seed 002's choice.
      groups: channel groups of the EvoNorms.
      hidden: width of the classifier's hidden layer (512 in seed 002).
      dropout_rate: dropout before the hidden layer; in training it needs
        `rngs={"dropout": key}`.

    Inputs are NHWC images ([batch, 32, 32, 3] for CIFAR-10).
    """

    num_classes: int = 10
    precision: str = "fp32"
    norm: str | None = None
    groups: int = 8
    hidden: int = 512
    dropout_rate: float = 0.5

    def __post_init__(self):
        norms.resolve_norm(self.norm, self.precision)
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        norm = norms.resolve_norm(self.norm, self.precision)
        index = 0
        for layer in VGG11_LAYERS:
            if layer == "M":
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
                continue
            index += 1
            x = QuantConv(
                int(layer),
                (3, 3),
                padding=1,
                use_bias=norm == "none",
                kernel_init=he_normal,
                precision=self.precision,
                name=f"conv{index}",
            )(x)
            x = norms.norm_act(norm, x, train=train, groups=self.groups, name=f"norm{index}")
        x = x.reshape(x.shape[0], -1)
        x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
        x = nn.relu(QuantDense(self.hidden, precision=self.precision, name="fc1")(x))
        return QuantDense(self.num_classes, precision=self.precision, name="fc2")(x)
