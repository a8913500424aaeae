"""lpdec.models.Transformer against a float64 numpy transformer, causality, counts, training."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from lpdec import models
from lpdec.models import transformer

TINY = dict(vocab_size=256, context=16, d_model=32, num_layers=2, num_heads=4, mlp_ratio=4)
# The sizes the language-model workload uses (lpdec/models/transformer.py's docstring).
SIZES = {
    "default": {},
    "tiny": dict(d_model=64, num_layers=2, num_heads=4, context=64),
    "small": dict(d_model=256, num_layers=4, num_heads=4, context=128),
    "gpu": dict(d_model=768, num_layers=12, num_heads=12, context=1024),
}


def random_tokens(seed, shape, vocab=256):
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.uint8)


def param_shapes(model, length=4):
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, length), jnp.int32))


def init_params(model, seed=0):
    return jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))["params"]


def randomized_params(model, seed=0, std=0.3):
    """Parameters with every leaf drawn from N(0, std^2), so that all of them matter."""
    leaves, treedef = jax.tree.flatten(param_shapes(model)["params"])
    rng = np.random.default_rng(seed)
    fresh = [rng.normal(0.0, std, leaf.shape).astype(np.float32) for leaf in leaves]
    return jax.tree.unflatten(treedef, fresh)


# ---------------------------------------------------------------- numpy reference


def np_norm(x, p, kind, eps=1e-5):
    if kind == "rmsnorm":
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * p["scale"]
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * p["scale"] + p["bias"]


def np_gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def np_causal_attention(q, k, v):
    """q, k, v [T, heads, head_dim] -> [T, heads, head_dim]; position i sees keys j <= i."""
    length, _, head_dim = q.shape
    out = np.zeros_like(q)
    for h in range(q.shape[1]):
        for i in range(length):
            scores = np.array([q[i, h] @ k[j, h] for j in range(i + 1)]) / math.sqrt(head_dim)
            weights = np.exp(scores - scores.max())
            weights /= weights.sum()
            out[i, h] = sum(weights[j] * v[j, h] for j in range(i + 1))
    return out


def np_transformer(params, tokens, *, num_heads, norm="layernorm", tie=True):
    """GPT-2 pre-norm forward pass of one sequence in float64, from the parameter tree."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    embedding = p["token_embed"]["embedding"]
    x = embedding[tokens] + p["position_embed"][: len(tokens)]
    d = x.shape[1]
    block_names = sorted((k for k in p if k.startswith("block")), key=lambda k: int(k[5:]))
    for name in block_names:
        b = p[name]
        h = np_norm(x, b["norm1"], norm)
        qkv = h @ b["qkv"]["kernel"] + b["qkv"]["bias"]
        q, k, v = (
            qkv[:, i * d : (i + 1) * d].reshape(len(tokens), num_heads, -1) for i in (0, 1, 2)
        )
        heads = np_causal_attention(q, k, v).reshape(len(tokens), d)
        x = x + heads @ b["attn_out"]["kernel"] + b["attn_out"]["bias"]
        h = np_norm(x, b["norm2"], norm)
        h = np_gelu_tanh(h @ b["mlp_in"]["kernel"] + b["mlp_in"]["bias"])
        x = x + h @ b["mlp_out"]["kernel"] + b["mlp_out"]["bias"]
    x = np_norm(x, p["norm_final"], norm)
    return x @ (embedding.T if tie else p["head"]["kernel"])


@pytest.mark.parametrize("norm, tie", [("layernorm", True), ("rmsnorm", False)])
def test_matches_a_float64_numpy_transformer(norm, tie):
    model = models.Transformer(**TINY, norm=norm, tie_embeddings=tie)
    params = randomized_params(model)
    tokens = random_tokens(1, (2, 11))
    logits = np.asarray(jax.jit(model.apply)({"params": params}, tokens))
    for row in range(tokens.shape[0]):
        expected = np_transformer(params, tokens[row], num_heads=4, norm=norm, tie=tie)
        np.testing.assert_allclose(logits[row], expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- shapes, causality


@pytest.mark.parametrize("dtype", [np.uint8, np.int32])
@pytest.mark.parametrize("length", [1, 16])
def test_logits_are_float32_batch_by_length_by_vocab(dtype, length):
    model = models.Transformer(**TINY)
    tokens = random_tokens(0, (3, length)).astype(dtype)
    variables = {"params": init_params(model)}
    logits = jax.jit(model.apply, static_argnames="train")(variables, tokens, train=False)
    assert logits.shape == (3, length, 256) and logits.dtype == jnp.float32
    assert np.isfinite(logits).all()


def test_bfloat16_compute_keeps_float32_parameters_and_logits():
    tokens = random_tokens(0, (2, 16))
    fp32 = models.Transformer(**TINY)
    bf16 = models.Transformer(**TINY, dtype=jnp.bfloat16)
    variables = {"params": randomized_params(fp32, std=0.1)}
    assert {leaf.dtype for leaf in jax.tree.leaves(param_shapes(bf16))} == {jnp.dtype(jnp.float32)}
    low = jax.jit(bf16.apply)(variables, tokens)
    assert low.dtype == jnp.float32
    high = jax.jit(fp32.apply)(variables, tokens)
    np.testing.assert_allclose(low, high, atol=0.05 * np.abs(high).max())


def test_the_default_attention_is_lpdecs_on_cpu_and_xlas_agrees():
    tokens = random_tokens(4, (2, 9))
    default = models.Transformer(**TINY)
    params = {"params": randomized_params(default)}
    lpdec_attention = models.Transformer(**TINY, attention_implementation="lpdec")
    xla = models.Transformer(**TINY, attention_implementation="xla")
    logits = jax.jit(default.apply)(params, tokens)
    np.testing.assert_array_equal(jax.jit(lpdec_attention.apply)(params, tokens), logits)
    np.testing.assert_allclose(jax.jit(xla.apply)(params, tokens), logits, rtol=1e-5, atol=1e-5)


def test_causal_attentions_gradients_match_float64_finite_differences():
    """The written-out backward against central differences of the float64 numpy
    attention, for a random cotangent: d<out, c>/d(q, k, v)."""
    rng = np.random.default_rng(7)
    q, k, v, cotangent = (rng.normal(size=(1, 5, 2, 3)) for _ in range(4))

    def objective(q, k, v):
        return float(np.sum(np_causal_attention(q[0], k[0], v[0]) * cotangent[0]))

    expected = []
    for which in range(3):
        inputs = [q.copy(), k.copy(), v.copy()]
        grad = np.zeros_like(inputs[which])
        for index in np.ndindex(grad.shape):
            step = 1e-6
            inputs[which][index] += step
            up = objective(*inputs)
            inputs[which][index] -= 2 * step
            down = objective(*inputs)
            inputs[which][index] += step
            grad[index] = (up - down) / (2 * step)
        expected.append(grad)
    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    out, vjp = jax.vjp(transformer.causal_attention, *f32)
    got = vjp(jnp.asarray(cotangent, jnp.float32))
    np.testing.assert_allclose(out[0], np_causal_attention(q[0], k[0], v[0]), rtol=1e-5, atol=1e-6)
    for name, g, e in zip("qkv", got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_token_changes_no_logit_before_it_and_the_logits_at_it():
    model = models.Transformer(**TINY)
    params = randomized_params(model, seed=3)
    length = TINY["context"]
    base = random_tokens(2, (length,))
    # Row 0 is the sequence; row 1 + t has token t replaced.
    batch = np.tile(base, (length + 1, 1))
    for t in range(length):
        batch[1 + t, t] = (int(base[t]) + 1 + t) % 256
    logits = np.asarray(jax.jit(model.apply)({"params": params}, batch))
    for t in range(length):
        np.testing.assert_allclose(logits[1 + t, :t], logits[0, :t], rtol=0, atol=1e-6)
        assert np.abs(logits[1 + t, t] - logits[0, t]).max() > 1e-3


# ---------------------------------------------------------------- initialisation, counts


def test_initialisation_is_gpt2s():
    model = models.Transformer(vocab_size=256, context=128, d_model=128, num_layers=3, num_heads=4)
    params = init_params(model)
    residual = 0.02 / math.sqrt(2 * 3)
    stds = {"qkv": 0.02, "mlp_in": 0.02, "attn_out": residual, "mlp_out": residual}
    for name, std in stds.items():
        kernel = np.asarray(params["block1"][name]["kernel"])
        assert abs(kernel.std() / std - 1) < 0.05, name
        assert not np.asarray(params["block1"][name]["bias"]).any()
    for table in (params["token_embed"]["embedding"], params["position_embed"]):
        assert abs(np.asarray(table).std() / 0.02 - 1) < 0.05
    np.testing.assert_array_equal(params["norm_final"]["scale"], 1.0)


def leaf_sizes(model):
    return [leaf.size for leaf in jax.tree.leaves(param_shapes(model))]


@pytest.mark.parametrize(
    "fields",
    [
        {},
        dict(TINY, norm="rmsnorm"),
        dict(TINY, tie_embeddings=False, mlp_ratio=2),
        dict(vocab_size=1000, context=40, d_model=48, num_layers=3, num_heads=6),
        *SIZES.values(),
    ],
)
def test_param_count_formula_equals_the_initialised_count(fields):
    assert models.transformer_param_count(**fields) == sum(leaf_sizes(models.Transformer(**fields)))


def test_gpt2_small_has_its_published_parameter_count():
    # GPT-2 small (124M): 50,257 tokens, context 1024, d 768, 12 layers, tied embeddings.
    gpt2 = dict(vocab_size=50257, context=1024, d_model=768, num_layers=12, num_heads=12)
    assert models.transformer_param_count(**gpt2) == 124_439_808


def test_untying_adds_one_d_by_vocab_head():
    tied = sum(leaf_sizes(models.Transformer(**TINY)))
    untied = sum(leaf_sizes(models.Transformer(**TINY, tie_embeddings=False)))
    assert untied - tied == TINY["d_model"] * TINY["vocab_size"]


@pytest.mark.parametrize("size", sorted(SIZES))
def test_every_leaf_divides_over_8_workers(size):
    sizes = leaf_sizes(models.Transformer(**SIZES[size]))
    assert all(s % 8 == 0 for s in sizes), sizes


# ---------------------------------------------------------------- training


def test_adam_steps_learn_a_repeated_sequence():
    fields = dict(TINY, num_layers=1)
    model = models.get_model("transformer", precision="fp32", norm=None, num_classes=256, **fields)
    sequence = np.tile(np.frombuffer(b"lpdec!", np.uint8), 3)[: TINY["context"] + 1]
    inputs, targets = sequence[None, :-1], sequence[None, 1:]
    params = init_params(model)
    tx = optax.adam(1e-2)

    def loss_fn(p):
        logits = model.apply({"params": p}, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    @jax.jit
    def step(p, state):
        loss, grads = jax.value_and_grad(loss_fn)(p)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    state = tx.init(params)
    losses = []
    for _ in range(25):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[0] > 0.9 * math.log(256)
    assert losses[-1] < 0.3 * losses[0]


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(d_model=30, num_heads=4), "d_model=30 must be a multiple of num_heads=4"),
        (dict(num_layers=0), "num_layers"),
        (dict(precision="int8"), "int8 is for the CNNs"),
        (dict(precision="fp16"), "precision='fp16'"),
        (dict(norm="evonorm"), "norm='evonorm'"),
        (dict(num_classes=10), "num_classes=10 must equal vocab_size=256"),
        (dict(dtype=jnp.int32), "dtype"),
        (dict(attention_implementation="flash"), "attention_implementation='flash'"),
        (dict(attention_implementation="cudnn"), "needs dtype bfloat16 or float16; got float32"),
    ],
)
def test_bad_fields_raise_one_line_errors(fields, match):
    with pytest.raises(ValueError, match=match) as error:
        models.get_model("transformer", **fields)
    assert "\n" not in str(error.value)


def test_num_classes_equal_to_the_vocabulary_is_accepted():
    model = models.get_model("transformer", num_classes=100, vocab_size=100)
    assert model.vocab_size == 100


@pytest.mark.parametrize(
    "tokens, match",
    [
        (np.zeros((1, 17), np.int32), "T=17 positions, more than context=16"),
        (np.zeros((1, 4), np.float32), "integers"),
        (np.zeros((4,), np.int32), "integers"),
    ],
)
def test_bad_tokens_raise_one_line_errors(tokens, match):
    model = models.Transformer(**TINY)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(model.init, jax.random.key(0), tokens)
