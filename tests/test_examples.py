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
