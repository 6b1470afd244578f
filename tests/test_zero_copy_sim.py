"""tests/gpu/zero_copy_check.py on the simulator: torch tensors in and out of the runtime with no
copies (data pointers of the converted and launched arrays), the batch through DLPack, the combine
written into the caller's tensor, and the stream round trips' data flow (the GPU run adds the
streams themselves and a control)."""

import pathlib
import subprocess
import sys

CHECK = pathlib.Path(__file__).resolve().parent / "gpu" / "zero_copy_check.py"


def test_zero_copy_check_passes_on_the_simulator():
    proc = subprocess.run([sys.executable, str(CHECK), "--backend", "sim", "--ranks", "2"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[-1] == "PASS"
    checks = [line for line in lines if line.startswith("rank ")]
    assert checks and all(" ok   " in line for line in checks), "\n".join(checks)
    for rank in (0, 1):
        mine = [line for line in checks if line.startswith(f"rank {rank} ")]
        for name in ("tokens", "topk_ids", "topk_weights", "expert_out", "out"):
            assert any(f"arrays.to_backend({name}) is the tensor's memory" in line for line in mine)
        for words in ("dispatch_async launches its kernels on tokens's memory",
                      "combine_async launches its kernel on expert_out's memory",
                      "combine_wait launches its kernel on out's memory",
                      "combine_wait returns the out tensor's memory",
                      "batch.x through DLPack is the runtime's expert_x buffer", "rows equal the reference exactly",
                      "holds the reference combine within tolerance", "on the runtime's stream",
                      "on a torch stream"):
            assert any(words in line for line in mine), words
