"""A decoder-only transformer language model (GPT-2's layout with pre-norm blocks).

Each of `num_layers` blocks is pre-norm, GPT-2 style::

    x = x + attn_out(causal_attention(qkv(norm1(x))))
    x = x + mlp_out(gelu(mlp_in(norm2(x))))

between a learned token embedding plus a learned absolute position embedding
(GPT-2's; RoPE would save the `context x d_model` position table but learned
positions keep the model a plain parameter tree of dense matrices) and a final
norm followed by the output projection, which by default is the token embedding
transposed (tied, as GPT-2). Attention is `causal_attention` (`attention_implementation=
"lpdec"`: XLA's attention with its backward written out, 1.9x faster forward and
backward on one CPU thread) or `jax.nn.dot_product_attention(..., is_causal=True,
implementation=attention_implementation)` ("xla", "cudnn"). Its default (None) is
"lpdec" on CPU and "xla" on other backends (jax does not pick cuDNN by itself in
jax 0.10-0.12); on GPUs, `attention_implementation="cudnn"` with
`dtype=jnp.bfloat16` (or float16) selects cuDNN's fused flash attention, which
jax allows for head dims that are multiples of 8 up to 128 (256 from Hopper).
GELU is GPT-2's tanh approximation; there is no dropout.

Initialisation follows GPT-2: every matrix and embedding is normal with
standard deviation 0.02, except the two residual projections of each block
(`attn_out`, `mlp_out`), whose standard deviation is 0.02 / sqrt(2 num_layers)
so that the residual stream's variance does not grow with depth; biases are 0,
norm scales 1.

Parameters (d = d_model, V = vocab_size, m = mlp_ratio, n = 2d for LayerNorm's
scale and bias or d for RMSNorm's scale)::

    V d (tokens) + context d (positions) + n (final norm) [+ d V untied head]
    + num_layers ((2m + 4) d^2 + (m + 5) d + 2 n)    qkv 3d^2 + 3d, attn_out d^2 + d,
                                                  mlp_in m d^2 + m d, mlp_out m d^2 + d

`transformer_param_count` evaluates this. With V = 256 (bytes), LayerNorm, tied:

- tiny (d 64, 2 layers, 4 heads, context 64): 120,576 parameters;
- small (d 256, 4 layers, 4 heads, context 128): 3,257,856;
- gpu (d 768, 12 layers, 12 heads, context 1024): 86,039,040. GPT-2 small's
  124,439,808 is this size with GPT-2's vocabulary of 50,257 BPE tokens; with
  bytes, 18 layers (128,566,272) or d 896 in 13 layers (14 heads of 64,
  126,539,392) come near 125M.

Every parameter leaf's size is a multiple of d_model, so it divides by 8
whenever d_model does (all the sizes above): leaves can be split evenly over up
to 8 workers. The small leaves are the norms' scales and biases and the biases
of `attn_out` and `mlp_out` ([d] each) and of `qkv` ([3d]) and `mlp_in` ([m d]).

Example:
  >>> import jax, jax.numpy as jnp
  >>> model = Transformer(d_model=64, num_layers=2, num_heads=4, context=64)
  >>> tokens = jnp.zeros((2, 16), jnp.uint8)
  >>> variables = model.init(jax.random.key(0), tokens)
  >>> model.apply(variables, tokens).shape
  (2, 16, 256)

References:
  Radford et al., Language Models are Unsupervised Multitask Learners (GPT-2), 2019,
  https://cdn.openai.com/better-language-models/language_models_are_unsupervised_multitask_learners.pdf
  Xiong et al., On Layer Normalization in the Transformer Architecture, 2020,
  https://arxiv.org/abs/2002.04745
"""

from __future__ import annotations

import math
from typing import Any
from typing import Literal

import flax.linen as nn
import jax
import jax.numpy as jnp

#: The transformer's normalization choices (None means "layernorm").
TRANSFORMER_NORMS = ("layernorm", "rmsnorm")
#: Attention's implementations: "lpdec" (`causal_attention`, its backward from the
#: saved probabilities), or `jax.nn.dot_product_attention`'s "xla" and "cudnn"; None:
#: "lpdec" on CPU, "xla" elsewhere.
ATTENTION_IMPLEMENTATIONS = (None, "lpdec", "xla", "cudnn")

_INIT_STD = 0.02
_NORM_EPSILON = 1e-5


@jax.custom_vjp
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention [batch, T, heads, head_dim] -> the same shape.

    The function of ``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` with
    XLA's implementation: logits q k^T / sqrt(head_dim) in float32, the future masked,
    a softmax in float32, probabilities cast to `v`'s dtype. Its backward is written
    out from the probabilities the forward saved (dP = dO V^T, dS = P (dP - rowsum(P
    dP)) / sqrt(head_dim), dQ = dS K, dK = dS^T Q, dV = P^T dO), where autodiff of the
    masked softmax makes several more passes over the [batch, heads, T, T] logits:
    on one CPU thread lm_tiny's attention takes 2.1 ms forward and backward a layer
    against 4.0 (BENCHMARKS.md, "bench/step_ops.py"). The same memory: autodiff keeps
    the probabilities too.
    """
    return _attention_forward(q, k, v)[0]


def _attention_forward(q, k, v):
    length = q.shape[1]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
    logits = logits * (1.0 / math.sqrt(q.shape[-1]))
    causal = jnp.arange(length)[:, None] >= jnp.arange(k.shape[1])[None, :]
    probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    out = jnp.einsum("bnts,bsnh->btnh", probs.astype(v.dtype), v)
    return out, (q, k, v, probs)


def _attention_backward(saved, grad_out):
    q, k, v, probs = saved
    grad_v = jnp.einsum("bnts,btnh->bsnh", probs.astype(v.dtype), grad_out)
    grad_probs = jnp.einsum("btnh,bsnh->bnts", grad_out, v, preferred_element_type=jnp.float32)
    grad_logits = probs * (grad_probs - jnp.sum(probs * grad_probs, axis=-1, keepdims=True))
    grad_logits = (grad_logits * (1.0 / math.sqrt(q.shape[-1]))).astype(q.dtype)
    grad_q = jnp.einsum("bnts,bsnh->btnh", grad_logits, k)
    grad_k = jnp.einsum("bnts,btnh->bsnh", grad_logits, q)
    return grad_q, grad_k, grad_v


causal_attention.defvjp(_attention_forward, _attention_backward)


def _rows(layer):
    """`layer` applied to [..., d] as one matrix of rows [-1, d]: the same products, but
    the weight gradient contracts one axis instead of (batch, T), which XLA:CPU lays out
    without a transposing copy (lm_tiny's step on one thread: 0.026 s against 0.032,
    BENCHMARKS.md "bench/step_ops.py")."""

    def apply(h: jax.Array) -> jax.Array:
        out = layer(h.reshape(-1, h.shape[-1]))
        return out.reshape(*h.shape[:-1], out.shape[-1])

    return apply


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")


def _resolve_norm(norm: str | None) -> str:
    if norm is None:
        return "layernorm"
    if norm not in TRANSFORMER_NORMS:
        raise ValueError(
            f"norm={norm!r} is not a transformer norm; use one of {TRANSFORMER_NORMS} "
            "(None: 'layernorm')."
        )
    return norm


def _make_norm(norm: str, dtype: Any, name: str) -> nn.Module:
    if norm == "rmsnorm":
        return nn.RMSNorm(epsilon=_NORM_EPSILON, dtype=dtype, param_dtype=jnp.float32, name=name)
    return nn.LayerNorm(epsilon=_NORM_EPSILON, dtype=dtype, param_dtype=jnp.float32, name=name)


class _Block(nn.Module):
    """One pre-norm block: causal multi-head self-attention, then a GELU MLP."""

    d_model: int
    num_heads: int
    mlp_ratio: int
    residual_std: float
    norm: str
    dtype: Any
    attention_implementation: Literal["lpdec", "xla", "cudnn"] | None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, d = x.shape
        head_dim = d // self.num_heads

        def dense(features: int, std: float, name: str):
            return _rows(
                nn.Dense(
                    features,
                    dtype=self.dtype,
                    param_dtype=jnp.float32,
                    kernel_init=nn.initializers.normal(std),
                    name=name,
                )
            )

        # qkv's 3d outputs are [q | k | v], each d wide and head-major (head h at h*head_dim).
        qkv = dense(3 * d, _INIT_STD, "qkv")(_make_norm(self.norm, self.dtype, "norm1")(x))
        qkv = qkv.reshape(batch, length, 3, self.num_heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        implementation = self.attention_implementation
        if implementation is None:  # the faster measured: lpdec's on CPU (causal_attention)
            implementation = "lpdec" if jax.default_backend() == "cpu" else "xla"
        with jax.named_scope("attention"):  # (profiles name its ops by it)
            if implementation == "lpdec":
                heads = causal_attention(q, k, v)
            else:
                heads = jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation=implementation
                )
        x = x + dense(d, self.residual_std, "attn_out")(heads.reshape(batch, length, d))

        h = dense(self.mlp_ratio * d, _INIT_STD, "mlp_in")(
            _make_norm(self.norm, self.dtype, "norm2")(x)
        )
        with jax.named_scope("gelu"):
            h = nn.gelu(h, approximate=True)
        return x + dense(d, self.residual_std, "mlp_out")(h)


class Transformer(nn.Module):
    """A GPT-2-like decoder-only language model: tokens [batch, T] -> logits [batch, T, V].

    See the module docstring for the layout, initialisation and parameter counts.
    Parameters are float32; `dtype` is the compute dtype (e.g. jnp.bfloat16 on
    GPUs); the logits are returned in float32.

    Attributes:
      vocab_size: tokens V (256 for bytes).
      context: the longest sequence, the rows of the position embedding.
      d_model: width of the residual stream; a multiple of `num_heads`.
      num_layers: transformer blocks.
      num_heads: attention heads, each d_model / num_heads wide.
      mlp_ratio: the MLP's hidden width is mlp_ratio * d_model.
      tie_embeddings: whether the output projection is the token embedding
        transposed (GPT-2) or a separate bias-free Dense ("head").
      norm: "layernorm" or "rmsnorm"; None (what `get_model` passes by
        default) is "layernorm".
      dtype: compute dtype.
      attention_implementation: "lpdec" (`causal_attention`), or "xla" or "cudnn"
        (GPUs only, with a 16-bit `dtype`): `jax.nn.dot_product_attention`'s
        `implementation`; None: "lpdec" on CPU, "xla" elsewhere.
      precision: must be "fp32" (accepted because every model of
        `lpdec.models.MODELS` takes it; int8 is for the CNNs and the MLP).
      num_classes: None, or the number of classes the training loop's data set
        has, which for a language model must equal vocab_size (it is checked,
        not used to set vocab_size, so a mismatch between the data and the
        model is an error rather than a silent resize).

    Example:
      >>> from lpdec.models import get_model
      >>> model = get_model("transformer", num_classes=256, d_model=64, num_heads=4)
    """

    vocab_size: int = 256
    context: int = 128
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    norm: str | None = "layernorm"
    dtype: Any = jnp.float32
    attention_implementation: Literal["lpdec", "xla", "cudnn"] | None = None
    precision: str = "fp32"
    num_classes: int | None = None

    def __post_init__(self):
        for field in ("vocab_size", "context", "d_model", "num_layers", "num_heads", "mlp_ratio"):
            _check_positive_int(field, getattr(self, field))
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} must be a multiple of num_heads={self.num_heads}."
            )
        _resolve_norm(self.norm)
        if self.precision != "fp32":
            raise ValueError(
                f"precision={self.precision!r}: the transformer trains in 'fp32' only (dtype= "
                "sets a 16-bit compute dtype); int8 is for the CNNs and the MLP."
            )
        if self.num_classes is not None and self.num_classes != self.vocab_size:
            raise ValueError(
                f"num_classes={self.num_classes!r} must equal vocab_size={self.vocab_size} "
                "(a language model's classes are its tokens); set vocab_size to match the data."
            )
        if not jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating):
            raise ValueError(f"dtype must be a floating dtype; got {self.dtype!r}.")
        if self.attention_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"attention_implementation={self.attention_implementation!r} is not one of "
                f"{ATTENTION_IMPLEMENTATIONS}."
            )
        if self.attention_implementation == "cudnn" and jnp.dtype(self.dtype) not in (
            jnp.dtype(jnp.bfloat16),
            jnp.dtype(jnp.float16),
        ):
            raise ValueError(
                "attention_implementation='cudnn' needs dtype bfloat16 or float16; "
                f"got {jnp.dtype(self.dtype).name}."
            )
        super().__post_init__()

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = True) -> jax.Array:
        """Logits float32 [batch, T, vocab_size] of the next token after each position.

        Args:
          tokens: integers (any integer dtype, e.g. uint8 bytes) [batch, T] in
            [0, vocab_size), T <= context.
          train: unused (no dropout); accepted like every model's.
        """
        del train
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be integers [batch, T]; got {tokens.dtype} of shape {tokens.shape}."
            )
        length = tokens.shape[1]
        if length > self.context:
            raise ValueError(f"tokens hold T={length} positions, more than context={self.context}.")
        norm = _resolve_norm(self.norm)
        init = nn.initializers.normal(_INIT_STD)
        embed = nn.Embed(
            self.vocab_size,
            self.d_model,
            dtype=self.dtype,
            param_dtype=jnp.float32,
            embedding_init=init,
            name="token_embed",
        )
        positions = self.param("position_embed", init, (self.context, self.d_model), jnp.float32)
        x = embed(tokens.astype(jnp.int32)) + positions[:length].astype(self.dtype)
        residual_std = _INIT_STD / math.sqrt(2 * self.num_layers)
        for i in range(self.num_layers):
            x = _Block(
                self.d_model,
                self.num_heads,
                self.mlp_ratio,
                residual_std,
                norm,
                self.dtype,
                self.attention_implementation,
                name=f"block{i}",
            )(x)
        x = _make_norm(norm, self.dtype, "norm_final")(x)
        if self.tie_embeddings:
            logits = _rows(embed.attend)(x)
        else:
            logits = _rows(
                nn.Dense(
                    self.vocab_size,
                    use_bias=False,
                    dtype=self.dtype,
                    param_dtype=jnp.float32,
                    kernel_init=init,
                    name="head",
                )
            )(x)
        return logits.astype(jnp.float32)


def transformer_param_count(**fields) -> int:
    """Parameters of `Transformer(**fields)`, by the module docstring's formula (no init).

    Example:
      >>> transformer_param_count(d_model=64, num_layers=2, num_heads=4, context=64)
      120576
    """
    model = Transformer(**fields)  # validates the fields; builds no parameters
    d, ratio = model.d_model, model.mlp_ratio
    norm = 2 * d if _resolve_norm(model.norm) == "layernorm" else d
    block = (
        2 * norm
        + (d * 3 * d + 3 * d)  # qkv
        + (d * d + d)  # attn_out
        + (d * ratio * d + ratio * d)  # mlp_in
        + (ratio * d * d + d)  # mlp_out
    )
    head = 0 if model.tie_embeddings else d * model.vocab_size
    return model.vocab_size * d + model.context * d + model.num_layers * block + norm + head
