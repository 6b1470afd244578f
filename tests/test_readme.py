"""The README's CPU quick start runs as pasted: its code block, saved as a script and run in a
fresh interpreter, dispatches exactly and combines within no error on both simulated ranks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _quick_start() -> str:
    text = README.read_text()
    section = text[text.index("## Quick start on a CPU"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_is_short():
    assert len(README.read_text().splitlines()) <= 150


def test_the_quick_start_runs_as_pasted(tmp_path):
    script = tmp_path / "qs.py"
    script.write_text(_quick_start())
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("rank ")]
    assert len(lines) == 2, proc.stdout
    for r, line in enumerate(lines):
        assert line.startswith(f"rank {r}: ") and "dispatch exact: True" in line and line.endswith(
            "combine max error 0.0"), line
