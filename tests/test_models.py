"""lpdec.models: every model runs forward and backward in fp32 and int8, parameter
counts match seed 002's Table 1, and get_model / the fields validate their arguments."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lpdec import models

BATCH = 2
CIFAR = (BATCH, 32, 32, 3)

# seed 002, Table 1: parameters (millions) of the CIFAR-10 models.
TABLE_1 = {"resnet20": 0.27, "resnet54": 0.76, "vgg11": 9.49}


def init_shapes(model, shape):
    """The variables' shapes, without compiling or running anything."""
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    return jax.eval_shape(lambda: model.init(rngs, jnp.zeros(shape), train=False))


def num_params(variables):
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(variables["params"]))


@pytest.mark.parametrize("name", sorted(TABLE_1))
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_cifar_parameter_counts_match_table_1(name, precision):
    """Table 1 with seed 002's norms (EvoNorm fp32, Range EvoNorm int8: 3 params per channel)."""
    count = num_params(init_shapes(models.get_model(name, precision=precision), CIFAR))
    assert round(count / 1e6, 2) == TABLE_1[name], count


def test_precision_and_norm_keep_the_parameter_tree():
    """fp32/EvoNorm and int8/Range EvoNorm checkpoints are interchangeable."""
    fp32 = init_shapes(models.ResNet20(), CIFAR)
    int8 = init_shapes(models.ResNet20(precision="int8"), CIFAR)
    assert jax.tree.map(lambda a: a.shape, fp32) == jax.tree.map(lambda a: a.shape, int8)


def numpy_init(model, shape, seed=0):
    """Variables of the model's shapes filled on the host (jitting `init` costs seconds).

    Kernels ~ N(0, 1 / fan_in), norm scales and v ~ 1 + N(0, 0.1), biases ~ N(0, 0.1);
    running means 0 and running scales/variances 1.
    """
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = jax.tree_util.keystr(path[-1:])
        if jax.tree_util.keystr(path[:1]) == "['batch_stats']":
            value = np.zeros(leaf.shape) if "mean" in name else np.ones(leaf.shape)
        elif "kernel" in name:
            value = rng.standard_normal(leaf.shape) / math.sqrt(math.prod(leaf.shape[:-1]))
        elif "bias" in name:
            value = 0.1 * rng.standard_normal(leaf.shape)
        else:
            value = 1.0 + 0.1 * rng.standard_normal(leaf.shape)
        return jnp.asarray(value, leaf.dtype)

    return jax.tree_util.tree_map_with_path(fill, init_shapes(model, shape))


def cross_entropy_step(model, shape, *, train=True, mutable=False):
    """Jitted (logits, loss, grads) on a random batch with integer labels."""
    x = jax.random.normal(jax.random.key(0), shape)
    labels = jnp.arange(BATCH) % model.num_classes
    rngs = {"quant": jax.random.key(2), "dropout": jax.random.key(3)}
    variables = numpy_init(model, shape)

    @jax.jit
    def step(variables):
        def loss_fn(params):
            out = model.apply(
                {**variables, "params": params},
                x,
                train=train,
                rngs=rngs,
                mutable=["batch_stats"] if mutable else False,
            )
            logits = out[0] if mutable else out
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
        return logits, loss, grads

    return step(variables)


def assert_trains(model, shape, **kwargs):
    logits, loss, grads = cross_entropy_step(model, shape, **kwargs)
    assert logits.shape == (BATCH, model.num_classes)
    assert np.isfinite(loss)
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(g).all() for g in leaves)
    assert any(np.abs(g).max() > 0 for g in leaves)
    return logits


# Compiling forward + backward costs seconds per model on CPU: ResNet-20/54 are
# exercised through ResNet-8 (same blocks: an identity block and two projection
# blocks) and traced only; VGG-11's backward is compiled once, in int8.
@pytest.mark.parametrize(
    "name, shape, kwargs",
    [
        ("resnet", CIFAR, {"depth": 8}),
        ("resnet", CIFAR, {"depth": 8, "norm": "batchnorm", "mutable": True}),
        ("vgg11", CIFAR, {}),
        ("mlp", (BATCH, 64), {}),
        ("cnn1d", (BATCH, 40), {}),
        ("cnn1d", (BATCH, 40, 1), {"num_classes": 3}),
    ],
)
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_models_run_forward_and_backward(name, shape, kwargs, precision):
    kwargs = dict(kwargs)
    mutable = kwargs.pop("mutable", False)
    if name == "vgg11" and precision == "fp32":
        model = models.VGG11()
        x = jnp.ones(shape)
        logits = jax.jit(lambda v: model.apply(v, x, train=False))(numpy_init(model, shape))
        assert logits.shape == (BATCH, 10) and np.isfinite(logits).all()
        return
    build = models.ResNet if name == "resnet" else functools.partial(models.get_model, name)
    assert_trains(build(precision=precision, **kwargs), shape, mutable=mutable)


@pytest.mark.parametrize("name", ["resnet20", "resnet54"])
@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_resnets_trace_forward_and_backward(name, precision):
    """ResNet-20/54 build and trace (shapes and dtypes only, nothing compiled)."""
    model = models.get_model(name, precision=precision)
    x = jax.ShapeDtypeStruct(CIFAR, jnp.float32)
    variables = init_shapes(model, CIFAR)
    rngs = {"quant": jax.random.key(0)}
    logits = jax.eval_shape(lambda v, x: model.apply(v, x, rngs=rngs), variables, x)
    assert logits.shape == (BATCH, 10) and logits.dtype == jnp.float32
    grads = jax.eval_shape(jax.grad(lambda v, x: model.apply(v, x, rngs=rngs).sum()), variables, x)
    assert jax.tree.structure(grads) == jax.tree.structure(variables)


@pytest.mark.parametrize(
    "name, shape, norm",
    [
        ("cnn1d", (BATCH, 40), "batchnorm"),
        ("cnn1d", (BATCH, 40), "range_batchnorm"),
        ("cnn1d", (BATCH, 40), "none"),
        ("cnn1d", (BATCH, 40), "evonorm"),
        ("mlp", (BATCH, 64), "range_batchnorm"),
    ],
)
def test_small_models_with_every_norm(name, shape, norm):
    model = models.get_model(name, norm=norm, precision="int8")
    assert_trains(model, shape, mutable="batchnorm" in norm)


def test_cnn1d_accepts_both_input_layouts():
    model = models.CNN1D()
    x = jax.random.normal(jax.random.key(0), (BATCH, 40))
    variables = numpy_init(model, x.shape)
    apply = jax.jit(model.apply)
    np.testing.assert_array_equal(apply(variables, x), apply(variables, x[..., None]))


def test_int8_model_gradient_needs_quant_rng():
    model = models.MLP(precision="int8")
    x = jnp.ones((BATCH, 64))
    params = init_shapes(model, x.shape)["params"]
    with pytest.raises(ValueError, match="quant"):
        jax.eval_shape(jax.grad(lambda p: model.apply({"params": p}, x).sum()), params)


def test_get_model_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="cnn1d, mlp, resnet20, resnet54, transformer, vgg11"):
        models.get_model("resnet18")


@pytest.mark.parametrize("name", sorted(models.MODELS))
@pytest.mark.parametrize(
    "kwargs, argument",
    [({"precision": "fp16"}, "precision"), ({"norm": "groupnorm"}, "norm")],
)
def test_bad_model_arguments_name_the_argument(name, kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        models.get_model(name, **kwargs)


def test_resnet_depth_is_validated():
    with pytest.raises(ValueError, match="depth"):
        models.ResNet(depth=6)


def test_resnet20_int8_runs_forward():
    model = models.ResNet20(precision="int8")
    x = jax.random.normal(jax.random.key(0), CIFAR)
    logits = jax.jit(lambda v: model.apply(v, x))(numpy_init(model, CIFAR))
    assert logits.shape == (BATCH, 10) and np.isfinite(logits).all()
