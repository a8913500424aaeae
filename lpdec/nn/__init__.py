"""Flax layers for 8-bit decentralized training (seed 002): quantized layers and norms.

lpdec's layers are flax.linen modules. Linen keeps parameters as plain pytrees
outside the module (`variables = model.init(...)`, `model.apply(variables, x)`),
which is what the rest of lpdec is built on: the parameter tree goes straight
into optax and into the algorithms' `GradientTransformation`s, and stacking it
along a leading node axis for `jax.vmap(..., axis_name="nodes")` or
`jax.shard_map` over a mesh axis needs nothing but `jax.tree.map`. nnx modules
hold their state as mutable attributes, so each of those steps would go through
`nnx.split`/`nnx.merge` and nnx's own lifted transforms. The randomness the
int8 layers need is a linen rng stream ("quant", passed as
`rngs={"quant": key}`), which splits per node like any other key. The flax
examples and train.py's style (`train_and_evaluate`, a TrainState of pytrees)
are linen too.
"""

from lpdec.nn.norms import NORMS
from lpdec.nn.norms import EvoNormS0
from lpdec.nn.norms import RangeBatchNorm
from lpdec.nn.norms import RangeEvoNormS0
from lpdec.nn.norms import default_norm
from lpdec.nn.norms import norm_act
from lpdec.nn.norms import range_constant
from lpdec.nn.quant import PRECISIONS
from lpdec.nn.quant import QUANT_RNG
from lpdec.nn.quant import QuantConv
from lpdec.nn.quant import QuantDense
from lpdec.nn.quant import bifurcated_product
from lpdec.nn.quant import fake_quant
from lpdec.nn.quant import int8_matmul

__all__ = [
    "EvoNormS0",
    "NORMS",
    "PRECISIONS",
    "QUANT_RNG",
    "QuantConv",
    "QuantDense",
    "RangeBatchNorm",
    "RangeEvoNormS0",
    "bifurcated_product",
    "default_norm",
    "fake_quant",
    "int8_matmul",
    "norm_act",
    "range_constant",
]
