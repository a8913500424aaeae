"""Config -> the objects of a training run, once: `build(config) -> Experiment`.

`build` checks the config's plain values first (one `ConfigError` line per
problem, naming the field), then builds through `registry`'s tables: a
wrong name or a value a factory rejects stops the run there, before anything
is traced. The training loop, checkpointing and logging read the frozen
`Experiment` and nothing else of the config's choices.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any
from typing import NoReturn

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax

import lpdec
from configs import default as default_config
from lpdec.layout import NodeLayout
from lpdec.layout import make_layout
from train_lib import optimizers
from train_lib import registry
from train_lib import tables
from train_lib.errors import ConfigError

PRECISIONS = ("fp32", "int8")
#: configs/default.py's values: the one place a field's default (its "off") is written.
DEFAULTS = default_config.get_config()
#: DiLoCo's fields: a run of another algorithm leaves them at their defaults.
LOCAL_STEP_FIELDS = (
    "local_steps",
    "overlap",
    "error_feedback",
    "mean_rounds",
    "error_decay",
    "outer_warmup_rounds",
    "outer_decay_rounds",
    "outer_slow_momentum",
    "outer_slow_weight",
    "sync_steps",
)
#: An elastic run's own fields and their values.
ELASTIC_CHOICES = {
    "elastic_data": ("shard", "whole"),
    "elastic_mean": ("contributors", "slots"),
    "elastic_budget": ("rounds", "samples"),
    "elastic_transport": ("service", "peers"),
}
#: How a multi-process run sums over its processes (`lpdec.host_sum`).
PROCESS_SUMS = ("auto", "jax", "host")


@dataclasses.dataclass(frozen=True)
class LoopPlan:
    """When the training loop logs, evaluates, saves and stops.

    Attributes:
      log_every: steps per compiled chunk; metrics and evaluation after each.
      checkpoint_every: steps between checkpoints (a multiple of log_every; 0 = only
        at the end, a halt or a stop).
      halt_after_steps: stop (with a checkpoint) this many steps after the run's start
        or resumption; 0 = run to the end.
      eval_local_examples: test examples each node's own model is evaluated on (0: none,
        and the metrics have no `*_local_mean` fields).
      divergence_factor: a loss above this times a uniform guess's counts as diverged
        (0 = never stop a run for its loss).
      divergence_patience: log intervals in a row of such a loss that stop the run.
      save_final_params: export the final parameters (not after a stop by a signal).
      replicas_identical: a mean of the gradients (the all-reduce, the compressed
        mean) leaves every node with the same bits, so each node's own model is the
        averaged model and evaluating it sends nothing.
      evaluate_anchor: DiLoCo without overlap: after a step that ends an exchange
        round, its anchor, the same on every node, stands for the averaged model
        (`train_lib.evaluation`), so evaluating sends nothing between nodes.
    """

    log_every: int
    checkpoint_every: int
    halt_after_steps: int
    eval_local_examples: int
    divergence_factor: float
    divergence_patience: int
    save_final_params: bool
    evaluate_anchor: bool = False
    replicas_identical: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class Experiment:
    """Everything a run needs that the config determines.

    Attributes:
      config_dict: the config as a plain dict, for summary.json and the checkpoints'
        fingerprint; the loop reads the fields below, not this.
      dataset: the train/test split.
      partitions: one array of training-sample indices per node.
      batch_size: examples per node and step.
      augment: whether the batches are augmented (random crops and flips).
      seed: the seed of the model's initialization and the algorithms' randomness.
      layout: the nodes on the devices.
      model: the flax model.
      topology: the gossip topology (built for every algorithm, used by gossip).
      compressor: what crosses the wire (used by the compressing algorithms).
      schedule: the learning rate by step.
      tx: the optax chain of the local optimizer and the lpdec algorithm.
      exchange_every: steps per exchange between nodes (DiLoCo's local steps, else 1).
      total_steps: steps of the whole run.
      steps_per_epoch: steps for every node to see its partition once.
      loop: when the loop logs, saves and stops.
      shard_plan: with `config.shard_model`, how each machine's model is split over its
        workers (`lpdec.fsdp`); None when every node holds its whole model.
    """

    config_dict: dict[str, Any]
    dataset: lpdec.data.Dataset
    partitions: tuple[np.ndarray, ...]
    batch_size: int
    augment: bool
    seed: int
    layout: NodeLayout
    model: nn.Module
    topology: lpdec.Topology
    compressor: lpdec.Compressor
    schedule: optax.Schedule
    tx: optax.GradientTransformation
    exchange_every: int
    total_steps: int
    steps_per_epoch: int
    loop: LoopPlan
    shard_plan: lpdec.fsdp.ShardPlan | None = None


def example_input(dataset: lpdec.data.Dataset) -> np.ndarray:
    """One training input as the model reads it (a language model: a window's first T tokens)."""
    x = dataset.x_train[:1]
    return x[:, :-1] if dataset.task == "next_token" else x


def build(config: ml_collections.ConfigDict, *, checked: bool = False) -> Experiment:
    """Checks `config` and builds its objects; raises `ConfigError` naming a bad field.

    `checked`: the caller ran `check_values` already (an elastic machine checks the run's
    config and builds its `machine_config`).
    """
    if not checked:
        check_values(config)
    devices = jax.devices()[: config.devices] if config.devices else None
    layout = make_layout(config.num_nodes, machines=machine_count(config), devices=devices)
    axis_name, local_axis, gossip_nodes = layout.axis_name, None, config.num_nodes
    if config.shard_model:
        # One model per machine, split over its workers; the algorithm runs between the
        # machines on each worker's blocks (the gradients are already the machine's mean).
        axis_name, gossip_nodes = layout.machine_axis, layout.machines
    elif config.hierarchical and layout.hierarchical:
        # Machines x workers (processes, or config.machines simulated): full precision
        # inside a machine, the algorithm's exchange between machines.
        axis_name, local_axis = layout.machine_axis, layout.worker_axis
        gossip_nodes = layout.machines
    elif config.hierarchical:
        # Seed 004 in one process: the mesh axis joins the "machines" (the devices), the
        # nested vmap axis the workers inside each.
        axis_name, local_axis = layout.mesh_axis, layout.local_axis
        gossip_nodes = layout.mesh.size
    # The topology is checked here, not in check_values: it joins gossip_nodes nodes
    # (the machines of a hierarchical run), which the layout decides.
    topology = tables.build(
        config, "topology", registry.TOPOLOGIES, overrides={"num_nodes": gossip_nodes}
    )
    compressor = tables.build(config, "compressor", registry.COMPRESSORS, checked=True)

    dataset = load_dataset(config)
    partitions = lpdec.data.skew_partition(
        dataset.y_train, config.num_nodes, config.skew, config.seed
    )
    # An epoch is one pass of every node over its own data.
    samples = sum(len(p) for p in partitions)
    steps_per_epoch = max(1, samples // (config.num_nodes * config.batch_size))
    total_steps = max(1, config.num_steps or int(round(config.num_epochs * steps_per_epoch)))

    schedule = optimizers.make_schedule(config, total_steps)
    local = optimizers.make_local_optimizer(config, schedule)
    built = registry.Built(topology, compressor, schedule, axis_name, local_axis)
    tx = registry.make_chain(config, local, built)

    try:
        model = lpdec.models.get_model(
            config.model,
            precision=config.precision,
            norm=config.norm or None,
            num_classes=dataset.num_classes,
            **dict(config.model_kwargs),
        )
    except (TypeError, ValueError) as error:
        _fail(f"config.model={config.model!r} with config.model_kwargs: {error}")
    try:
        # The model's shapes, with no array built: a model that cannot read the data
        # fails here, in one line, and not in the first traced step.
        shapes = jax.eval_shape(
            lambda: model.init(jax.random.key(0), example_input(dataset), train=False)
        )["params"]
    except (TypeError, ValueError) as error:
        _fail(f"config.model={config.model!r} with config.model_kwargs: {error}")
    shard_plan = None
    if config.shard_model:
        try:
            shard_plan = lpdec.fsdp.plan_shards(shapes, layout.mesh.shape["workers"])
        except ValueError as error:
            _fail(f"config.shard_model=True: {error}")
    check_memory(config, shapes, tx, layout, shard_plan)
    loop = LoopPlan(
        log_every=config.log_every,
        checkpoint_every=config.checkpoint_every,
        halt_after_steps=config.halt_after_steps,
        eval_local_examples=config.eval_local_examples,
        divergence_factor=config.divergence_factor,
        divergence_patience=config.divergence_patience,
        save_final_params=config.save_final_params,
        evaluate_anchor=registry.ALGORITHMS[config.algorithm].role == "whole"
        and not config.overlap,
        replicas_identical=tables.choose(config, "algorithm", registry.ALGORITHMS).role == "mean",
    )
    return Experiment(
        config_dict=config.to_dict(),
        dataset=dataset,
        partitions=tuple(partitions),
        batch_size=config.batch_size,
        augment=config.augment,
        seed=config.seed,
        layout=layout,
        model=model,
        topology=topology,
        compressor=compressor,
        schedule=schedule,
        tx=tx,
        exchange_every=config.local_steps,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        loop=loop,
        shard_plan=shard_plan,
    )


def device_memory_bytes() -> int:
    """Memory of one local device: its allocator's limit, or on CPU the host's RAM / devices."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram // jax.local_device_count()


def memory_estimate(shapes, tx, layout: NodeLayout, plan) -> tuple[int, int]:
    """(held, transient) bytes per device, from shapes alone (`jax.eval_shape`).

    held: the device's parameters and optimizer state (1/k of its machine's when
    sharded); transient: the step's whole model and its gradient in float32 (gathered,
    when sharded). Activations come on top of both.
    """
    n, devices = layout.num_nodes, layout.mesh.devices.size
    if plan is not None:
        node_shapes = jax.tree.map(
            lambda b: jax.ShapeDtypeStruct((n, *b), np.float32),
            plan.block_shapes,
            is_leaf=lambda x: isinstance(x, tuple),
        )
    else:
        node_shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), shapes)
    # Built where the algorithms' axes are bound (some exchange at init), without arrays.
    state = jax.eval_shape(layout.map(tx.init, (True,)), node_shapes)

    def nbytes(tree):
        leaves = jax.tree.leaves(tree)
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)

    model = sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(shapes))
    return (nbytes(node_shapes) + nbytes(state)) // devices, 2 * model


def check_memory(config, shapes, tx, layout: NodeLayout, plan) -> None:
    """Refuses, in one line, a model whose per-device state cannot fit a device's memory."""
    held, transient = memory_estimate(shapes, tx, layout, plan)
    have = device_memory_bytes()
    if held + transient > have:
        gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"  # noqa: E731
        _fail(
            f"config.model={config.model!r}: a device would hold about {gib(held + transient)} "
            f"(its parameters and optimizer state {gib(held)}, the step's whole model and "
            f"gradient {gib(transient)}; activations on top) but has {gib(have)}: split each "
            "machine's model over more workers (config.shard_model=True, more devices per "
            "machine) or choose a smaller model."
        )


def _fail(message: str) -> NoReturn:
    raise ConfigError(message)


def check_values(config: ml_collections.ConfigDict, *, elastic_machines: int | None = None) -> None:
    """The checks that need no object built: names, ranges, and how nodes fit the devices.

    A choice's own rules are its registry entry's (`tables.check`); the rest,
    about the run as a whole, are here.

    Args:
      config: the run's config.
      elastic_machines: an elastic run of this many machines (`train.py
        --elastic_machines`), each a process of its own: the same checks of every
        field, then what an elastic run cannot do (`_check_elastic`), and how one
        machine's workers fit this process's devices (its `machine_config`).
    """
    tables.check(config, "dataset", registry.DATASETS)
    if config.model not in lpdec.models.MODELS:
        _fail(
            f"config.model={config.model!r} is not one of: "
            f"{', '.join(sorted(lpdec.models.MODELS))}."
        )
    if (config.dataset in registry.TEXT_DATASETS) != (config.model == "transformer"):
        _fail(
            f"config.model={config.model!r} with config.dataset={config.dataset!r}: the "
            f"language model ('transformer') trains on text ({', '.join(registry.TEXT_DATASETS)})"
            ", the other models on the classification data sets."
        )
    if config.precision not in PRECISIONS:
        _fail(f"config.precision={config.precision!r} is not one of: {', '.join(PRECISIONS)}.")
    if not config.learning_rate > 0:
        _fail(f"config.learning_rate={config.learning_rate!r} must be > 0.")
    if not 0.0 <= config.skew <= 1.0:
        _fail(f"config.skew={config.skew!r} must be in [0, 1] (0 = IID).")
    for field in ("num_nodes", "batch_size", "log_every"):
        if not isinstance(config[field], int) or config[field] < 1:
            _fail(f"config.{field}={config[field]!r} must be a positive integer.")
    if not isinstance(config.eval_local_examples, int) or config.eval_local_examples < 0:
        _fail(
            f"config.eval_local_examples={config.eval_local_examples!r} must be an integer "
            ">= 0 (0: no evaluation of each node's own model)."
        )
    if config.num_steps < 0 or config.num_epochs < 0 or not (config.num_steps or config.num_epochs):
        _fail("set config.num_steps (> 0) or config.num_epochs (> 0).")
    if not (config.divergence_factor == 0 or config.divergence_factor > 1):
        _fail(
            f"config.divergence_factor={config.divergence_factor!r} must be > 1 "
            "(or 0: never stop a run for its loss)."
        )
    if not isinstance(config.divergence_patience, int) or config.divergence_patience < 1:
        _fail(
            f"config.divergence_patience={config.divergence_patience!r} must be a positive "
            "integer (log intervals in a row)."
        )
    for field, values in ELASTIC_CHOICES.items():
        if config[field] not in values:
            _fail(f"config.{field}={config[field]!r} must be one of: {', '.join(values)}.")
    if config.process_sum not in PROCESS_SUMS:
        _fail(
            f"config.process_sum={config.process_sum!r} must be one of: {', '.join(PROCESS_SUMS)}."
        )
    if config.checkpoint_every % config.log_every:
        _fail(
            f"config.checkpoint_every={config.checkpoint_every} must be a multiple of "
            f"config.log_every={config.log_every} (steps run in chunks of log_every)."
        )
    # Every name, and the chosen entries' own rules, before any object: a typo fails at
    # once, and `build` checks none of them again (the topology's rules it checks there,
    # at the machine count the layout gives).
    for field, table in (
        ("algorithm", registry.ALGORITHMS),
        ("lr_schedule", optimizers.SCHEDULES),
        ("optimizer", optimizers.OPTIMIZERS),
        ("compressor", registry.COMPRESSORS),
    ):
        tables.check(config, field, table)
    tables.choose(config, "topology", registry.TOPOLOGIES)
    _check_local_steps(config)
    if elastic_machines is not None:
        _check_elastic(config, elastic_machines)
        _check_fit(machine_config(config, elastic_machines))
        return
    _check_fit(config)


#: What an elastic run refuses, and why (`_check_elastic`): the fields of the synchronous
#: DiLoCo that have no elastic form.
ELASTIC_REFUSED = {
    "overlap": "the delayed outer step (Streaming DiLoCo) applies each round's mean one "
    "round late on every machine; an elastic round's members change from round to round, "
    "and a joining machine would need the pending update of a round it did not see",
}


def _check_elastic(config: ml_collections.ConfigDict, machines: int) -> None:
    """What an elastic run of `machines` machines cannot do, in one line each."""
    if registry.ALGORITHMS[config.algorithm].role != "whole":
        _fail(
            f"an elastic run needs config.algorithm='diloco' (machines meet only at "
            f"exchanges); got {config.algorithm!r}."
        )
    if config.exchange not in ("mean", "compressed_mean"):
        _fail(
            f"config.exchange={config.exchange!r}: an elastic run exchanges a mean "
            "('mean' or 'compressed_mean'), not gossip: a gossip matrix fixes each node's "
            "neighbours, and an elastic round's members are whoever is alive."
        )
    for field, why in ELASTIC_REFUSED.items():
        if config[field] != DEFAULTS[field]:
            _fail(f"config.{field}={config[field]!r} is not supported elastic: {why}.")
    if not isinstance(machines, int) or machines < 1:
        _fail(f"--elastic_machines={machines!r} must be an integer >= 1.")
    if config.num_nodes % machines:
        _fail(_uneven_workers(config.num_nodes, machines))
    if config.machines and not config.hierarchical:
        _fail(_machines_not_hierarchical(config.machines))
    if config.machines and config.machines != machines:
        _fail(
            f"config.machines={config.machines} but --elastic_machines={machines}: set "
            f"config.machines to 0 or {machines}."
        )
    if config.elastic_budget == "samples" and config.lr_schedule != "constant":
        _fail(
            f"config.elastic_budget='samples' needs config.lr_schedule='constant' (got "
            f"{config.lr_schedule!r}): the run's length, and so a decay's end, is not known "
            "in advance."
        )


def machine_config(config: ml_collections.ConfigDict, machines: int) -> ml_collections.ConfigDict:
    """The config one machine of an elastic run trains its local steps with.

    Its `num_nodes / machines` workers train one model data-parallel (an all-reduce
    of their gradients every step, as the hierarchical DiLoCo's workers do); with
    `shard_model` the model is split over them (FSDP, one worker per device: the
    first `workers` devices of the process). The DiLoCo fields are the elastic
    round's (`train_lib.elastic`), not the machine's.
    """
    local = ml_collections.ConfigDict(config.to_dict())
    workers = config.num_nodes // machines
    local.algorithm = "allreduce"
    local.num_nodes = workers
    if config.shard_model:
        local.hierarchical, local.machines = True, 1
        if not config.devices and jax.device_count() > workers:
            local.devices = workers
    else:
        local.hierarchical, local.machines = False, 0
    for field in LOCAL_STEP_FIELDS:
        local[field] = DEFAULTS[field]
    return local


def _check_fit(config: ml_collections.ConfigDict) -> None:
    """How the config's nodes fit this run's devices (and processes)."""
    devices = jax.device_count()
    if config.process_sum == "host" and not (
        jax.process_count() > 1
        and jax.local_device_count() == 1
        and config.num_nodes == jax.process_count()
    ):
        _fail(
            f"config.process_sum='host' sums over processes of one device and one node each "
            f"(lpdec.host_sum); this run has {jax.process_count()} process(es) of "
            f"{jax.local_device_count()} device(s) and config.num_nodes={config.num_nodes}: "
            "set config.process_sum='jax'."
        )
    if config.devices and jax.process_count() > 1 and config.devices != devices:
        _fail(
            f"config.devices={config.devices} in a run of {jax.process_count()} processes: "
            f"every process's devices take part ({devices} in all); leave config.devices at 0."
        )
    if jax.process_count() > 1 and config.num_nodes < devices:
        _fail(
            f"config.num_nodes={config.num_nodes} is below the {devices} devices of a run of "
            f"{jax.process_count()} processes: every process's devices must hold nodes (at "
            f"least {devices} nodes); run fewer nodes in one process."
        )
    if config.devices:
        if not 1 <= config.devices <= devices:
            _fail(f"config.devices={config.devices} must be in 1..{devices} (0 = all devices).")
        devices = config.devices
    machines = machine_count(config)
    if config.shard_model and machines is None:
        _fail(
            "config.shard_model=True splits each machine's model over its workers: it needs "
            "machines (config.hierarchical=True with several processes, or config.machines "
            "simulated in one process)."
        )
    if config.shard_model and config.optimizer == "muon":
        _fail(
            "config.optimizer='muon' orthogonalizes each weight matrix whole, and "
            "config.shard_model=True gives each worker a block of it: set "
            "config.shard_model=False (each worker then holds the machine's whole model)."
        )
    if config.shard_model and config.num_nodes // machines != devices // machines:
        _fail(
            f"config.shard_model=True needs one worker on every device of a machine: "
            f"config.num_nodes={config.num_nodes} for {machines} machines of "
            f"{devices // machines} devices (set config.num_nodes={devices})."
        )
    if machines is not None:
        if config.num_nodes % machines:
            _fail(_uneven_workers(config.num_nodes, machines))
        per_machine = devices // machines if jax.process_count() == 1 else jax.local_device_count()
        if jax.process_count() == 1 and devices % machines:
            _fail(
                f"config.machines={machines} does not divide the {devices} devices: one "
                "process simulates machines as equal groups of its devices."
            )
        if config.num_nodes // machines > per_machine:
            _fail(
                f"config.num_nodes={config.num_nodes} puts {config.num_nodes // machines} "
                f"workers on each machine's {per_machine} devices: a hierarchical run needs "
                "one worker per device (at most machines x devices per machine nodes)."
            )
        return
    if config.hierarchical and config.num_nodes <= devices:
        _fail(
            "config.hierarchical=True in one process needs config.machines (machines "
            "simulated as groups of devices) or several nodes per device (the devices are "
            "the machines): set config.machines, or config.devices below config.num_nodes."
        )
    if config.num_nodes > devices and config.num_nodes % devices:
        _fail(
            f"config.num_nodes={config.num_nodes} exceeds the {devices} devices and is not a "
            f"multiple of {devices}: simulated nodes are spread evenly over the devices."
        )


def _uneven_workers(num_nodes: int, machines: int) -> str:
    return (
        f"config.num_nodes={num_nodes} (the workers) is not a multiple of the {machines} "
        "machines: every machine holds the same number of workers."
    )


def _machines_not_hierarchical(machines: int) -> str:
    return f"config.machines={machines} needs config.hierarchical=True."


def _check_local_steps(config: ml_collections.ConfigDict) -> None:
    """DiLoCo's fields (H, overlap, error feedback) only with it; with it, its exchange."""
    if registry.ALGORITHMS[config.algorithm].role == "whole":
        tables.check(config, "exchange", registry.EXCHANGES)
        return
    for field in LOCAL_STEP_FIELDS:
        if config[field] != DEFAULTS[field]:
            _fail(
                f"config.{field}={config[field]!r} needs config.algorithm='diloco' "
                f"(local steps with an outer optimizer); got {config.algorithm!r}."
            )


def machine_count(config: ml_collections.ConfigDict) -> int | None:
    """The machines of a hierarchical run on a 2-D layout, or None (no machines axis).

    Several processes: each is a machine. One process: `config.machines` simulated
    ones, or None for seed 004's one-process layout (the devices are the machines).
    """
    if config.machines and not config.hierarchical:
        _fail(_machines_not_hierarchical(config.machines))
    if not config.hierarchical:
        return None
    processes = jax.process_count()
    if config.machines and not (isinstance(config.machines, int) and config.machines >= 1):
        _fail(f"config.machines={config.machines!r} must be an integer >= 1 (0 = processes).")
    if processes > 1:
        if config.devices:
            _fail(
                f"config.devices={config.devices} with config.hierarchical=True and "
                f"{processes} processes: each process is a machine of all its local devices, "
                "so set config.devices to 0."
            )
        if config.machines and config.machines != processes:
            _fail(
                f"config.machines={config.machines} but {processes} processes run: each "
                f"process is a machine, so set it to 0 or {processes}."
            )
        return processes
    return config.machines or None


def load_dataset(config: ml_collections.ConfigDict) -> lpdec.data.Dataset:
    """`config.dataset`, loaded once per process for the same fields."""
    fields = registry.DATASETS[config.dataset].fields
    try:
        return _load_dataset(config.dataset, tuple(tables.field_value(config, f) for f in fields))
    except (FileNotFoundError, ValueError) as error:
        if config.dataset in ("cifar10", "stdlib_text", "text_files") and config.data_dir:
            _fail(f"config.data_dir={config.data_dir!r}: {error}")
        _fail(f"config.dataset={config.dataset!r}: {error}")


@functools.lru_cache(maxsize=2)
def _load_dataset(name: str, values: tuple) -> lpdec.data.Dataset:
    # Cached: the data sets are deterministic in their fields, and generating
    # MNIST-1D takes longer than a short run (bench/experiments/ runs hundreds).
    entry = registry.DATASETS[name]
    return entry.build(
        tables.fields_view(dict(zip(entry.fields, values, strict=True)), entry.fields)
    )
