"""DeepEP's own intranode and low-latency tests, unmodified, against ep_runtime's DeepEP layer
(issues #63 and #64).

DeepEP's ``tests/test_intranode.py`` and ``tests/test_low_latency.py`` at tag v1.2.1 (commit
9af0e0d0e74f3577af1979c9b9e1ac2cad0104ee) are fetched, never copied into this repository: check
out that tag's ``tests/`` directory (``test_intranode.py``, ``utils.py``, ``test_low_latency.py``)
and point this script at it. It checks that the three files are v1.2.1's (their git blob ids),
installs the ``deep_ep`` import alias into a temporary site directory that every process of the
run reads at start-up (a ``sitecustomize`` on ``PYTHONPATH``: the test's
``torch.multiprocessing.spawn`` workers are fresh interpreters), runs ``python TEST ARGS`` in that
directory (``--test intranode``, the default, or ``--test low_latency``), and prints PASS or FAIL
with the test's exit status::

    git clone https://github.com/deepseek-ai/DeepEP && git -C DeepEP checkout v1.2.1
    python tests/gpu/deepep_intranode.py --deepep-tests DeepEP/tests -- --num-processes 2
    python tests/gpu/deepep_intranode.py --deepep-tests DeepEP/tests --test low_latency -- --num-processes 2

``test_low_latency.py``'s defaults: 128 tokens, hidden 7168, top-8 of 288 experts, 8 processes.
Its checks run first; its timing section profiles the kernels whose names hold ``dispatch`` and
``combine`` with ``utils.bench_kineto``, which asserts one such kernel each, DeepEP's. The
layer's dispatch and combine are several kernels each (send, receive, the batched layout's, the
weights' exchange), so for that test the workers' ``sitecustomize`` replaces
``utils.bench_kineto`` by a sum, per call, of every kernel whose name holds each word (printed
as DeepEP prints its times; with the receive hook, the whole time as the first part and 0 as the
second): a harness change, like the two below, the test file untouched.

The test's defaults are 4096 tokens, hidden 7168, top-8 of 256 experts, 8 processes: pass
``--num-processes`` for the GPUs at hand. Its harness (``utils.init_dist``) joins an NCCL group,
one GPU per process. With fewer GPUs than processes, ``--share-gpu`` maps process ``i`` to GPU
``i % count`` and ``--backend gloo`` replaces NCCL (which refuses two ranks on one GPU; Gloo's
``all_gather_into_tensor`` then gets the test's ``[world, n, ...]`` output viewed as ``[world * n, ...]``,
the one shape Gloo takes); run it
under CUDA MPS so the ranks' kernels are co-resident::

    bash tests/gpu/mps_run.sh 2 python tests/gpu/deepep_intranode.py --deepep-tests DeepEP/tests \\
        --share-gpu --backend gloo -- --num-processes 2

These harness changes are made in the workers' ``sitecustomize``; the test file is not touched.
The test's tuning section prints timings (DeepEP's chunk sizes mean nothing to the layer).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The git blob ids of DeepEP v1.2.1's test files (``git rev-parse v1.2.1:tests/<file>``).
V1_2_1_BLOBS = {"test_intranode.py": "cd26f68f737f9c931b0e9a07135c3c8f9ec4f442",
                "utils.py": "478033802562228602f9bce150f8eaa6a842e254",
                "test_low_latency.py": "aa928aab114b0fe15dadeb01184e0fa691ac2a2f"}
#: The workers' start-up: the next ``sitecustomize`` on the path (this one shadows it: e.g. a GPU
#: image's own), the alias's site directory, then the harness options.
SITECUSTOMIZE = '''import importlib.machinery
import importlib.util
import os
import site
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
site.addsitedir({site!r})
if os.environ.get("EP_DEEPEP_TEST_BACKEND") or os.environ.get("EP_DEEPEP_TEST_SHARE_GPU"):
    import torch
    import torch.distributed as dist

    backend = os.environ.get("EP_DEEPEP_TEST_BACKEND")
    if backend:
        _init = dist.init_process_group

        def init_process_group(*args, **kwargs):
            kwargs["backend"] = backend
            if backend == "gloo":
                kwargs.pop("device_id", None)
            return _init(*args, **kwargs)

        dist.init_process_group = init_process_group
        if backend == "gloo":
            _all_gather_into_tensor = dist.all_gather_into_tensor

            def all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs):
                # Gloo takes the output as [world * n, ...] only; NCCL (and the test) also [world, n, ...]
                if output_tensor.dim() == input_tensor.dim() + 1:
                    output_tensor = output_tensor.view(-1, *input_tensor.shape[1:])
                return _all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs)

            dist.all_gather_into_tensor = all_gather_into_tensor
    if os.environ.get("EP_DEEPEP_TEST_SHARE_GPU"):
        _set_device = torch.cuda.set_device
        torch.cuda.set_device = lambda device: _set_device(torch.device(device).index % torch.cuda.device_count()
                                                           if not isinstance(device, int)
                                                           else device % torch.cuda.device_count())
if os.environ.get("EP_DEEPEP_TEST_KERNEL_SUMS"):
    import torch

    sys.path.insert(0, os.environ["EP_DEEPEP_TEST_KERNEL_SUMS"])
    import utils as _deepep_test_utils

    def _kernel_sums(fn, kernel_names, num_tests=30, suppress_kineto_output=False, trace_path=None,
                     barrier_comm_profiling=False, num_kernels_per_period=1):
        names = (kernel_names,) if isinstance(kernel_names, str) else tuple(kernel_names)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(num_tests):
                fn()
            torch.cuda.synchronize()
        events = prof.key_averages()
        out = []
        for name in names:
            us = sum(getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) for e in events
                     if name in e.key)
            seconds = us / 1e6 / num_tests
            out.append(seconds if num_kernels_per_period == 1 else [seconds] + [0.0] * (num_kernels_per_period - 1))
        return out[0] if isinstance(kernel_names, str) else tuple(out)

    _deepep_test_utils.bench_kineto = _kernel_sums
'''


def blob_id(path: Path) -> str:
    """The git blob id of a file's bytes."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_files(tests: Path) -> None:
    """Exit unless ``tests`` holds DeepEP v1.2.1's test files, unmodified."""
    for name, want in V1_2_1_BLOBS.items():
        path = tests / name
        if not path.exists():
            sys.exit(f"deepep_intranode: {path} is missing; check out DeepEP's tag v1.2.1 and pass its tests/")
        if blob_id(path) != want:
            sys.exit(f"deepep_intranode: {path} is not DeepEP v1.2.1's (git blob {blob_id(path)}, expected {want}); "
                     f"check out tag v1.2.1, unmodified")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deepep-tests", required=True, type=Path, help="DeepEP v1.2.1's tests/ directory")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None,
                   help="the test harness's torch.distributed backend (default: its own, NCCL)")
    p.add_argument("--share-gpu", action="store_true", help="process i on GPU i %% count (with CUDA MPS)")
    p.add_argument("--test", choices=("intranode", "low_latency"), default="intranode",
                   help="DeepEP's test_intranode.py (default) or test_low_latency.py")
    p.add_argument("test_args", nargs=argparse.REMAINDER, help="after --: the test's arguments")
    args = p.parse_args(argv)
    tests = args.deepep_tests.resolve()
    check_files(tests)
    sys.path.insert(0, str(ROOT))
    from ep_runtime.integrations.deep_ep import alias

    with tempfile.TemporaryDirectory(prefix="deepep_intranode_") as tmp:
        site, boot = Path(tmp) / "site", Path(tmp) / "boot"
        boot.mkdir()
        alias.install(site)
        (boot / "sitecustomize.py").write_text(SITECUSTOMIZE.format(site=str(site)))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(boot), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
        if args.backend:
            env["EP_DEEPEP_TEST_BACKEND"] = args.backend
        if args.share_gpu:
            env["EP_DEEPEP_TEST_SHARE_GPU"] = "1"
        if args.test == "low_latency":
            env["EP_DEEPEP_TEST_KERNEL_SUMS"] = str(tests)
        test_file = f"test_{args.test}.py"
        test_args = [a for a in args.test_args if a != "--"]
        print(f"deepep_intranode: DeepEP v1.2.1 tests/{test_file} (unmodified) on ep_runtime.deep_ep, "
              f"args {test_args}", flush=True)
        rc = subprocess.call([sys.executable, test_file, *test_args], cwd=tests, env=env)
    print("PASS" if rc == 0 else f"FAIL (exit status {rc})", flush=True)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
