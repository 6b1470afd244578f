"""Every notebook in examples/notebooks/ is executed and must finish without error (each runs
on a CPU, checks itself against the reference and prints PASS), and its chart must be in the
executed notebook as an image (a figure drawn on a non-interactive backend and shown with
plt.show() leaves only text)."""

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "examples" / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_passes(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "store notebooks without outputs"
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    printed = "".join(o.get("text", "") for o in outputs)
    assert "PASS" in printed
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{path.name}: no image/png output: its chart did not render in the executed notebook"
