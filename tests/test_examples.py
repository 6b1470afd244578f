"""Every example script that runs on a CPU is executed (on the simulator) and must print PASS."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", ["moe_layer.py"])
def test_example_passes_on_the_simulator(script):
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("PASS")


def test_train_step_matches_the_dense_torch_reference_on_the_simulator():
    """Forward and backward through FusedDispatch/FusedCombine on 2 simulated ranks (rank 1 has
    no tokens) agree with the dense float32 step: every tensor's error is printed and within the
    example's tolerance, and every phase is timed."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "train_step.py"), "--backend", "sim", "--ranks", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "PASS"
    assert sum(line.startswith("rank ") and "backward" in line for line in lines) == 2
    errors = next(line for line in lines if line.startswith("max|G - R|"))
    for name in ("out", "dL/dx", "dL/drouter", "dL/dW1", "dL/dW3", "dL/dW2"):
        assert f" {name} " in errors
