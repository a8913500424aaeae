"""Every documented config's wire bytes per step, per axis, and collectives per step
(metrics.csv and summary.json) against the count derived by hand from its algorithm,
its topology and its compressor's wire format (issue 50).

The configs are those README.md and docs/ name (test_the_documented_configs_are_covered
holds the list to them), each trained for 4 steps (2 chunks) on little data. The layouts and the
loop's paths: quickstart with its 8 nodes on one device (the trace-time meter) and on 8
devices (the compiled program), one step per program (a convolutional model on CPU) and
one program per chunk (the scan); 8 devices one step per program is default's case (its
CNN in fp32, the same CHOCO; quickstart's there was dropped for CI's time); the language
models' FSDP inside a machine; DiLoCo's exchange counted once per H steps beside the
collectives every step runs.

The hand counts, from the documents of each piece (never from the code under test):
- min-max at b bits (lpdec.compress.minmax_quantizer: `MinMaxPayload`,
  `default_chunk_size`): ceil(d b / 8) bytes of packed codes and a float32 (lo, unit)
  pair per chunk of 2048 (8 // b) elements of the d-element array it encodes.
- CHOCO-SGD (Koloskova et al., 2019, Alg. 1) on a ring: each node sends its compressed
  difference q_i = Q(x_i - x̂_i) to its 2 neighbours every step, leaf by leaf: 2
  collectives of sum over leaves of minmax(d_leaf) bytes. D-PSGD (Lian et al., 2017):
  the float32 model to each of the 2 neighbours.
- compressed_mean (its module docstring): the update's leaves flattened into one
  float32 vector of P elements, cut into n chunks of ceil(P / n); two rounds: an
  all-to-all whose operand is the n encoded chunks (a node's row to itself counted, as
  the operand holds it) and an all-gather of the encoded mean chunk; one round
  (`mean_rounds=1`): an all-gather of the whole encoded vector. With machines of L
  workers (`local_axis`): a float32 reduce-scatter over the workers (operand: the
  vector padded to L ceil(P / L)), the rounds over the machines on the 1/L shard, a
  float32 all-gather of the shard.
- local_mean: one all-reduce of the float32 gradient and its contributor count (4 P +
  4 bytes). FSDP (lpdec.fsdp): each step gathers every leaf from its k blocks in one
  all-gather of all the blocks (operand: the blocks, 4 d / k summed over the leaves) and
  the gradient comes back through one reduce-scatter (operand: the whole leaves, 4 d
  summed); DiLoCo's exchange then runs on a worker's blocks, P / k elements.
- DiLoCo (Douillard et al., 2023): the exchange once per H = local_steps steps: its
  bytes and collectives / H per step.

Link bytes (`link_bytes_by_axis`): what a node puts on its links, from the schedule of
each collective's textbook algorithm over n nodes: a ring all-reduce is n - 1 steps of
reduce-scatter then n - 1 of all-gather, each sending one of the buffer's n blocks; an
all-gather sends this node's piece to the n - 1 others; a reduce-scatter or all-to-all
sends n - 1 of its n blocks (the block to itself stays); a neighbour exchange sends
what it sends.
"""

import csv
import importlib
import math
import os
import pathlib
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from train_lib import loop  # noqa: E402

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def minmax_bytes(d: int, bits: int) -> int:
    """Packed codes plus a float32 (lo, unit) pair per chunk of 2048 (8 // bits) elements."""
    return math.ceil(d * bits / 8) + 8 * math.ceil(d / (2048 * (8 // bits)))


def compressed_mean_bytes(p: int, nodes: int, bits: int, rounds: int) -> int:
    """One exchange of a P-element vector among `nodes`: (bytes, collectives, link bytes).

    On the links: one round sends the whole payload to each of the n - 1 others; two
    send n - 1 encoded chunks (round 1: chunk c to node c) and this node's averaged
    chunk to the n - 1 others (round 2)."""
    if rounds == 1:
        return minmax_bytes(p, bits), 1, (nodes - 1) * minmax_bytes(p, bits)
    chunk = math.ceil(p / nodes)
    return (nodes + 1) * minmax_bytes(chunk, bits), 2, 2 * (nodes - 1) * minmax_bytes(chunk, bits)


def ring_all_reduce(nbytes: float, n: int) -> float:
    """Bytes a node sends in a ring all-reduce of `nbytes` over n nodes: n - 1
    reduce-scatter steps and n - 1 all-gather steps of one block (nbytes / n) each."""
    return sum(nbytes / n for _ in range(2 * (n - 1)))


# The documented configs' counts, from their fields: (leaf sizes, fields, one device?) ->
# ({axis: bytes per node and step}, collectives per step, {axis: link bytes per node and
# step}).


def choco_ring(leaves, c, axis):
    assert (c.algorithm, c.topology, c.compressor) == ("choco", "ring", "minmax")
    sent = {axis: 2 * sum(minmax_bytes(d, c.bits) for d in leaves)}
    return sent, 2, sent  # a neighbour exchange: the operand is what goes out


def dpsgd_ring(leaves, c, axis):
    assert (c.algorithm, c.topology) == ("dpsgd", "ring")
    sent = {axis: 2 * 4 * sum(leaves)}
    return sent, 2, sent


def nothing(leaves, c, axis):
    assert c.algorithm == "none" and c.num_nodes == 1
    return {}, 0, {}


def diloco_flat(leaves, c, axis):
    """DiLoCo with a compressed mean over all the nodes, no machines."""
    assert (c.algorithm, c.exchange, c.hierarchical) == ("diloco", "compressed_mean", False)
    sent, collectives, link = compressed_mean_bytes(sum(leaves), c.num_nodes, c.bits, c.mean_rounds)
    h = c.local_steps
    return {axis: sent / h}, collectives / h, {axis: link / h}


def diloco_machines(leaves, c, axis):
    """DiLoCo between machines of replicated workers: the gradient's mean inside a machine
    every step, the hierarchical compressed mean of the pseudo-gradient every H steps."""
    assert (c.algorithm, c.exchange, c.hierarchical) == ("diloco", "compressed_mean", True)
    assert not c.shard_model and c.mean_rounds == 2
    p, machines = sum(leaves), c.machines
    workers = c.num_nodes // machines
    shard = math.ceil(p / workers)
    rounds, collectives, link = compressed_mean_bytes(shard, machines, c.bits, c.mean_rounds)
    h = c.local_steps
    inside = 4 * p + 4 + (4 * workers * shard + 4 * shard) / h
    # The gradient's (and its count's) ring all-reduce; every H steps a reduce-scatter
    # of the padded vector (workers - 1 of its blocks leave) and an all-gather of this
    # worker's shard (to the workers - 1 others).
    inside_link = (
        ring_all_reduce(4 * p + 4, workers)
        + ((workers - 1) * 4 * shard + (workers - 1) * 4 * shard) / h
    )
    return (
        {"workers": inside, "machines": rounds / h},
        1 + 2 / h + collectives / h,
        {"workers": inside_link, "machines": link / h},
    )


def diloco_fsdp(leaves, c, axis):
    """DiLoCo between machines whose workers hold one model in blocks (FSDP)."""
    assert (c.algorithm, c.exchange, c.hierarchical) == ("diloco", "compressed_mean", True)
    assert c.shard_model
    p, machines = sum(leaves), c.machines
    workers = c.num_nodes // machines
    assert all(d % workers == 0 for d in leaves)
    rounds, collectives, link = compressed_mean_bytes(p // workers, machines, c.bits, c.mean_rounds)
    h = c.local_steps
    inside = sum(4 * d // workers + 4 * d for d in leaves)
    # One all-gather of every block and its gradient's reduce-scatter (lpdec.fsdp): a
    # worker's blocks go to the workers - 1 others; of the whole leaves' gradient, the
    # workers - 1 blocks that others sum leave.
    inside_link = sum((workers - 1) * 4 * d // workers * 2 for d in leaves)
    return (
        {"workers": inside, "machines": rounds / h},
        2 + collectives / h,
        {"workers": inside_link, "machines": link / h},
    )


SMALL_MNIST1D = dict(num_samples=2000)
SMALL_TEXT = dict(text_bytes=200_000, validation_windows=16)
# The language models' layout and exchange are their configs'; one thin block (the count
# reads the leaves' sizes from the run) keeps each case's compilation short in CI.
THIN = dict(SMALL_TEXT, model_kwargs=dict(d_model=32, num_layers=1, num_heads=4))
# lm_gpu's transformer at lm_tiny's size, with attention CPUs run: the exchange's protocol
# is the config's; only the parameter count it is applied to is smaller.
SMALL_GPU_MODEL = dict(
    SMALL_TEXT,
    sequence_length=64,
    model_kwargs=dict(
        context=64, d_model=32, num_layers=1, num_heads=4, attention_implementation="xla"
    ),
)

# name -> (config module, overrides, hand count, path: "step" (one step per program),
# "chunk" (one program per chunk; forced where the loop would choose "step"), or None).
CASES = {
    "quickstart-one-device": ("quickstart", dict(SMALL_MNIST1D, devices=1), choco_ring, "step"),
    "quickstart-one-device-chunked": (
        "quickstart",
        dict(SMALL_MNIST1D, devices=1),
        choco_ring,
        "chunk",
    ),
    "quickstart-8-devices-chunked": ("quickstart", SMALL_MNIST1D, choco_ring, "chunk"),
    "quickstart_central": ("quickstart_central", SMALL_MNIST1D, nothing, None),
    "default": ("default", SMALL_MNIST1D, choco_ring, "step"),
    "link_mlp": ("link_mlp", SMALL_MNIST1D, dpsgd_ring, "chunk"),
    "elastic_mlp": ("elastic_mlp", SMALL_MNIST1D, diloco_flat, "chunk"),
    "link_diloco": ("link_diloco", SMALL_MNIST1D, diloco_machines, "chunk"),
    "lm_tiny": ("lm_tiny", THIN, diloco_fsdp, "chunk"),
    "lm_small": ("lm_small", THIN, diloco_fsdp, "chunk"),
    "lm_study": ("lm_study", dict(THIN, warmup_steps=1), diloco_fsdp, "chunk"),
    # Muon inside each machine: every worker holds its machine's whole model.
    "lm_scale": ("lm_scale", dict(THIN, warmup_steps=1), diloco_machines, "chunk"),
    "lm_gpu-one-device": ("lm_gpu", dict(SMALL_GPU_MODEL, devices=1), diloco_flat, "chunk"),
    # Its own data are the user's token files; on the standard library's bytes with a
    # byte vocabulary, its layout and exchange are the config's (the vocabulary changes
    # only the leaves' sizes, which the count reads from the run).
    "lm_tokens_50k": (
        "lm_tokens_50k",
        dict(THIN, dataset="stdlib_text", model_kwargs=dict(THIN["model_kwargs"], vocab_size=256)),
        diloco_fsdp,
        "chunk",
    ),
}


def _config(module: str, overrides: dict):
    config = importlib.import_module(f"configs.{module}").get_config()
    fields = dict(
        num_steps=4,
        log_every=2,
        checkpoint_every=0,
        eval_local_examples=0,
        save_final_params=True,
        **overrides,
    )
    for key, value in fields.items():
        if key == "model_kwargs":
            for name, kwarg in value.items():
                setattr(config.model_kwargs, name, kwarg)
        else:
            setattr(config, key, value)
    return config


def _train(config, workdir, monkeypatch, path):
    """Trains `config` with the loop's path forced to `path` where it is "chunk"; returns
    (summary, metrics.csv's rows, the run's Chunks)."""
    made = []
    original = loop.Chunks.__init__

    def init(self, *args):
        original(self, *args)
        if path == "chunk":
            self.step_by_step = False
        made.append(self)

    monkeypatch.setattr(loop.Chunks, "__init__", init)
    summary = loop.train_and_evaluate(config, str(workdir))
    monkeypatch.undo()
    with open(workdir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    (chunks,) = made
    return summary, rows, chunks


def _leaf_sizes(workdir) -> list[int]:
    """Elements of each parameter leaf, from the exported parameters (a row per node, or
    per machine of a sharded run)."""
    with np.load(workdir / "final_params.npz") as f:
        return [int(np.prod(f[name].shape[1:])) for name in f.files]


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_reported_wire_bytes_are_the_hand_count(tmp_path, monkeypatch, case):
    module, overrides, count, path = CASES[case]
    config = _config(module, overrides)
    summary, rows, chunks = _train(config, tmp_path, monkeypatch, path)
    if path is not None:
        assert chunks.step_by_step is (path == "step"), chunks.step_by_step
    one_device = summary["devices"] == 1
    axis = "nodes+local" if one_device and config.num_nodes > 1 else "nodes"
    by_axis, collectives, link = count(_leaf_sizes(tmp_path), config, axis)
    total = sum(by_axis.values())
    assert summary["steps"] == 4 and len(rows) == 2
    assert total > 0 or config.num_nodes == 1
    assert summary["final"]["wire_bytes_per_step"] == pytest.approx(total, rel=1e-9)
    for row in rows:
        assert float(row["wire_bytes_per_step"]) == pytest.approx(total, rel=1e-9), row
    assert summary["wire_bytes_by_axis"] == pytest.approx(by_axis, rel=1e-9)
    assert summary["collectives_per_step"] == pytest.approx(collectives, rel=1e-9)
    assert summary["link_bytes_by_axis"] == pytest.approx(link, rel=1e-9)
    assert summary["link_bytes_per_step"] == pytest.approx(sum(link.values()), rel=1e-9)
    if config.num_nodes > 1:
        # The compiled program where every node has its own device and every collective
        # runs every step; else the meter (nodes share a device; DiLoCo's exchange).
        assert summary["wire_bytes_source"] == (
            "trace-time meter" if one_device or config.algorithm == "diloco" else "compiled HLO"
        )


def test_the_documented_configs_are_covered():
    """Every config README.md and docs/ name has a case above (a new one needs its count)."""
    named = set()
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        named |= set(re.findall(r"configs/(\w+)\.py", path.read_text()))
    assert named, "no config named in the docs"
    assert named <= {module for module, *_ in CASES.values()}, named
