"""Models of seed 002 and for the offline datasets, each in fp32 or int8 precision.

`get_model(name, **kwargs)` builds one by name; every model takes `precision`
("fp32" | "int8"), `norm` (None: EvoNorm-S0 for fp32, Range EvoNorm-S0 for int8)
and `num_classes`, and is called as `model.apply(variables, x, train=...)`.
"""

import flax.linen as nn

from lpdec.models.resnet import ResNet
from lpdec.models.resnet import ResNet20
from lpdec.models.resnet import ResNet54
from lpdec.models.small import CNN1D
from lpdec.models.small import MLP
from lpdec.models.vgg import VGG11

MODELS = {
    "cnn1d": CNN1D,
    "mlp": MLP,
    "resnet20": ResNet20,
    "resnet54": ResNet54,
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
    "VGG11",
    "get_model",
]
