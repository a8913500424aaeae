"""CIFAR-style ResNets (He et al. 2016) in fp32 or 8-bit precision (seed 002, section 4).

Three stages of 16, 32 and 64 channels at 32x32, 16x16 and 8x8, each of
k = (depth - 2) // 6 basic blocks, between a 3x3 stem convolution and global
average pooling followed by a dense classifier. A basic block is

    conv3x3(stride s) -> NormAct -> conv3x3 -> Norm -> (+ shortcut) [-> ReLU]

where "NormAct" is `lpdec.nn.norm_act`. With seed 002's EvoNorms, which hold the
non-linearity, every norm is the full EvoNorm layer and there is no ReLU after
the addition (the seed-002 authors' networks); with batch-norm or no norm, the
block is He et al.'s (ReLU after the addition).

Decisions, checked against seed 002's Table 1 parameter counts:
  * Shortcuts are He et al.'s option B: a 1x1 convolution of stride s and a norm
    where the shape changes (the first block of stages 2 and 3), identity
    elsewhere; as in the authors' code. Option A (zero-padding) would save
    2,560 weights.
  * "ResNet-54" has k = (54 - 2) // 6 = 8 blocks per stage (the authors' code
    truncates 52 / 6), so 50 weight layers: 760,458 parameters with EvoNorm,
    Table 1's 0.76M; nine blocks (ResNet-56) would have 0.86M.
  * Convolutions have no bias (a norm follows) except with norm="none";
    weights are He-normal with fan-out (the authors' init); the classifier
    keeps flax's default init. 3x3 convolutions pad by 1 on each side, as in
    PyTorch, rather than XLA's "SAME" (which pads stride-2 layers unevenly).
  * With Range EvoNorm the scale (gamma) of each block's second norm starts
    at 0, so every block starts as its shortcut (`zero_init_residual`): the
    authors' 8-bit ResNet (the one with Range EvoNorm) does this; their 32-bit
    one (EvoNorm) keeps gamma = 1, as lpdec does with the other norms. Without
    it ResNet-20 with Range EvoNorm diverges at seed 002's lr 0.1, in 32 bits
    as in 8 (docs/training.md, "8-bit training"). (Their 8-bit classifier is
    also N(0, 0.01); lpdec keeps flax's default there, which is stable.)

References:
  He et al., Deep Residual Learning for Image Recognition, 2016,
  https://arxiv.org/abs/1512.03385
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from lpdec.nn import norms
from lpdec.nn.quant import QuantConv
from lpdec.nn.quant import QuantDense

#: He et al.'s initialization, N(0, 2 / (k * k * out_channels)), as in the authors' code.
he_normal = nn.initializers.variance_scaling(2.0, "fan_out", "normal")

STAGE_WIDTHS = (16, 32, 64)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions and a residual connection (module docstring).

    Attributes:
      features: output channels.
      strides: stride of the first convolution and of the projection shortcut.
      precision: "fp32" or "int8" (`lpdec.nn.QuantConv`).
      norm: one of `lpdec.nn.NORMS` (resolved, not None).
      groups: channel groups of the EvoNorms.
      zero_init_residual: start the second norm's scale at 0 (the block is then
        its shortcut at init).
    """

    features: int
    strides: int = 1
    precision: str = "fp32"
    norm: str = "evonorm"
    groups: int = 8
    zero_init_residual: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        conv = functools.partial(
            QuantConv,
            self.features,
            use_bias=self.norm == "none",
            kernel_init=he_normal,
            precision=self.precision,
        )
        norm = functools.partial(norms.norm_act, self.norm, train=train, groups=self.groups)
        y = conv((3, 3), strides=self.strides, padding=1, name="conv1")(x)
        y = norm(y, name="norm1")
        y = conv((3, 3), padding=1, name="conv2")(y)
        y = norm(y, relu=False, zero_scale=self.zero_init_residual, name="norm2")
        if self.strides != 1 or x.shape[-1] != self.features:
            x = conv((1, 1), strides=self.strides, padding="VALID", name="shortcut_conv")(x)
            x = norm(x, relu=False, name="shortcut_norm")
        y = y + x
        return y if norms.is_evonorm(self.norm) else nn.relu(y)


class ResNet(nn.Module):
    """CIFAR ResNet of a given depth (module docstring); see `ResNet20`, `ResNet54`.

    Attributes:
      depth: 6k + 2 for k blocks per stage (other depths >= 8 round k down).
      num_classes: classifier outputs.
      precision: "fp32" or "int8": every convolution and the classifier are
        `QuantConv`/`QuantDense` of this precision. Differentiating an int8
        model needs `rngs={"quant": key}`.
      norm: one of `lpdec.nn.NORMS`, or None for seed 002's choice (EvoNorm-S0
        for fp32, Range EvoNorm-S0 for int8). "batchnorm"/"range_batchnorm"
        keep running statistics in the "batch_stats" collection.
      groups: channel groups of the EvoNorms (8, as in the authors' code).
      zero_init_residual: whether each block's second norm starts with scale 0
        (the block starts as its shortcut), or None for seed 002's choice: True
        with Range EvoNorm, False otherwise (module docstring). No effect with
        norm="none".

    Inputs are NHWC images ([batch, 32, 32, 3] for CIFAR-10); `train` selects
    batch statistics for the batch-norms (the EvoNorms ignore it).
    """

    depth: int = 20
    num_classes: int = 10
    precision: str = "fp32"
    norm: str | None = None
    groups: int = 8
    zero_init_residual: bool | None = None

    def __post_init__(self):
        norms.resolve_norm(self.norm, self.precision)
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 8:
            raise ValueError(f"depth must be an integer >= 8 (6k + 2); got {self.depth!r}.")
        if not (self.zero_init_residual is None or isinstance(self.zero_init_residual, bool)):
            raise ValueError(
                f"zero_init_residual must be True, False or None; got {self.zero_init_residual!r}."
            )
        super().__post_init__()

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = True) -> jax.Array:
        norm = norms.resolve_norm(self.norm, self.precision)
        zero_init_residual = (
            norm == "range_evonorm" if self.zero_init_residual is None else self.zero_init_residual
        )
        x = QuantConv(
            STAGE_WIDTHS[0],
            (3, 3),
            padding=1,
            use_bias=norm == "none",
            kernel_init=he_normal,
            precision=self.precision,
            name="stem_conv",
        )(x)
        x = norms.norm_act(norm, x, train=train, groups=self.groups, name="stem_norm")
        blocks_per_stage = (self.depth - 2) // 6
        for stage, width in enumerate(STAGE_WIDTHS):
            for block in range(blocks_per_stage):
                x = BasicBlock(
                    width,
                    strides=2 if stage > 0 and block == 0 else 1,
                    precision=self.precision,
                    norm=norm,
                    groups=self.groups,
                    zero_init_residual=zero_init_residual,
                    name=f"stage{stage + 1}_block{block + 1}",
                )(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return QuantDense(self.num_classes, precision=self.precision, name="classifier")(x)


class ResNet20(ResNet):
    """ResNet-20: 3 blocks per stage, 19 convolutions and a classifier.

    Parameters for 10 classes: 273,258 with (Range) EvoNorm (270,906 weights +
    3 x 784 norm parameters), seed 002's Table 1: 0.27M.
    """

    depth: int = 20


class ResNet54(ResNet):
    """seed 002's "ResNet-54": 8 blocks per stage ((54 - 2) // 6, see the module docstring).

    Parameters for 10 classes: 760,458 with (Range) EvoNorm (754,746 weights +
    3 x 1,904 norm parameters), seed 002's Table 1: 0.76M.
    """

    depth: int = 54
