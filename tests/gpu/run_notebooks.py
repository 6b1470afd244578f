"""Execute every notebook in examples/notebooks/ and print each code cell's text output.

On the GPU machine (the second script puts nbclient, ipykernel and matplotlib on PYTHONPATH where
the image lacks them; ``tools/build_nbcarry.sh`` builds ``.nbcarry``)::

    source .devcarry/setup.sh && source .nbcarry/setup.sh
    python3 tests/gpu/run_notebooks.py --out "$OUT/notebooks"

Anywhere else: ``python tests/gpu/run_notebooks.py`` (the notebooks fall back to the simulator).

Each notebook runs in a fresh ``python3`` kernel with its own folder as working directory, as
tests/test_notebooks.py runs them. Printed per notebook: every code cell's text (stdout, stderr,
text results; ``[image/png]`` where a cell shows an image; an error's traceback), then ``ok`` or
``FAILED`` and the time; last line PASS or FAIL. Exit status 1 if any notebook failed.

``--out DIR``: each notebook gets ``DIR/<notebook name>/`` as ``$EP_NOTEBOOK_OUT`` (where the GPU
walkthrough writes bench.json and bench.png), and the executed notebook, outputs included, is
written there too.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import sys
import time

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "notebooks"
#: Terminal colour codes in IPython tracebacks.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def cell_text(cell) -> str:
    """The text a code cell printed or returned, as a reader of a log wants it."""
    parts = []
    for out in cell.get("outputs", []):
        kind = out["output_type"]
        if kind == "stream":
            parts.append(out["text"])
        elif kind in ("execute_result", "display_data"):
            data = out.get("data", {})
            if "image/png" in data:
                parts.append("[image/png]\n")
            elif "text/plain" in data:
                parts.append(data["text/plain"] + "\n")
        elif kind == "error":
            parts.append(_ANSI.sub("", "\n".join(out["traceback"])) + "\n")
    return "".join(parts)


def run_notebook(path: pathlib.Path, out_dir: pathlib.Path | None, timeout: int) -> bool:
    """Execute ``path``; print its code cells' text; whether it finished without error."""
    import nbclient
    import nbformat
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    if out_dir is not None:
        nb_out = out_dir / path.stem
        nb_out.mkdir(parents=True, exist_ok=True)
        os.environ["EP_NOTEBOOK_OUT"] = str(nb_out)  # the kernel inherits it
    print(f"=== {path.name} ===", flush=True)
    t0 = time.perf_counter()
    failure = None
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}}).execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
        failure = exc
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        text = cell_text(cell)
        if text:
            print(f"--- code cell {i + 1} ---\n{text}", end="" if text.endswith("\n") else "\n")
    if failure is not None and not isinstance(failure, CellExecutionError):
        print(f"{type(failure).__name__}: {failure}")  # a timeout or a dead kernel leaves no error output
    if out_dir is not None:
        nbformat.write(nb, out_dir / path.stem / path.name)
    print(f"=== {path.name}: {'ok' if failure is None else 'FAILED'} in {time.perf_counter() - t0:.1f} s ===",
          flush=True)
    return failure is None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", type=pathlib.Path,
                   help="notebooks to run (default: every examples/notebooks/*.ipynb)")
    p.add_argument("--out", type=pathlib.Path, help="folder for the notebooks' results and executed copies")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    args = p.parse_args(argv)
    import nbclient
    from jupyter_client.kernelspec import KernelSpecManager

    paths = [q.resolve() for q in args.notebooks] or sorted(NOTEBOOKS.glob("*.ipynb"))
    spec = KernelSpecManager().get_kernel_spec("python3")
    print(f"python {sys.version.split()[0]} ({sys.executable}), nbclient {nbclient.__version__}, "
          f"kernel python3: {' '.join(spec.argv[:3])}", flush=True)
    ok = [run_notebook(path, args.out, args.timeout) for path in paths]
    print(f"{sum(ok)} of {len(ok)} notebooks ok")
    print("PASS" if all(ok) else "FAIL")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
