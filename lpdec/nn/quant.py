"""8-bit dense and convolution layers with gradient bifurcation (seed 002, section 3).

The scheme is the 8-bit training of Banner et al. (2018) that seed 002 extends
to decentralized training. For a layer y = x * W (matmul or convolution)::

    forward:   x_q = Q(x), W_q = Q(W)            per-tensor min-max, nearest rounding
               y = x_q * W_q (+ b)               float arithmetic on 8-bit-grid values
    backward:  g_W = dL/dW_q = (x_q)^T g_y       float32: the weight gradient stays precise
               g_x = Q_s(dL/dx_q) = Q_s(g_y W_q^T)  8 bits, stochastic rounding

Both quantizers are passed straight through in the backward pass (the
straight-through estimator: dQ(v)/dv := 1). Only the layer gradient g_x, the
one handed to the previous layer, is quantized; that split is the "gradient
bifurcation" that seed 002 and Banner et al. found necessary for accuracy. The
bias stays float32.

Q is `lpdec.kernels_pallas.minmax_quantize_reference` with the whole tensor as one chunk:
lo = min v, unit = (max v - lo) / (2^b - 1), Q(v) = lo + round((v - lo)/unit) unit.
Stochastic rounding draws its bits from the kernels' counter-based hash, seeded
from the flax rng stream "quant".

Where this differs from the authors' PyTorch code (github.com/aparna-aketi/Low_Precision_DL),
on purpose:
  * activations use this batch's per-tensor min/max; the authors average the
    per-sample min/max and keep running averages of them for evaluation;
  * the stochastically rounded tensor is the layer gradient g_x, as seed 002's
    text describes; the authors' code rounds the incoming g_y on the g_x branch
    only (g_x = Q_s(g_y) W_q^T, which makes that product an 8-bit GEMM);
  * norms, residual additions and pooling stay in float32 (the authors also
    quantize those); see `lpdec.nn.norms`.

References:
  Banner et al., Scalable methods for 8-bit training of neural networks, 2018,
  https://arxiv.org/abs/1805.11046
  Aketi et al., Low Precision Decentralized Distributed Training with
  Heterogeneous Data (seed 002), code at https://github.com/aparna-aketi/Low_Precision_DL
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from flax.linen.linear import PaddingLike
from flax.linen.linear import canonicalize_padding
from flax.linen.linear import default_kernel_init

from lpdec import kernels_pallas

PRECISIONS = ("fp32", "int8")

#: Name of the flax rng stream the int8 layers draw their stochastic rounding from.
QUANT_RNG = "quant"

Initializer = Callable[..., jax.Array]


def check_precision(precision) -> str:
    """Returns `precision` if it is "fp32" or "int8"; raises ValueError otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}; got {precision!r}.")
    return precision


def fake_quant(x: jax.Array, key: jax.Array | None = None, *, bits: int = 8) -> jax.Array:
    """Quantizes and dequantizes `x` with one min-max scale for the whole tensor.

    .. math::

      lo = \\min x,\\quad u = (\\max x - lo) / (2^b - 1),\\quad
      Q(x) = lo + \\mathrm{round}((x - lo) / u)\\, u

    rounding to nearest without a key, stochastically (floor plus a Bernoulli of
    the fraction, so E[Q(x)] = x) with one. A constant tensor is returned
    exactly; NaN/Inf anywhere makes the whole result non-finite.

    Args:
      x: a float array of any shape.
      key: PRNG key for stochastic rounding, or None for nearest rounding.
      bits: code width b, 1..8.

    Returns:
      Q(x), x's shape and dtype, on the 2^b-level grid lo + k u.
    """
    bits = kernels_pallas.check_bits(bits)
    seeds = None if key is None else kernels_pallas.seeds_from_key(key)
    codes, lo, unit = kernels_pallas.minmax_quantize_reference(
        x.reshape(1, -1), seeds, bits=bits, stochastic=key is not None
    )
    return (
        kernels_pallas.minmax_dequantize_reference(codes, lo, unit).reshape(x.shape).astype(x.dtype)
    )


def bifurcated_product(
    product: Callable[[jax.Array, jax.Array], jax.Array],
    x: jax.Array,
    kernel: jax.Array,
    key: jax.Array | None,
    *,
    bits: int = 8,
) -> jax.Array:
    """y = product(Q(x), Q(kernel)) with Banner et al.'s bifurcated backward pass.

    .. math::

      y = f(Q(x), Q(W)),\\qquad
      \\bar W = \\partial_{W_q} f(x_q, W_q)^\\top \\bar y,\\qquad
      \\bar x = Q_s\\big(\\partial_{x_q} f(x_q, W_q)^\\top \\bar y\\big)

    with f = `product` (bilinear: a matmul or convolution), Q nearest-rounding
    `fake_quant`, Q_s its stochastic-rounding version and both quantizers passed
    straight through.

    Args:
      product: f(x, kernel), bilinear; closes over static arguments only.
      x: layer input.
      kernel: layer weights.
      key: PRNG key for the stochastic rounding of the layer gradient. It is
        only needed to differentiate: without one the forward pass works and
        taking a gradient raises a ValueError.
      bits: code width of all three quantizers.

    Returns:
      f(Q(x), Q(kernel)).
    """

    @jax.custom_vjp
    def f(x, kernel, key):
        del key
        return product(fake_quant(x, bits=bits), fake_quant(kernel, bits=bits))

    def f_fwd(x, kernel, key):
        x_q, kernel_q = fake_quant(x, bits=bits), fake_quant(kernel, bits=bits)
        return product(x_q, kernel_q), (x_q, kernel_q, key)

    def f_bwd(residuals, y_bar):
        x_q, kernel_q, key = residuals
        if key is None:
            raise ValueError(
                "an int8 QuantDense/QuantConv needs a 'quant' rng to be differentiated: its "
                "layer gradient is stochastically rounded. Pass rngs={'quant': key} to apply()."
            )
        _, product_vjp = jax.vjp(product, x_q, kernel_q)
        x_bar, kernel_bar = product_vjp(y_bar)
        # Straight-through: the cotangents w.r.t. x_q and W_q are those w.r.t. x and W.
        return fake_quant(x_bar, key, bits=bits), kernel_bar, None

    f.defvjp(f_fwd, f_bwd)
    return f(x, kernel, key)


def int8_matmul(x: jax.Array, kernel: jax.Array, *, bits: int = 8) -> jax.Array:
    """Q(x) @ Q(kernel) computed on the integer codes: GEMMLOWP's form of the int8 forward.

    With Q(x) = lo_x + u_x c_x and Q(W) = lo_w + u_w c_w (unsigned codes, one
    (lo, u) per tensor) and K the contraction length:

    .. math::

      Q(x) Q(W) = K\\,lo_x lo_w + lo_x u_w \\mathbf{1}^\\top c_w + u_x lo_w\\, c_x \\mathbf{1}
                  + u_x u_w\\, (c_x c_w)

    where c_x c_w is an exact integer matmul with int32 accumulation (exact for
    K (2^b - 1)^2 < 2^31, K < 33,025 at 8 bits). This is the arithmetic that
    8-bit hardware runs; it equals `QuantDense`'s int8 forward pass (a float
    matmul of the dequantized operands) up to float32 rounding.

    Args:
      x: [..., K] float input.
      kernel: [K, N] float weights.
      bits: code width, 1..8.

    Returns:
      float32 [..., N].
    """
    bits = kernels_pallas.check_bits(bits)

    def codes(v):
        c, lo, unit = kernels_pallas.minmax_quantize_reference(
            v.reshape(1, -1), None, bits=bits, stochastic=False
        )
        return c.reshape(v.shape), lo[0, 0], unit[0, 0]

    c_x, lo_x, u_x = codes(x)
    c_w, lo_w, u_w = codes(kernel)
    dims = (((x.ndim - 1,), (0,)), ((), ()))
    products = jax.lax.dot_general(c_x, c_w, dims, preferred_element_type=jnp.int32)
    row_sums = jnp.sum(c_x, axis=-1, keepdims=True, dtype=jnp.int32).astype(jnp.float32)
    col_sums = jnp.sum(c_w, axis=0, dtype=jnp.int32).astype(jnp.float32)
    k = x.shape[-1]
    return (
        k * lo_x * lo_w
        + lo_x * u_w * col_sums
        + u_x * lo_w * row_sums
        + u_x * u_w * products.astype(jnp.float32)
    )


def _quant_key(module: nn.Module) -> jax.Array | None:
    """A fresh key from the "quant" stream, or None when the caller passed none."""
    return module.make_rng(QUANT_RNG) if module.has_rng(QUANT_RNG) else None


class QuantDense(nn.Module):
    """`nn.Dense` with an 8-bit mode: quantized forward, bifurcated backward (module docstring).

    In "fp32" mode it computes exactly what `nn.Dense` computes, with the same
    parameters ("kernel" [in, features], "bias" [features]) and initializers.
    In "int8" mode the forward pass is `bifurcated_product` of a matmul; the
    bias is added in float32. Differentiating an int8 layer needs the rng stream
    "quant": `model.apply(variables, x, rngs={"quant": key})`; evaluation does not.

    Attributes:
      features: number of output features.
      use_bias: whether to add a (float32) bias.
      dtype: computation dtype (default: inferred from input and params).
      param_dtype: dtype of the parameters.
      kernel_init: initializer of the kernel.
      bias_init: initializer of the bias.
      precision: "fp32" or "int8": the training precision of seed 002. (This
        is not `nn.Dense`'s `lax.Precision`; the matmul uses the default one.)
      bits: code width of the int8 mode's quantizers (8 in the papers).

    Example:
      >>> layer = QuantDense(4, precision="int8")
      >>> variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
      >>> grads = jax.grad(lambda v: layer.apply(v, jnp.ones((2, 3)),
      ...     rngs={"quant": jax.random.key(1)}).sum())(variables)
    """

    features: int
    use_bias: bool = True
    dtype: jax.typing.DTypeLike | None = None
    param_dtype: jax.typing.DTypeLike = jnp.float32
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = nn.initializers.zeros_init()
    precision: str = "fp32"
    bits: int = 8

    def __post_init__(self):
        check_precision(self.precision)
        kernels_pallas.check_bits(self.bits)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)

        def matmul(lhs, rhs):
            return jax.lax.dot_general(lhs, rhs, (((lhs.ndim - 1,), (0,)), ((), ())))

        if self.precision == "int8":
            y = bifurcated_product(matmul, inputs, kernel, _quant_key(self), bits=self.bits)
        else:
            y = matmul(inputs, kernel)
        if bias is not None:
            y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
        return y


class QuantConv(nn.Module):
    """`nn.Conv` with an 8-bit mode: quantized forward, bifurcated backward (module docstring).

    Channels-last like `nn.Conv` (NWC, NHWC, ...; leading batch dimensions are
    flattened and restored; an unbatched input gets a batch axis for the call).
    In "fp32" mode it computes exactly what `nn.Conv` computes with the same
    parameters ("kernel" [*kernel_size, in / feature_group_count, features],
    "bias" [features]). Supported padding: "SAME", "VALID", an int or a
    sequence of ints / (low, high) pairs (`nn.Conv`'s "CIRCULAR", "REFLECT" and
    "CAUSAL" are not). Differentiating an int8 layer needs the rng stream "quant".

    Attributes:
      features: number of output channels.
      kernel_size: spatial kernel shape; an int means a 1-D kernel (as `nn.Conv`).
      strides: int or one per spatial dimension.
      padding: see above.
      input_dilation: int or one per spatial dimension.
      kernel_dilation: int or one per spatial dimension.
      feature_group_count: number of input feature groups.
      use_bias: whether to add a (float32) bias.
      dtype, param_dtype, kernel_init, bias_init: as in `nn.Conv`.
      precision: "fp32" or "int8" (not a `lax.Precision`).
      bits: code width of the int8 mode's quantizers.
    """

    features: int
    kernel_size: int | Sequence[int]
    strides: int | Sequence[int] = 1
    padding: PaddingLike = "SAME"
    input_dilation: int | Sequence[int] = 1
    kernel_dilation: int | Sequence[int] = 1
    feature_group_count: int = 1
    use_bias: bool = True
    dtype: jax.typing.DTypeLike | None = None
    param_dtype: jax.typing.DTypeLike = jnp.float32
    kernel_init: Initializer = default_kernel_init
    bias_init: Initializer = nn.initializers.zeros_init()
    precision: str = "fp32"
    bits: int = 8

    def __post_init__(self):
        check_precision(self.precision)
        kernels_pallas.check_bits(self.bits)
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        kernel_size = (
            (self.kernel_size,) if isinstance(self.kernel_size, int) else tuple(self.kernel_size)
        )
        num_spatial = len(kernel_size)

        def per_dim(value) -> tuple[int, ...]:
            return (value,) * num_spatial if isinstance(value, int) else tuple(value)

        padding = canonicalize_padding(self.padding, num_spatial)
        if isinstance(padding, str) and padding not in ("SAME", "VALID"):
            raise ValueError(
                f"QuantConv supports padding 'SAME', 'VALID' or explicit sizes; got {padding!r}."
            )
        batch_shape = inputs.shape[: inputs.ndim - num_spatial - 1]
        inputs = inputs.reshape((-1,) + inputs.shape[len(batch_shape) :])
        in_features = inputs.shape[-1]
        if in_features % self.feature_group_count:
            raise ValueError(
                f"feature_group_count={self.feature_group_count} must divide the "
                f"{in_features} input features."
            )
        kernel = self.param(
            "kernel",
            self.kernel_init,
            kernel_size + (in_features // self.feature_group_count, self.features),
            self.param_dtype,
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        # Channels-last input and output, kernel [*spatial, in, out]: nn.Conv's layout.
        channels_last = (0, num_spatial + 1) + tuple(range(1, num_spatial + 1))
        dimension_numbers = jax.lax.ConvDimensionNumbers(
            channels_last, (num_spatial + 1, num_spatial) + tuple(range(num_spatial)), channels_last
        )

        def conv(lhs, rhs):
            return jax.lax.conv_general_dilated(
                lhs,
                rhs,
                per_dim(self.strides),
                padding,
                lhs_dilation=per_dim(self.input_dilation),
                rhs_dilation=per_dim(self.kernel_dilation),
                dimension_numbers=dimension_numbers,
                feature_group_count=self.feature_group_count,
            )

        if self.precision == "int8":
            y = bifurcated_product(conv, inputs, kernel, _quant_key(self), bits=self.bits)
        else:
            y = conv(inputs, kernel)
        if bias is not None:
            y += bias.reshape((1,) * (y.ndim - 1) + (-1,))
        return y.reshape(batch_shape + y.shape[1:])
