"""bench/step_ops.py: the op classes of a real XLA trace, and PyTorch's operator names."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import step_ops  # noqa: E402


def test_the_jax_side_finds_each_part_of_the_model_in_its_trace():
    """One short profiled run: the matmuls, attention, the norms, the loss and Adam each
    take time of their own (a classifier that missed one would leave it at 0), and
    every class is one of the table's."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_FLAGS=step_ops.ONE_THREAD)
    result = subprocess.run(
        [sys.executable, "-m", "bench.step_ops", "--side", "jax", "--steps", "2",
         "--profiled", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["step_ms"] > 0
    assert set(out["classes"]) <= set(step_ops.CLASSES)
    for cls in step_ops.CLASSES[:6]:
        if cls != "GELU":  # (XLA may fuse the GELU into a matmul's epilogue)
            assert out["classes"].get(cls, 0) > 0, (cls, out["classes"])


@pytest.mark.parametrize(
    "name, cls",
    [
        ("aten::mm", step_ops.CLASSES[0]),
        ("aten::addmm", step_ops.CLASSES[0]),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", step_ops.CLASSES[1]),
        ("aten::gelu_backward", step_ops.CLASSES[2]),
        ("aten::native_layer_norm", step_ops.CLASSES[3]),
        ("aten::_log_softmax_backward_data", step_ops.CLASSES[4]),
        ("aten::copy_", step_ops.CLASSES[6]),
        ("autograd::engine::evaluate_function: AddmmBackward0", None),  # its children count
        ("AddmmBackward0", None),
    ],
)
def test_torch_operators_fall_in_the_classes_the_table_compares(name, cls):
    assert step_ops.torch_class(name) == cls
