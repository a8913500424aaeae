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

Measured result: MEASURED_RESULT
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
