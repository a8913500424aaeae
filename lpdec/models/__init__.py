"""Models of seed 002 and for the offline datasets, and a transformer language model.

`get_model(name, **kwargs)` builds one by name; every model takes `precision`
("fp32" | "int8"), `norm` (None: EvoNorm-S0 for fp32, Range EvoNorm-S0 for int8)
and `num_classes`, and is called as `model.apply(variables, x, train=...)`. The
"transformer" takes them too but is fp32 only (`dtype` sets its compute dtype),
its norms are "layernorm" (None) and "rmsnorm", and `num_classes` must equal its
`vocab_size`; it maps tokens [batch, T] to logits [batch, T, vocab_size].
"""

import flax.linen as nn

from lpdec.models.resnet import ResNet
from lpdec.models.resnet import ResNet20
from lpdec.models.resnet import ResNet54
from lpdec.models.small import CNN1D
from lpdec.models.small import MLP
from lpdec.models.transformer import Transformer
from lpdec.models.transformer import transformer_param_count
from lpdec.models.vgg import VGG11

MODELS = {
    "cnn1d": CNN1D,
    "mlp": MLP,
    "resnet20": ResNet20,
    "resnet54": ResNet54,
    "transformer": Transformer,
    "vgg11": VGG11,
}


def get_model(name: str, **kwargs) -> nn.Module:
    """The model called `name` (a key of `MODELS`), built with `kwargs`.

    Example:
      >>> model = get_model("resnet20", precision="int8", num_classes=10)
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid names: {', '.join(sorted(MODELS))}.")
    return MODELS[name](**kwargs)


__all__ = [
    "CNN1D",
    "MLP",
    "MODELS",
    "ResNet",
    "ResNet20",
    "ResNet54",
    "Transformer",
    "VGG11",
    "get_model",
    "transformer_param_count",
]
