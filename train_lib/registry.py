"""What the configs choose by name: one table per kind, name -> factory and fields.

Every entry says which config fields its factory reads (`fields`), and the
factory gets a view of the config holding those fields only, so the table
cannot drift from the code: to follow `config.gamma` from the command line to
its use, find "gamma" here. `train_lib.setup` is the only user.

A rule about one entry's values is the entry's own: its `check`, run before
anything is built, or the library factory's ValueError, which `build` turns
into one ConfigError line. Rules about the run as a whole are in `setup`.

Objects built from other tables (the topology, the compressor, the
learning-rate schedule) and the layout's axis names reach the algorithms
through `Built`. The tables' machinery (`Entry`, `build`) is `train_lib.tables`;
the schedules, local optimizers and DiLoCo's outer step are `train_lib.optimizers`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Callable

import ml_collections
import optax

import lpdec
from train_lib import optimizers
from train_lib.errors import ConfigError
from train_lib.tables import Entry
from train_lib.tables import build
from train_lib.tables import choose


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry(Entry):
    """An lpdec algorithm: `build(view, built)` calls `factory` (None: the local optimizer alone).

    Its place in the chain is the factory's declared role (`lpdec.algorithms.declaration`):
    "gossip" after the local optimizer, "mean" before it, on the gradients, and "whole"
    (`lpdec.diloco`) wrapping it, `build(view, built, local, outer)`.
    """

    factory: Callable[..., optax.GradientTransformation] | None = None

    @property
    def role(self) -> str | None:
        return None if self.factory is None else lpdec.algorithms.role_of(self.factory)


def uniform(factory, **entry) -> AlgorithmEntry:
    """The entry of a factory with the uniform signature (docs/DESIGN.md, "Anatomy").

    Each of `topology, compressor, axis_name, local_axis` the factory takes comes from
    `Built`, each of `gamma, seed` from the config: the entry is written once, here.
    """
    parameters = inspect.signature(factory).parameters
    fields = tuple(name for name in ("gamma", "seed") if name in parameters)

    def build_it(c, b: Built):
        given = {
            "topology": b.topology,
            "compressor": b.compressor,
            "axis_name": b.axis_name,
            "local_axis": b.local_axis,
        }
        args = {name: value for name, value in given.items() if name in parameters}
        # `lpdec.<name>` looked up when built, as the lambdas of the other tables do.
        current = getattr(lpdec, factory.__name__)
        return current(**args, **{name: getattr(c, name) for name in fields})

    return AlgorithmEntry(build_it, fields, factory=factory, **entry)


@dataclasses.dataclass(frozen=True)
class Built:
    """What an algorithm gets besides its config fields.

    `local_axis` is set on a hierarchical run: `axis_name` then joins the
    machines and `local_axis` the workers of each (`make_chain`).
    """

    topology: lpdec.Topology
    compressor: lpdec.Compressor
    schedule: optax.Schedule
    axis_name: str | tuple[str, str]
    local_axis: str | None


# ----------------------------------------------------------------------------
# Data sets (`setup` caches the loaded ones).
# ----------------------------------------------------------------------------


def _check_data_dir(c, dataset: str, holds: str) -> None:
    """`config.data_dir` is set, and a directory: the one that holds `holds`."""
    if not c.data_dir:
        raise ConfigError(f"config.dataset={dataset!r} needs config.data_dir: {holds}.")
    if not os.path.isdir(c.data_dir):
        raise ConfigError(
            f"config.data_dir={c.data_dir!r} is not a directory; for config.dataset="
            f"{dataset!r} it holds {holds}."
        )


def _check_cifar10(c) -> None:
    _check_data_dir(
        c, "cifar10", "the CIFAR-10 binary version (data_batch_1.bin ... test_batch.bin)"
    )


def _check_stdlib_text(c) -> None:
    if not isinstance(c.sequence_length, int) or c.sequence_length < 1:
        raise ConfigError(
            f"config.sequence_length={c.sequence_length!r} must be a positive integer."
        )
    for field in ("text_bytes", "validation_windows"):
        value = getattr(c, field)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"config.{field}={value!r} must be an integer >= 0 (0 = all).")
    if c.data_dir and not os.path.isdir(c.data_dir):
        raise ConfigError(
            f"config.data_dir={c.data_dir!r} is not a directory; for dataset 'stdlib_text' it "
            "holds .py text files ('' = this Python's standard library)."
        )


def _check_text_files(c) -> None:
    _check_data_dir(c, "text_files", "your text files (any extension)")
    _check_stdlib_text(c)


# The vocabulary of a token file is the model's: the config field it is read from.
VOCAB = "model_kwargs.vocab_size"


def _check_token_file(c) -> None:
    _check_data_dir(c, "token_file", "train.bin and val.bin (flat arrays of token ids)")
    if c.token_dtype not in lpdec.data.text.TOKEN_DTYPES:
        raise ConfigError(
            f"config.token_dtype={c.token_dtype!r} is not one of: "
            f"{', '.join(lpdec.data.text.TOKEN_DTYPES)}."
        )
    vocab = getattr(c, VOCAB)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(
            f"config.{VOCAB}={vocab!r}: config.dataset='token_file' needs the tokenizer's "
            "vocabulary size there (a positive integer; configs/lm_tiny.py and the configs "
            "built on it have the field)."
        )
    _check_stdlib_text(c)


DATASETS = {
    "cifar10": Entry(lambda c: lpdec.data.cifar10(c.data_dir), ("data_dir",), check=_check_cifar10),
    "digits": Entry(lambda c: lpdec.data.digits()),
    "mnist1d": Entry(lambda c: lpdec.data.mnist1d(num_samples=c.num_samples), ("num_samples",)),
    # The running Python's standard library sources (or data_dir's .py files), bytes as
    # tokens; a fixed split (seed 0) whatever config.seed is, so seeds share it.
    "stdlib_text": Entry(
        check=_check_stdlib_text,
        build=lambda c: lpdec.data.stdlib_text(
            context=c.sequence_length,
            max_bytes=c.text_bytes or None,
            validation_windows=c.validation_windows or None,
            root=c.data_dir or None,
        ),
        fields=("sequence_length", "text_bytes", "validation_windows", "data_dir"),
    ),
    "synthetic": Entry(
        lambda c: lpdec.data.synthetic(c.num_samples, 16, 4, c.seed), ("num_samples", "seed")
    ),
    # Your own text: every file under data_dir, any extension, bytes as tokens.
    "text_files": Entry(
        check=_check_text_files,
        build=lambda c: lpdec.data.text_directory(
            c.data_dir,
            context=c.sequence_length,
            max_bytes=c.text_bytes or None,
            validation_windows=c.validation_windows or None,
        ),
        fields=("sequence_length", "text_bytes", "validation_windows", "data_dir"),
    ),
    # A pre-tokenized corpus: data_dir/train.bin and val.bin (nanoGPT's), read by memmap.
    "token_file": Entry(
        check=_check_token_file,
        build=lambda c: lpdec.data.token_file(
            c.data_dir,
            vocab_size=getattr(c, VOCAB),
            context=c.sequence_length,
            dtype=c.token_dtype,
            max_bytes=c.text_bytes or None,
            validation_windows=c.validation_windows or None,
        ),
        fields=("sequence_length", "text_bytes", "validation_windows", "data_dir", "token_dtype")
        + (VOCAB,),
    ),
}
#: The data sets a language model ("transformer") trains on, and only it.
TEXT_DATASETS = ("stdlib_text", "text_files", "token_file")


# ----------------------------------------------------------------------------
# Topologies.
# ----------------------------------------------------------------------------


def _torus(c) -> lpdec.Topology:
    # torus_rows = 0: the squarest torus, rows <= columns.
    rows = c.torus_rows or max(
        r for r in range(1, math.isqrt(c.num_nodes) + 1) if c.num_nodes % r == 0
    )
    if c.num_nodes % rows:
        raise ConfigError(
            f"config.torus_rows={rows} does not divide config.num_nodes={c.num_nodes}."
        )
    return lpdec.torus(rows, c.num_nodes // rows)


TOPOLOGIES = {
    "complete": Entry(lambda c: lpdec.complete(c.num_nodes), ("num_nodes",)),
    "directed_ring": Entry(lambda c: lpdec.directed_ring(c.num_nodes), ("num_nodes",)),
    "exponential": Entry(lambda c: lpdec.exponential(c.num_nodes), ("num_nodes",)),
    "one_peer_exponential": Entry(
        lambda c: lpdec.one_peer_exponential(c.num_nodes), ("num_nodes",)
    ),
    "random_matching": Entry(
        lambda c: lpdec.random_matching(c.num_nodes, c.seed), ("num_nodes", "seed")
    ),
    "ring": Entry(lambda c: lpdec.ring(c.num_nodes), ("num_nodes",)),
    "torus": Entry(_torus, ("num_nodes", "torus_rows")),
}


# ----------------------------------------------------------------------------
# Compressors of what crosses the wire.
# ----------------------------------------------------------------------------


def _chunk_of(c) -> int:
    """config.chunk_size for chunked_top_k; None: the library's default (4096, SparseLoCo's)."""
    return lpdec.chunked_top_k().chunk_size if c.chunk_size is None else c.chunk_size


def _chunked_top_k(c) -> lpdec.compress.ChunkedTopK:
    # k = round(ratio * chunk_size): ratio = 1/64 keeps SparseLoCo's 64 of 4096.
    chunk = _chunk_of(c)
    return lpdec.chunked_top_k(round(c.ratio * chunk), chunk_size=chunk, bits=c.bits)


def _check_chunked_top_k(c) -> None:
    chunk = _chunk_of(c)
    # A chunk_size the library refuses is its ValueError, which `build` reports.
    if isinstance(chunk, int) and chunk >= 1 and not 1 <= round(c.ratio * chunk) <= chunk:
        raise ConfigError(
            f"config.ratio={c.ratio!r} keeps round(ratio * chunk_size) = "
            f"{round(c.ratio * chunk)} entries of each {chunk}-element chunk "
            f"(config.chunk_size={c.chunk_size!r}); chunked_top_k needs 1 to {chunk}."
        )
    if c.rounding != "nearest":
        raise ConfigError(
            f"config.rounding={c.rounding!r}: config.compressor='chunked_top_k' rounds to "
            "nearest only (error feedback carries what it loses)."
        )


COMPRESSORS = {
    "chunked_top_k": Entry(
        _chunked_top_k,
        ("ratio", "chunk_size", "bits"),
        check=_check_chunked_top_k,
        check_fields=("rounding",),
    ),
    "identity": Entry(lambda c: lpdec.identity()),
    "minmax": Entry(
        lambda c: lpdec.minmax(
            bits=c.bits, rounding=c.rounding, chunk_size=c.chunk_size, tree_layout=c.tree_layout
        ),
        ("bits", "rounding", "chunk_size", "tree_layout"),
    ),
    # The MX block-scaled floats fix their own widths (4.25 and 8.25 bits per value).
    "mxfp4": Entry(lambda c: lpdec.mx("fp4", rounding=c.rounding), ("rounding",)),
    "mxfp8": Entry(lambda c: lpdec.mx("fp8", rounding=c.rounding), ("rounding",)),
    "modulo": Entry(
        lambda c: lpdec.modulo(bits=c.bits, theta=c.theta, rounding=c.rounding),
        ("bits", "theta", "rounding"),
    ),
    "random_k": Entry(lambda c: lpdec.random_k(c.ratio), ("ratio",)),
    "top_k": Entry(lambda c: lpdec.top_k(c.ratio), ("ratio",)),
}


# ----------------------------------------------------------------------------
# Algorithms: `build(view, built)`.
# ----------------------------------------------------------------------------


def _moniqua(c, b: Built) -> optax.GradientTransformation:
    theta = None
    if c.theta_follows_lr:
        # seed 003, Theorem 2: the a-priori bound proportional to the step size.
        theta = lambda step: c.theta * b.schedule(step) / c.learning_rate  # noqa: E731
    return lpdec.moniqua(
        b.topology,
        lpdec.modulo(bits=c.bits, theta=c.theta, rounding=c.rounding),
        theta=theta,
        axis_name=b.axis_name,
        slack=c.slack,
        seed=c.seed,
    )


def _check_moniqua(c) -> None:
    # Moniqua sends its own modulo codes of config.bits bits: another compressor
    # (and its ratio) would be silently ignored.
    if c.compressor not in ("minmax", "modulo"):
        raise ConfigError(
            f"config.algorithm='moniqua' quantizes with its own modulo codes (config.bits, "
            f"config.theta); config.compressor={c.compressor!r} would be ignored: "
            "leave config.compressor at 'minmax' or 'modulo'."
        )


def _check_flat(c) -> None:
    """Algorithms with nothing compressed to send between a hierarchical run's machines."""
    if c.hierarchical:
        raise ConfigError(
            "config.hierarchical=True needs compressed_mean or a gossip algorithm; "
            f"config.algorithm={c.algorithm!r} has no compressed exchange between machines."
        )


def _d2(c, b: Built) -> optax.GradientTransformation:
    # The identity compressor means plain D2, with nothing to compress.
    comp = None if isinstance(b.compressor, lpdec.compress.Identity) else b.compressor
    return lpdec.d2(b.topology, comp, axis_name=b.axis_name, seed=c.seed)


def _clipped_gossip(c, b: Built) -> optax.GradientTransformation:
    if b.local_axis is not None:
        raise ConfigError(
            "config.algorithm='clipped_gossip' clips each neighbour's whole model; "
            "config.hierarchical=True would split the model over a machine's workers: "
            "set hierarchical=False."
        )
    # The identity compressor means the float32 models travel, with no public copies.
    comp = None if isinstance(b.compressor, lpdec.compress.Identity) else b.compressor
    return lpdec.clipped_gossip(b.topology, comp, gamma=c.gamma, axis_name=b.axis_name, seed=c.seed)


# ----------------------------------------------------------------------------
# Local steps with an outer optimizer (`lpdec.diloco`): the exchanges of its
# pseudo-gradients, `build(view, built)` -> the outer chain (exchange and outer step).
# ----------------------------------------------------------------------------


def _check_compressed_mean_fields_unused(c) -> None:
    """mean_rounds and error_decay belong to exchange='compressed_mean'."""
    for field, default in (("mean_rounds", 2), ("error_decay", 1.0)):
        if getattr(c, field) != default:
            raise ConfigError(
                f"config.{field}={getattr(c, field)!r} needs config.exchange='compressed_mean'; "
                f"got {c.exchange!r}."
            )


def _check_mean_exchange(c) -> None:
    optimizers.check_outer(c)
    _check_compressed_mean_fields_unused(c)
    if c.error_feedback:
        raise ConfigError(
            "config.error_feedback=True needs config.exchange='compressed_mean': "
            "exchange='mean' sends full precision and has no compression error to feed back."
        )


def _mean_exchange(c, b: Built) -> optax.GradientTransformation:
    axes = b.axis_name if b.local_axis is None else (b.axis_name, b.local_axis)
    return optax.chain(lpdec.local_mean(axis_name=axes), optimizers.outer(c))


def _compressed_mean_exchange(c, b: Built) -> optax.GradientTransformation:
    mean = lpdec.compressed_mean(
        b.compressor,
        axis_name=b.axis_name,
        local_axis=b.local_axis,
        seed=c.seed,
        error_feedback=c.error_feedback,
        rounds=c.mean_rounds,
        error_decay=c.error_decay,
    )
    return optax.chain(mean, optimizers.outer(c))


def _check_compressed_mean_exchange(c) -> None:
    optimizers.check_outer(c)
    if c.mean_rounds not in (1, 2):
        raise ConfigError(
            f"config.mean_rounds={c.mean_rounds!r} must be 2 (scatter-reduce + all-gather) "
            "or 1 (an all-gather of every machine's payload)."
        )
    if not 0 < c.error_decay <= 1 or (c.error_decay != 1 and not c.error_feedback):
        raise ConfigError(
            f"config.error_decay={c.error_decay!r} must be in (0, 1], and below 1 only with "
            "config.error_feedback=True (it decays the residual)."
        )
    if c.compressor == "modulo":
        raise ConfigError(
            "config.compressor='modulo' cannot serve config.exchange='compressed_mean': it "
            "decodes against the receiver's own model, and a mean of pseudo-gradients has none."
        )


def _check_gossip_exchange(c) -> None:
    optimizers.check_outer(c)
    _check_compressed_mean_fields_unused(c)
    if c.error_feedback:
        raise ConfigError(
            "config.error_feedback=True does not apply to config.exchange='gossip': CHOCO's "
            "replicas already carry the compression error to the next exchange."
        )


def _gossip_exchange(c, b: Built) -> optax.GradientTransformation:
    choco = lpdec.choco(b.topology, b.compressor, gamma=c.gamma, axis_name=b.axis_name, seed=c.seed)
    if b.local_axis is None:
        return optax.chain(optimizers.outer(c), choco)
    # Hierarchical: the workers of a machine average their pseudo-gradients, take the
    # same outer step, and gossip 1/k of the anchor each with the other machines.
    return optax.chain(
        lpdec.local_mean(axis_name=b.local_axis),
        optimizers.outer(c),
        lpdec.shard_over(choco, axis_name=b.local_axis),
    )


EXCHANGES = {
    "mean": Entry(
        _mean_exchange,
        ("error_feedback", *optimizers.OUTER),
        check=_check_mean_exchange,
        check_fields=("mean_rounds", "error_decay", "exchange"),
    ),
    "compressed_mean": Entry(
        _compressed_mean_exchange,
        ("error_feedback", "seed", "mean_rounds", "error_decay", *optimizers.OUTER),
        check=_check_compressed_mean_exchange,
        check_fields=("compressor",),
    ),
    "gossip": Entry(
        _gossip_exchange,
        ("error_feedback", "gamma", "seed", *optimizers.OUTER),
        check=_check_gossip_exchange,
        check_fields=("mean_rounds", "error_decay", "exchange"),
    ),
}


def _check_diloco(c) -> None:
    # lpdec.diloco checks local_steps too; this names the config field.
    if not isinstance(c.local_steps, int) or c.local_steps < 1:
        raise ConfigError(f"config.local_steps={c.local_steps!r} must be an integer >= 1 (H).")
    if c.overlap and c.local_steps == 1:
        raise ConfigError(
            "config.overlap=True needs config.local_steps > 1: the exchange overlaps with "
            "the next round's local steps, and with local_steps=1 there are none."
        )
    steps = c.sync_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"config.sync_steps={steps!r} must be an integer >= 0.")
    if steps % c.local_steps:
        raise ConfigError(
            f"config.sync_steps={steps} must be a multiple of config.local_steps="
            f"{c.local_steps}: rounds end on the same steps as without the warm-up."
        )


def _diloco(c, b: Built, local, outer, sync=None) -> optax.GradientTransformation:
    axes = b.axis_name
    if b.local_axis is not None:
        # Hierarchical: a machine's workers train ONE model in its local steps (their
        # gradients averaged over the fast links, as data parallelism inside a machine
        # does), so the exchange averages the machines' models.
        axes = (b.axis_name, b.local_axis)
        local = lpdec.chain(local, on_gradients=(lpdec.local_mean(axis_name=b.local_axis),))
    return lpdec.diloco(
        local,
        outer,
        local_steps=c.local_steps,
        overlap=c.overlap,
        sync_steps=c.sync_steps,
        sync=sync,
        axis_name=axes,
    )


ALGORITHMS = {
    "choco": uniform(lpdec.choco),
    # Byzantine-robust: each neighbour's model difference clipped to the adaptive radius.
    "clipped_gossip": AlgorithmEntry(
        _clipped_gossip, ("gamma", "seed"), factory=lpdec.clipped_gossip
    ),
    "d2": AlgorithmEntry(_d2, ("seed",), factory=lpdec.d2),
    "dcd": uniform(lpdec.dcd),
    "deepsqueeze": uniform(lpdec.deepsqueeze),
    "dpsgd": uniform(lpdec.dpsgd),
    "moniqua": AlgorithmEntry(
        _moniqua,
        ("bits", "theta", "theta_follows_lr", "learning_rate", "slack", "rounding", "seed"),
        check=_check_moniqua,
        check_fields=("compressor",),
        factory=lpdec.moniqua,
    ),
    "naive_quantized": uniform(lpdec.naive_quantized),
    "quant_sgp": uniform(lpdec.quant_sgp),
    "sparse_push": uniform(lpdec.sparse_push),
    # Centralized: full-precision data parallelism (a mean of the gradients) and
    # seed 001/004's compressed mean, hierarchical when `local_axis` is set.
    # Hierarchical, a mean over the machines and the workers; with config.shard_model the
    # workers' gradients are already their machine's mean (each worker holds a block), so
    # each worker all-reduces its block over the machines: the link carries one model.
    "allreduce": AlgorithmEntry(
        lambda c, b: lpdec.local_mean(
            axis_name=b.axis_name if b.local_axis is None else (b.axis_name, b.local_axis)
        ),
        factory=lpdec.local_mean,
    ),
    "compressed_mean": uniform(lpdec.compressed_mean),
    # H local steps of the local optimizer, then config.exchange (EXCHANGES) and the
    # outer Nesterov step: the whole optimizer, `build(view, built, local, outer)`.
    "diloco": AlgorithmEntry(
        _diloco,
        ("local_steps", "overlap", "sync_steps"),
        check=_check_diloco,
        factory=lpdec.diloco,
    ),
    # Independent nodes: the local optimizer alone.
    "none": AlgorithmEntry(
        lambda c, b: None, check=_check_flat, check_fields=("algorithm", "hierarchical")
    ),
}


def make_chain(
    config: ml_collections.ConfigDict, local: optax.GradientTransformation, built: Built
) -> optax.GradientTransformation:
    """The local optimizer chained with `config.algorithm` where its role puts it (`lpdec.chain`).

    Hierarchical gossip (`built.local_axis` set): the workers of a machine average
    their gradients in full precision, take the same local step, and run the
    algorithm between the machines on 1/k of the model each (`lpdec.shard_over`).
    Low-precision parameters train on a float32 master copy (`lpdec.chain` adds it;
    for float32 parameters the chain is itself).
    """
    # setup.check_values checked every choice: build only (`checked=True`).
    entry = choose(config, "algorithm", ALGORITHMS)
    if entry.role == "whole":
        outer = build(config, "exchange", EXCHANGES, built, checked=True)
        # The synchronous warm-up: the same exchange, with a plain outer step of 1.
        sync = None
        if config.sync_steps:
            plain = optimizers.PLAIN_STEP
            sync = build(config, "exchange", EXCHANGES, built, overrides=plain, checked=True)
        whole = build(config, "algorithm", ALGORITHMS, built, local, outer, sync, checked=True)
        return lpdec.master_weights(whole)
    algorithm = build(config, "algorithm", ALGORITHMS, built, checked=True)
    if algorithm is None:
        return lpdec.chain(local)
    if entry.role == "mean":
        return lpdec.chain(local, on_gradients=(algorithm,))
    if built.local_axis is not None:
        worker_mean = lpdec.local_mean(axis_name=built.local_axis)
        between = lpdec.shard_over(algorithm, axis_name=built.local_axis)
        return lpdec.chain(local, between, on_gradients=(worker_mean,))
    return lpdec.chain(local, algorithm)
