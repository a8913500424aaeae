"""Builds lpdec objects from names: what `train.py`'s configs choose by string.

Each `make_*` takes plain values (as found in an `ml_collections.ConfigDict`)
and raises a `ValueError` with one clear line naming the field and the valid
choices, so a bad config fails before anything is traced.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import optax

from lpdec import compress
from lpdec import topology as topo
from lpdec.algorithms.choco import choco
from lpdec.algorithms.compressed_mean import compressed_mean
from lpdec.algorithms.d2 import d2
from lpdec.algorithms.dcd import dcd
from lpdec.algorithms.deepsqueeze import deepsqueeze
from lpdec.algorithms.dpsgd import dpsgd
from lpdec.algorithms.local_mean import local_mean
from lpdec.algorithms.moniqua import moniqua
from lpdec.algorithms.naive_quantized import naive_quantized
from lpdec.algorithms.qg_momentum import qg_momentum
from lpdec.algorithms.quant_sgp import quant_sgp
from lpdec.algorithms.sparse_push import sparse_push

# Gossip algorithms go last in the chain; centralized ones first (on gradients).
GOSSIP_ALGORITHMS = (
    "choco",
    "d2",
    "dcd",
    "deepsqueeze",
    "dpsgd",
    "moniqua",
    "naive_quantized",
    "quant_sgp",
    "sparse_push",
)
CENTRAL_ALGORITHMS = ("allreduce", "compressed_mean", "none")
ALGORITHMS = GOSSIP_ALGORITHMS + CENTRAL_ALGORITHMS
COMPRESSORS = ("identity", "minmax", "modulo", "random_k", "top_k")
TOPOLOGIES = (
    "complete",
    "directed_ring",
    "exponential",
    "one_peer_exponential",
    "random_matching",
    "ring",
    "torus",
)
OPTIMIZERS = ("adam", "nesterov", "qg_momentum", "sgd")
SCHEDULES = ("constant", "cosine", "piecewise")


class ConfigError(ValueError):
    """A config value that cannot work, with a message naming the field."""


def _choice(field: str, value, choices) -> str:
    if value not in choices:
        raise ConfigError(f"config.{field}={value!r} is not one of: {', '.join(choices)}.")
    return value


def make_topology(
    name: str, num_nodes: int, *, seed: int = 0, torus_rows: int = 0
) -> topo.Topology:
    """A topology by name for `num_nodes` nodes (torus: `torus_rows` x rest, or squarest)."""
    _choice("topology", name, TOPOLOGIES)
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigError(f"config.num_nodes must be a positive integer; got {num_nodes!r}.")
    if name == "torus":
        rows = torus_rows or max(
            r for r in range(1, math.isqrt(num_nodes) + 1) if num_nodes % r == 0
        )
        if num_nodes % rows:
            raise ConfigError(
                f"config.torus_rows={rows} does not divide config.num_nodes={num_nodes}."
            )
        return topo.torus(rows, num_nodes // rows)
    if name == "random_matching":
        return topo.random_matching(num_nodes, seed)
    return getattr(topo, name)(num_nodes)


def make_compressor(
    name: str,
    *,
    bits: int = 8,
    rounding: str = "nearest",
    chunk_size: int = 2048,
    ratio: float = 0.01,
    theta: float = 1.0,
) -> compress.Compressor:
    """A compressor by name; invalid values raise with the field name."""
    _choice("compressor", name, COMPRESSORS)
    try:
        if name == "identity":
            return compress.identity()
        if name == "minmax":
            return compress.minmax(bits=bits, rounding=rounding, chunk_size=chunk_size)
        if name == "modulo":
            return compress.modulo(bits=bits, theta=theta, rounding=rounding)
        if name == "top_k":
            return compress.top_k(ratio)
        return compress.random_k(ratio)
    except ValueError as error:
        raise ConfigError(f"config compressor {name!r}: {error}") from None


def make_schedule(
    name: str,
    learning_rate: float,
    total_steps: int,
    boundaries=(),
    decay: float = 0.1,
    warmup: int = 0,
) -> optax.Schedule:
    """constant, cosine (to 0 over total_steps) or piecewise (x decay at each boundary step)."""
    _choice("lr_schedule", name, SCHEDULES)
    if not learning_rate > 0:
        raise ConfigError(f"config.learning_rate must be > 0; got {learning_rate!r}.")
    if name == "constant":
        schedule = optax.constant_schedule(learning_rate)
    elif name == "cosine":
        schedule = optax.cosine_decay_schedule(learning_rate, max(1, total_steps - warmup))
    else:
        schedule = optax.piecewise_constant_schedule(
            learning_rate, {int(b): decay for b in boundaries}
        )
    if warmup:
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, learning_rate, warmup), schedule], [warmup]
        )
    return schedule


def make_local_optimizer(
    name: str, schedule: optax.Schedule, *, momentum: float = 0.9, weight_decay: float = 0.0
) -> optax.GradientTransformation:
    """The node's own optimizer: sgd, nesterov (SGD + Nesterov momentum), qg_momentum, adam."""
    _choice("optimizer", name, OPTIMIZERS)
    if name == "sgd":
        opt = optax.sgd(schedule, momentum=momentum or None)
    elif name == "nesterov":
        opt = optax.sgd(schedule, momentum=momentum, nesterov=True)
    elif name == "qg_momentum":
        opt = qg_momentum(schedule, momentum=momentum, nesterov=True)
    else:
        opt = optax.adam(schedule)
    if weight_decay:
        return optax.chain(optax.add_decayed_weights(weight_decay), opt)
    return opt


def make_algorithm(
    name: str,
    topology: topo.Topology,
    compressor: compress.Compressor,
    *,
    axis_name,
    local_axis: str | None = None,
    gamma: float = 1.0,
    theta: float | Callable = 1.0,
    slack: float = 1.0,
    seed: int = 0,
) -> optax.GradientTransformation | None:
    """The communication transform by name (None for "none": independent nodes).

    "allreduce" is full-precision data parallelism (a mean of the gradients).
    Errors from the algorithms' own checks (e.g. a topology they cannot use)
    are re-raised as `ConfigError` naming `config.algorithm`.
    """
    _choice("algorithm", name, ALGORITHMS)
    bits = getattr(compressor, "bits", 8)
    rounding = getattr(compressor, "rounding", "nearest")
    try:
        builders = {
            "dpsgd": lambda: dpsgd(topology, axis_name=axis_name),
            "naive_quantized": lambda: naive_quantized(
                topology, compressor, axis_name=axis_name, seed=seed
            ),
            "dcd": lambda: dcd(topology, compressor, axis_name=axis_name, seed=seed),
            "choco": lambda: choco(topology, compressor, gamma, axis_name=axis_name, seed=seed),
            "deepsqueeze": lambda: deepsqueeze(
                topology, compressor, gamma, axis_name=axis_name, seed=seed
            ),
            "quant_sgp": lambda: quant_sgp(
                topology, compressor, gamma, axis_name=axis_name, seed=seed
            ),
            "sparse_push": lambda: sparse_push(
                topology, compressor, gamma, axis_name=axis_name, seed=seed
            ),
            "moniqua": lambda: moniqua(
                topology,
                bits,
                theta,
                axis_name=axis_name,
                slack=slack,
                rounding=rounding,
                seed=seed,
            ),
            "d2": lambda: d2(
                topology,
                axis_name=axis_name,
                comp=None if isinstance(compressor, compress.Identity) else compressor,
                seed=seed,
            ),
            "compressed_mean": lambda: compressed_mean(
                compressor, axis_name=axis_name, local_axis=local_axis, seed=seed
            ),
            "allreduce": lambda: local_mean(axis_name=axis_name),
            "none": lambda: None,
        }
        return builders[name]()
    except (ValueError, TypeError) as error:
        raise ConfigError(f"config.algorithm={name!r}: {error}") from None


def make_chain(
    algorithm_name: str,
    local: optax.GradientTransformation,
    algorithm: optax.GradientTransformation | None,
) -> optax.GradientTransformation:
    """Gossip algorithms after the local optimizer, centralized ones before it."""
    if algorithm is None:
        return local
    if algorithm_name in CENTRAL_ALGORITHMS:
        return optax.chain(algorithm, local)
    return optax.chain(local, algorithm)
