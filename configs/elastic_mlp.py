"""Elastic DiLoCo: 3 machines that may be lost and join, 4-bit error-feedback exchange.

    # the run's secret, in a file on the service's host and on each machine:
    head -c 32 /dev/urandom | base64 > run.token
    # the coordinating service (any host the machines reach; loopback here):
    python -m lpdec.elastic serve --bind 127.0.0.1:29600 --machines 3 --token_file run.token
    # each machine m = 0, 1, 2 (its own workdir):
    python train.py --config=configs/elastic_mlp.py --workdir=/tmp/elastic/m0 \\
        --elastic_service=127.0.0.1:29600 --elastic_machines=3 --elastic_machine=0 \\
        --elastic_token_file=run.token

Kill a machine and the others go on without it after the service misses its
heartbeats (`--elastic_heartbeat_timeout`, 10 s); start it again with the same
command and it joins at the next exchange with a live machine's state. A machine
started with `--elastic_local_steps=2` takes 2 local steps per round instead of
10 (a slow machine keeping up): each of its steps weighs what one of the
others' does.
Every machine samples the whole training set in its own order
(`config.elastic_data = "whole"`), so a lost or slow machine takes no data away,
and the run lasts until its exchanges took in the uninterrupted run's local steps,
3 x num_steps (`config.elastic_budget = "samples"`): the machines left make up
the share of a lost or slow one with more rounds. A round's pseudo-gradient is
the sum of its contributions over the 3 slots (`config.elastic_mean = "slots"`):
a round without a machine moves the anchor 2/3 as far, with 2/3 of the batches.

MNIST-1D, an MLP with two hidden layers of 256 (84,746 parameters), 3 machines
of one worker each (`num_nodes` = machines x workers), batch 32, Nesterov SGD at
0.1 for 10 local steps, then the 4-bit min-max mean of the pseudo-gradients with
error feedback and DiLoCo's outer Nesterov step (lr 0.7, momentum 0.9); 300 steps.
`python -m bench.faults --elastic` (bench/faults/elastic.py) measures it under faults
(BENCHMARKS.md, "Elastic").
"""

from configs import link_mlp


def get_config():
    config = link_mlp.get_config()
    config.model_kwargs.hidden_sizes = (256, 256)
    config.num_nodes = 3
    config.algorithm = "diloco"
    config.local_steps = 10
    config.outer_lr = 0.7
    config.outer_momentum = 0.9
    config.exchange = "compressed_mean"
    config.compressor = "minmax"
    config.bits = 4
    config.error_feedback = True
    config.mean_rounds = 1
    config.num_steps = 300
    config.log_every = 50
    # Every machine samples the whole training set (its own order): a machine that is
    # lost or slow costs throughput, not a third of the data ("shard" keeps each slot's
    # shard; BENCHMARKS.md's elastic faults measured both).
    config.elastic_data = "whole"
    # The run is as long as the uninterrupted one in local steps (samples), not in
    # rounds: the others make up a lost or slow machine's share with more rounds.
    config.elastic_budget = "samples"
    # A round of fewer machines moves the anchor that much less far (their sum over
    # the 3 slots), so that its noise per local step stays the full run's.
    config.elastic_mean = "slots"
    return config
