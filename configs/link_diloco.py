"""The fastest setting measured on a slow link: hierarchical DiLoCo, H=10, 4-bit pseudo-gradients.

    # 2 machines (processes) x 4 devices; on machine i of 2 (host0 = machine 0's address):
    python train.py --config=configs/link_diloco.py --workdir=/tmp/link_diloco \\
        --coordinator_address=host0:12345 --num_processes=2 --process_id=i
    # the same layout simulated in one process:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py \\
        --config=configs/link_diloco.py --workdir=/tmp/link_diloco
    # the measurement below (namespaces joined by a shaped link; method "hdiloco4"):
    python -m bench.link --rates 100mbit,1gbit --processes 2 --devices 4 --target final \\
        --methods allreduce,hdiloco4

`configs/link_mlp.py` (MNIST-1D, a 1.1M-parameter MLP, 8 workers, Nesterov
SGD at 0.1) trained with `lpdec.diloco`: every worker takes 10 local steps,
then the workers of a machine average their pseudo-gradients (parameters at
the last synchronisation minus now) in full precision, the machines exchange
them with the two-round compressed mean at 4 bits with error feedback (each
of a machine's 4 workers carries 1/4 of the model), and every worker takes
the same outer Nesterov step (lr 0.7, momentum 0.9, DiLoCo's values).
Nothing crosses the wire on the 9 steps in between.

(Since issue 25 a machine's workers also average their gradients in the local
steps, so each machine is one DiLoCo replica trained data-parallel; the figures
below were measured before, with each worker its own replica.)

Measured result (2026-11-23, `bench/link.py`, 2 processes x 4 CPU devices in
network namespaces on 2 shared CPU cores, 400 steps; the BENCHMARKS.md
section has every method): at 100 Mbit, 0.068 s/step (fp32 all-reduce: 0.886)
and 78.3% final test accuracy (all-reduce: 77.2%); the all-reduce's final
accuracy after 18.0 s of training against 285.1 s, **15.8x sooner**; 0.056 MB
crossed the link per step (all-reduce: 7.86 MB). At 1 Gbit: 19.6 s against
66.5 s, 3.4x. Compute utilisation at 100 Mbit measured 82% (0.056 s/step
unshaped), on a machine shared with other work during that run; the
non-hierarchical 4-bit run (`diloco4`, the same without `hierarchical`) measured
98% and 13.7x.
"""

from configs import link_mlp


def get_config():
    config = link_mlp.get_config()
    config.algorithm = "diloco"
    config.local_steps = 10
    config.outer_lr = 0.7
    config.outer_momentum = 0.9
    config.exchange = "compressed_mean"
    config.compressor = "minmax"
    config.bits = 4
    config.error_feedback = True
    config.hierarchical = True
    config.machines = 2  # the processes when 2 run; simulated in one process
    config.num_steps = 400
    return config
