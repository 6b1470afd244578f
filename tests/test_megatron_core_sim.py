"""Megatron-core's own MoE layer on ep_runtime, on the CPU simulator: ``examples/megatron_moe.py``
in a torch.distributed gloo job of 2 ranks (forked by :func:`test_sessions_sim.torch_job_main`).

Each rank builds Megatron-core ``MoELayer``s with the same weights, Megatron's all-to-all token
dispatcher against the flex dispatcher, whose ``fused_a2a`` (Megatron-core's own, unmodified)
runs on ep_runtime's DeepEP layer (``deepep``: ``deep_ep.Buffer``, the dense layout;
``hybridep``: ``deep_ep.HybridEPBuffer``, the expanded one), and checks the
forward output, the input gradient and every parameter gradient within bf16 tolerances, then the
losses of 5 SGD steps (the example's docstring gives the tolerances and the CPU shims). Small
sizes (hidden 32, 4 experts, 16 tokens per rank) keep the simulator's part to seconds.

Skipped when megatron-core is not importable (``pip install megatron-core==0.16.1 --no-deps``).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "megatron_moe.py"
ARGS = ["--device", "cpu", "--backend", "both", "--hidden", "32", "--ffn", "64", "--experts", "4", "--top-k", "2",
        "--tokens", "16", "--steps", "5"]


def _megatron_core_importable() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):
        return False


pytestmark = pytest.mark.skipif(not _megatron_core_importable(),
                                reason="megatron-core is not installed (pip install megatron-core==0.16.1 --no-deps)")


def example():
    """examples/megatron_moe.py as a module (once per process)."""
    name = "megatron_moe_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def preload() -> None:
    """Import Megatron-core's MoE modules (after making ``import deep_ep`` give ep_runtime's layer:
    their fused_a2a reads it once) and the example once, before the ranks are forked."""
    from ep_runtime import megatron

    megatron.fused_a2a()
    import megatron.core.models.gpt.moe_module_specs
    import megatron.core.parallel_state
    import megatron.core.transformer.moe.moe_layer  # noqa: F401

    example()


def torch_rank_main(rank: int, n: int, store: str, out_dir: str) -> None:
    """One rank of the gloo job: the example's comparison, its result pickled."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    ex = example()
    args = ex.parse_args(ARGS + ["--init-method", f"file://{store}"])
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=240))
    try:
        got = ex.run(args, rank, n, rank)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(got, f)


def test_megatron_core_moe_layer_on_ep_runtime_matches_megatron_s_alltoall_dispatcher(tmp_path):
    from test_sessions_sim import run_job

    store, out = str(tmp_path / "store"), str(tmp_path / "out")
    launch = (f"import test_megatron_core_sim as m; m.preload(); import test_sessions_sim as t; "
              f"t.torch_job_main(2, {store!r}, {out!r}, 'test_megatron_core_sim')")
    results = run_job([sys.executable, "-c", launch], tmp_path, 2)
    ex = example()
    for rank, got in enumerate(results):
        assert set(got["backends"]) == {"deepep", "hybridep"}
        for backend, res in got["backends"].items():
            for name, err, tol in res["rows"]:
                assert err <= tol, f"rank {rank}, {backend}: {name} off by {err:.3e} of its largest value (tol {tol})"
            names = [r[0] for r in res["rows"]]
            assert "grad router.weight" in names and sum("linear_fc" in n for n in names) == 4, names
            assert len(res["losses"]) == 5
            for step, (l_ref, l_flex) in enumerate(res["losses"]):
                assert abs(l_flex - l_ref) <= ex.LOSS_TOL * abs(l_ref), f"{backend}: step {step + 1} loss"
            assert res["losses"][-1][0] < res["losses"][0][0], f"{backend}: the loss did not go down"
            # every step (1 checked + 5 trained) went through ep_runtime's DeepEP layer from Megatron-core's own
            # fused_a2a: forward 1 dispatch + 1 combine, backward a cached dispatch + a combine (with the
            # probabilities' gradient: DeepEP's topk_weights, HybridEP's probs)
            cls, (dispatch, combine) = ex.COUNTED[backend]
            assert res["calls"] == {f"{cls}.{dispatch}": 12, f"{cls}.{combine}": 12}, res["calls"]
        assert got["ok"]
