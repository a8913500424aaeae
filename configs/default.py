"""Default configuration: every field `train.py` reads, with its meaning.

    python train.py --config=configs/default.py --workdir=/tmp/lpdec_default

Variants import this file and override a few fields (see quickstart.py). On 2
CPU cores this default (MNIST-1D 5,000, fp32 1-D CNN, 8 nodes on a ring, 8-bit
CHOCO, 10 epochs = 150 steps) takes about 15 s and ends near 66% test accuracy
(measured 2026-11-22; the quickstart trains longer on more data).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()

    # Data: "mnist1d" (generated locally), "digits" (scikit-learn), "synthetic",
    # "cifar10" (binary files in data_dir, supplied by the user), or for the language
    # model "stdlib_text", "text_files" or "token_file" (below).
    config.dataset = "mnist1d"
    config.data_dir = ""
    config.num_samples = 5000  # mnist1d / synthetic size (train + test)
    config.skew = 0.0  # degree of skew of seed 002's partitioner: 0 = IID, 1 = sorted
    # Elastic runs (train.py --elastic_service): "shard", machine m trains on the shards
    # its slot's nodes get in the non-elastic run (a lost or slow machine's shard goes
    # untrained meanwhile); "whole", every machine samples the whole training set with
    # its own random stream (a lost or slow machine costs throughput, not data).
    config.elastic_data = "shard"
    # How long an elastic run is: "rounds", ceil(num_steps / local_steps) exchanges,
    # whoever contributes to them; "samples", until the local steps the exchanges took
    # in add up to num_steps x machines, what the uninterrupted run trains on (a lost or
    # slow machine's share is made up by more rounds of the others; needs a constant
    # learning-rate schedule, whose end would otherwise not be known in advance).
    config.elastic_budget = "rounds"
    # The round's mean: "contributors", the contributions' mean weighted by their local
    # steps (lpdec.elastic.step_weighted_mean); "slots", their sum over the run's
    # machines (lpdec.elastic.slot_mean: a missing machine adds zero, each local step
    # weighs what it weighs in a round of every machine).
    config.elastic_mean = "contributors"
    # Where a round's bytes go: "service", through the coordinating service (a star:
    # its link carries n payloads in and n (n - 1) out a round); "peers", directly
    # between the round's members (lpdec.elastic.peers: a reduce-scatter and an
    # all-gather, or with mean_rounds=1 an all-gather), the service deciding who they
    # are. BENCHMARKS.md, "bench/elastic_scale.py", measures both.
    config.elastic_transport = "service"
    config.augment = False  # CIFAR random crop + flip
    # "stdlib_text" (a language model's bytes: this Python's standard library sources,
    # or the .py files under data_dir): windows of sequence_length + 1 bytes; text_bytes
    # caps the train bytes, validation_windows the held-out windows (0 = all of them).
    config.sequence_length = 128
    config.text_bytes = 0
    config.validation_windows = 0
    # Your own data for the language model: "text_files", every file under data_dir
    # (any extension) as bytes, each split by position (its last 5% is validation);
    # "token_file", data_dir/train.bin and val.bin, flat arrays of token ids of
    # token_dtype ("uint16" or "uint32", as nanoGPT writes them), read through
    # np.memmap; the vocabulary is model_kwargs.vocab_size.
    config.token_dtype = "uint16"

    # Model: "cnn1d", "mlp", "resnet20", "resnet54", "vgg11", "transformer".
    config.model = "cnn1d"
    config.model_kwargs = ml_collections.ConfigDict()
    config.precision = "fp32"  # or "int8": 8-bit training with gradient bifurcation
    config.norm = ""  # "" = seed 002's choice (EvoNorm for fp32, Range EvoNorm for int8)

    # Decentralization.
    config.num_nodes = 8
    config.topology = "ring"  # see train_lib/registry.py: TOPOLOGIES
    config.torus_rows = 0  # 0: the squarest torus
    config.algorithm = "choco"  # see train_lib/registry.py: ALGORITHMS ("none": independent nodes)
    config.gamma = 1.0  # consensus step size (choco, deepsqueeze, quant_sgp, sparse_push)
    config.theta = 1.0  # Moniqua's a-priori bound (moniqua, modulo compressor)
    config.theta_follows_lr = False  # scale theta with the learning rate (seed 003, Thm. 2)
    config.slack = 1.0  # Moniqua's slack matrix alpha W + (1 - alpha) I
    config.devices = 0  # devices to use (0 = all); fewer than num_nodes nests nodes
    # Machines (issue 11): with hierarchical=True, full precision inside a machine and
    # compressed_mean or the gossip algorithm between machines (topology sized to the
    # machines, num_nodes still counting workers). Machines are the processes when
    # several run; in one process, `machines` simulated ones (equal groups of devices),
    # or with machines = 0 seed 004's layout: the devices are the machines, and the
    # num_nodes / devices workers of each are nested on it.
    config.hierarchical = False
    config.machines = 0  # one process: machines to simulate (0 = devices are machines)
    # FSDP inside each machine (issue 25): the workers of a machine hold one model
    # between them, every leaf split over them (lpdec.fsdp); the algorithm runs between
    # the machines on each worker's blocks. Needs machines and one worker per device.
    config.shard_model = False
    # How a run of several processes with one device each sums over them (issue 51):
    # "jax", jax's own collectives (gloo on CPU); "host", lpdec.host_sum's TCP star
    # for local_mean's all-reduce (the fp32 all-reduce, DiLoCo's fp32 mean), every other
    # collective staying jax's; "auto", "host" on CPU when every process holds one
    # device and one node, else "jax". jax's gloo waits about a scheduler time slice on
    # a buffer above ~256 KB when its process has one core; the host sum does not
    # (faster pinned; unpinned faster on the language model, level on the MLP; level at
    # 1 Gbit: BENCHMARKS.md, "bench/step_parity.py").
    config.process_sum = "auto"

    # Local steps (algorithm = "diloco", issue 12): local_steps steps of the local
    # optimizer, then an exchange of the pseudo-gradients (parameters at the last
    # synchronisation minus now) and one outer Nesterov step; nothing crosses the wire
    # in between. exchange: "mean" (fp32 all-reduce), "compressed_mean" (compressor
    # and bits below; error_feedback keeps what the rounding lost for the next
    # exchange) or "gossip" (CHOCO with the compressor on the topology, gamma).
    # overlap applies each outer step one round late (Streaming DiLoCo).
    config.local_steps = 1
    config.outer_lr = 0.7
    config.outer_momentum = 0.9
    # The outer momentum rises linearly from 0 to outer_momentum over this many
    # rounds (0: from the first round).
    config.outer_warmup_rounds = 0
    # ... and falls linearly back to 0 over the run's last this many rounds (needs
    # num_steps; 0: the momentum stays at outer_momentum to the end).
    config.outer_decay_rounds = 0
    # A slow outer momentum beside the fast one (MT-DAO's timescales): the step is
    # (1 - outer_slow_weight) x the fast step + outer_slow_weight x a Nesterov step of
    # momentum outer_slow_momentum at the same steady gain (0: the fast one alone).
    config.outer_slow_momentum = 0.9
    config.outer_slow_weight = 0.0
    # A synchronous warm-up (post-local SGD): the first sync_steps steps (a multiple
    # of local_steps) each end with the exchange and a plain outer step of 1, every
    # worker on the exchanged mean; rounds of local_steps begin after them.
    config.sync_steps = 0
    config.exchange = "mean"
    config.error_feedback = False
    # The compressed_mean exchange: 2 rounds (scatter-reduce + all-gather, compressed
    # twice) or 1 (an all-gather of every machine's payload, averaged: SparseLoCo's
    # sparse aggregation); error_decay < 1 decays the residual (SparseLoCo's beta).
    config.mean_rounds = 2
    config.error_decay = 1.0
    config.overlap = False

    # Compression of what crosses the wire.
    # see train_lib/registry.py: COMPRESSORS; "mxfp4" / "mxfp8": MX block-scaled floats
    config.compressor = "minmax"
    config.bits = 8
    config.rounding = "nearest"
    # min-max elements per (lo, unit) pair; None: 2048 * (8 // bits), the scales then
    # add at most 0.63% to the codes at every width
    # (lpdec.compress.minmax_quantizer.default_chunk_size).
    config.chunk_size = ml_collections.config_dict.placeholder(int)
    # How min-max hands a tree's leaves to the GPU (the same bytes either way):
    # "leaves", one launch taking every leaf; "packed", one flat buffer of whole chunks.
    config.tree_layout = "leaves"
    config.ratio = 0.01  # top_k / random_k: fraction kept (0.01 = "99% compression")

    # Local optimization (seed 002: Nesterov 0.9, weight decay 1e-4, lr 0.1).
    config.optimizer = "nesterov"  # sgd, nesterov, qg_momentum, adam, muon
    config.learning_rate = 0.1
    config.momentum = 0.9
    # optimizer="muon": Muon on the hidden 2-D kernels at learning_rate (its momentum
    # muon_beta), Adam on the other leaves at muon_adam_lr (the same schedule).
    config.muon_adam_lr = 8e-3
    config.muon_beta = 0.95
    config.weight_decay = 1e-4
    config.lr_schedule = "piecewise"  # constant, cosine, piecewise
    config.lr_boundaries = (0.5, 0.75)  # fractions of training (epochs 100 and 150 of 200)
    config.lr_decay = 0.1
    config.warmup_steps = 0
    config.batch_size = 32  # per node
    config.num_epochs = 10.0
    config.num_steps = 0  # > 0 overrides num_epochs

    # Bookkeeping.
    config.seed = 0
    config.log_every = 50  # steps per compiled chunk; metrics after each chunk
    config.checkpoint_every = 500  # a multiple of log_every; 0 = only at the end
    config.eval_local_examples = 1000  # test examples for each node's own model (0: none)
    config.halt_after_steps = 0  # stop after this many steps (as if killed after a checkpoint)
    config.save_final_params = False  # write final_params.npz (all nodes)
    # Divergence stops the run (summary.json says why; exit status 3): the mean train
    # loss of a log interval non-finite, or above divergence_factor x ln(classes) (a
    # uniform guess's loss), for divergence_patience intervals in a row; a run that
    # ends on such an interval has diverged, whatever the streak. 0: off.
    config.divergence_factor = 10.0
    config.divergence_patience = 3
    return config
