"""The benchmark tool on the CPU: its byte accounting, the baseline's permutation, and a smoke
run on the simulator (the GPU numbers come from mpirun on the GPU machine)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import numpy as np
import pytest

from ep_runtime import EPConfig, EPRuntime, reference
from ep_runtime.tools.bench.stats import gbps, summarize
from ep_runtime.tools.bench.traffic import nccl_permutation, rank_traffic
from ep_runtime.testing import make_inputs


def test_traffic_of_a_hand_worked_example():
    # 2 ranks, 4 experts (rank 0: 0-1, rank 1: 2-3), top-2, hidden 8 (16-byte rows)
    ids0 = np.array([[0, 1], [0, 2], [2, 3]])  # token 0 -> rank 0; token 1 -> both; token 2 -> rank 1
    ids1 = np.array([[3, 1]])                  # token 0 -> both
    t = rank_traffic([ids0, ids1], 0, n_local_experts=2, hidden=8)
    assert t.sent == (2, 2) and t.recv == (2, 1)
    assert t.rows == 4                          # (0,0,e0) (0,0,e1) (0,1,e0) (1,0,e1)
    assert t.logical_bytes == 3 * 16
    # out: 2 rows to rank 1 + routing of 3 tokens x 2 x 8 B; in: 1 row + routing of 1 token
    assert t.dispatch_nvlink_bytes == max(2 * 16 + 3 * 16, 1 * 16 + 1 * 16)
    assert t.combine_nvlink_bytes == 2 * 16
    # dispatch: 3 tokens read once each (token 1 serves both ranks with one read), 3 received rows
    # written, then read once each by the expansion copy, which writes the 4 batch rows
    assert t.dispatch_hbm_bytes == (3 + 3 + 3 + 4) * 16
    # combine: 4 expert outputs read; 4 partials of this rank's tokens written here (its own 2,
    # rank 1's 2 through NVLink) and read; 3 results written
    assert t.combine_hbm_bytes == (4 + 2 * 4 + 3) * 16
    # compact: no expansion copy; combine reads one caller row per received token
    assert t.compact_dispatch_hbm_bytes == (3 + 3) * 16 == t.hbm_bytes("dispatch", "compact")
    # (this rank's own 2 partials are read in place by combine_wait: only rank 1's 2 land and are read)
    assert t.compact_combine_hbm_bytes == (3 + 2 * 2 + 3) * 16 == t.hbm_bytes("combine", "compact")
    assert t.hbm_bytes("combine") == t.combine_hbm_bytes
    # an FP8 format: dispatch moves 24-byte messages per token (combine stays bf16, 16-byte rows)
    f = rank_traffic([ids0, ids1], 0, n_local_experts=2, hidden=8, token_bytes=24)
    assert f.logical_bytes == 3 * 24 and f.combine_nvlink_bytes == t.combine_nvlink_bytes
    assert f.dispatch_nvlink_bytes == max(2 * 24 + 3 * 16, 1 * 24 + 1 * 16)
    # (the sender reads its bf16 rows, 16 bytes, and encodes them; the rest moves 24-byte messages)
    assert f.dispatch_hbm_bytes == 3 * 16 + (3 + 3 + 4) * 24 and f.combine_hbm_bytes == t.combine_hbm_bytes
    assert f.compact_dispatch_hbm_bytes == 3 * 16 + 3 * 24
    # pre-quantized input: the sender reads its 24-byte codes and scales, not bf16 rows
    p = rank_traffic([ids0, ids1], 0, n_local_experts=2, hidden=8, token_bytes=24, input_bytes=24)
    assert p.dispatch_hbm_bytes == (3 + 3 + 3 + 4) * 24 and p.compact_dispatch_hbm_bytes == (3 + 3) * 24
    assert p.dispatch_nvlink_bytes == f.dispatch_nvlink_bytes and p.logical_bytes == f.logical_bytes


@pytest.mark.parametrize("scenario", ["random", "zero_rank", "one_expert"])
def test_nccl_permutation_builds_the_reference_batch(scenario):
    cfg = EPConfig(n_ranks=3, n_experts=6, top_k=2, hidden=4, max_tokens_per_rank=7)
    xs, ids, ws = make_inputs(cfg, scenario, 4)
    batches = reference.dispatch(xs, ids, ws, cfg)
    for r in range(cfg.n_ranks):
        # what all_to_all_single delivers to rank r: each source's tokens that hit r, in order
        buf = np.concatenate([xs[s][(ids[s] // cfg.n_local_experts == r).any(axis=1)] for s in range(cfg.n_ranks)])
        perm = nccl_permutation(ids, r, cfg.n_local_experts)
        assert len(perm) == batches[r].n_rows
        np.testing.assert_array_equal(buf[perm].view(np.uint16), batches[r].x.view(np.uint16))


def test_ranks_sharing_a_gpu_are_found_so_the_nccl_baseline_is_skipped_on_all_alike():
    """Ranks on one GPU (CUDA MPS runs) cannot form an NCCL communicator ("Duplicate GPU
    detected"): the NCCL baseline finds them from every rank's GPU first and is skipped."""
    from ep_runtime.tools.bench.measure import ranks_sharing_a_gpu

    assert ranks_sharing_a_gpu(["0000:3B:00.0", "0000:5C:00.0"]) == []
    assert ranks_sharing_a_gpu(["a"] * 8) == [list(range(8))]
    assert ranks_sharing_a_gpu(["a", "b", "a", "c", "b"]) == [[0, 2], [1, 4]]
    assert ranks_sharing_a_gpu([]) == []


def test_stats():
    s = summarize([3.0, 1.0, 2.0, 10.0])
    assert s["median"] == 2.5 and s["n"] == 4 and s["p10"] < s["median"] < s["p90"]
    assert gbps(2_000_000, 1000.0) == 2.0


def test_help_documents_the_tool():
    out = subprocess.run([sys.executable, "-m", "ep_runtime.tools.bench", "--help"], capture_output=True, text=True,
                         check=True).stdout
    for word in ("--tokens", "--samples", "--json", "--plot", "floor", "NCCL", "logical GB/s", "--mode",
                 "CUDA graphs", "n_tokens"):
        assert word in out


def test_graph_mode_is_refused_on_the_simulator_before_anything_runs(monkeypatch, capsys):
    import ep_runtime.shmem.launch as launch
    from ep_runtime.tools.bench.__main__ import main

    def must_not_run(*a, **k):
        raise AssertionError("run_job called: graph mode must be refused before anything runs")

    monkeypatch.setattr(launch, "run_job", must_not_run)
    with pytest.raises(SystemExit) as exc:
        main(["--backend", "sim", "--mode", "eager", "graph", "--tokens", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for words in ("--mode graph", "CUDA graphs", "simulator", "mpirun", "--mode eager"):
        assert words in err


class _FakeGraph:
    def __init__(self, log):
        self.log = log

    def launch(self, stream):
        self.log.append("launch")


class _FakeStream:
    """Stands in for CuPy's stream on the simulator: there a "captured" call simply runs (the
    simulator launches synchronously), and a "replay" does nothing."""

    def __init__(self):
        self.log = []

    def begin_capture(self):
        assert not self.log or self.log[-1] != "begin", "nested capture"
        self.log.append("begin")

    def end_capture(self):
        assert self.log[-1] != "end"
        self.log.append("end")
        return _FakeGraph(self.log)


def graph_mode_pe(session, cfg_dict, seed):
    """The graph-mode timing's host side on the simulator (a fake stream): captures must follow
    the runtime's call order and leave it usable; then an eager round trip, checked."""
    from ep_runtime import EPRuntime, reference
    from ep_runtime.tools.bench.measure import takes_device_token_count, time_graph_round_trips

    cfg = EPConfig(n_ranks=session.n_ranks, **cfg_dict)
    T, r = cfg.max_tokens_per_rank, session.rank
    xs, ids, ws = make_inputs(cfg, "random", seed, n_tokens=[T] * cfg.n_ranks)
    with EPRuntime(cfg, session) as rt:
        inputs = tuple(session.to_device(a) for a in (xs[r].view(np.uint16), ids[r], ws[r]))
        y = session.alloc_local("y", (cfg.recv_rows_capacity, cfg.hidden), np.uint16)
        out = session.alloc_local("out", (T, cfg.hidden), np.uint16)
        n_tok = session.to_device(np.array([T], np.int32)) if takes_device_token_count(rt) else None
        stream = _FakeStream()
        session.stream_barrier = lambda: stream.log.append("stream_barrier")  # the samples' device-side start
        spans = time_graph_round_trips(rt, session, inputs, y, out, samples=2, warmup=1, n_tokens=n_tok,
                                       stream=stream)
        calls_after_capture = rt.calls
        batch = rt.dispatch(*inputs)
        rt.combine(y, batch.handle, out=out)
        ref = reference.dispatch(xs, ids, ws, cfg)[r]
        n = ref.n_rows
        exact = bool(np.array_equal(session.to_host(batch.x)[:n], ref.x.view(np.uint16)))
    return {"spans": {k: len(v) for k, v in spans.items()}, "log": stream.log, "calls": calls_after_capture,
            "exact": exact, "device_n_tokens": n_tok is not None}


def test_graph_mode_captures_in_call_order_on_the_simulator():
    from ep_runtime.tools.bench.measure import GRAPH_ROUND_TRIPS
    from ep_runtime.shmem.launch import run_pes

    cfg = dict(n_experts=4, top_k=2, hidden=16, max_tokens_per_rank=3)
    for res in run_pes(graph_mode_pe, 2, args=(cfg, 3), timeout_s=300):
        assert res["spans"] == {k: 2 for k in ("dispatch", "dispatch_async", "dispatch_wait", "combine",
                                                 "combine_async", "combine_wait")}
        n_graphs = sum(len(phase) for rt in GRAPH_ROUND_TRIPS for phase in rt)
        assert n_graphs == 6
        assert res["log"][:2 * n_graphs] == ["begin", "end"] * n_graphs       # captured first, one at a time
        # then replayed (1 warm-up + 2), each phase started by an on-stream barrier
        replays = [["stream_barrier"] + ["launch"] * len(phase) for rt in GRAPH_ROUND_TRIPS for _ in range(3)
                   for phase in rt]
        assert res["log"][2 * n_graphs:] == sum(replays, [])
        assert res["calls"] == 2  # two round trips captured: phase graphs, then one graph per call
        assert res["exact"]       # the runtime is usable and correct after the captures
        assert res["device_n_tokens"] == ("n_tokens" in inspect.signature(EPRuntime.dispatch_async).parameters)


def test_table_and_results_carry_the_mode():
    from ep_runtime.tools.bench.measure import SPANS
    from ep_runtime.tools.bench.run import _result, table

    cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=8, max_tokens_per_rank=3)
    _, ids, _ = make_inputs(cfg, "random", 1, n_tokens=[3, 3])
    tr = rank_traffic(ids, 0, cfg.n_local_experts, cfg.hidden)
    spans = {k: [1.0, 2.0, 3.0] for k in SPANS}
    ceil = {"nvlink_gbps": 100.0, "hbm_gbps": 1000.0}
    graph = {"captured_rows": 3, "n_tokens": "device scalar", "replayed_round_trips": 6, "device_calls": 6}
    plan = {"receiver": "route_first_chunked"}
    res = [_result(cfg, tr, spans, {}, ceil, "eager"), _result(cfg, tr, spans, {}, ceil, "graph", graph, plan=plan)]
    assert [r["mode"] for r in res] == ["eager", "graph"] and "graph" not in res[0] and res[1]["graph"] == graph
    lines = table([res]).splitlines()
    assert "mode" in lines[0].split("|")[0] and "receiver" in lines[0]
    # a record without a plan shows "-"; one with a plan shows its receiver, short
    assert " bf16 eager expanded        - |" in lines[1] and " graph expanded rfirst/c |" in lines[2]
    assert any(line.startswith("graph mode:") and "device scalar" in line for line in lines)
    assert "WARNING" not in table([res])
    res[1]["graph"]["device_calls"] = 4  # replays that did not run
    assert "WARNING rank 0 T=3: the device counted 4 calls for 6" in table([res])


def test_smoke_run_on_the_simulator(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ep_runtime.tools.bench", "--backend", "sim", "--ranks", "2", "--tokens", "3", "6",
         "--hidden", "16", "--experts", "4", "--top-k", "2", "--samples", "3", "--warmup", "1",
         "--json", str(path), "--plot", str(tmp_path / "bench.png")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "dispatch us" in proc.stdout and "ceilings measured in this run" in proc.stdout and " bf16 eager expanded     wait |" in proc.stdout
    assert "nan" not in proc.stdout and " 0.0 " not in proc.stdout and "n/a" in proc.stdout
    # progress: the estimate, then a line per configuration, each on its own line
    assert "\r" not in proc.stderr and "ep_runtime.tools.bench: simulator, about" in proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("ep_runtime.tools.bench: [")]
    assert [line.split(" (")[0] for line in progress] == [f"ep_runtime.tools.bench: [{i}/2] T={t} H=16 K=2 E=4 sms=all bf16"
                                                         for i, t in ((1, 3), (2, 6))]
    assert (tmp_path / "bench.png").stat().st_size > 0
    data = json.loads(path.read_text())
    assert data["meta"]["backend"] == "sim" and data["meta"]["ranks"] == 2 and data["meta"]["git_sha"]
    assert [len(rank) for rank in data["results"]] == [2, 2]
    for rank in data["results"]:
        for res in rank:
            for span in ("dispatch", "dispatch_async", "dispatch_wait", "combine", "combine_async", "combine_wait"):
                assert res["times_us"][span]["n"] == 3 and res["times_us"][span]["median"] > 0
            assert res["traffic"]["tokens"] == res["config"]["max_tokens_per_rank"]
            assert res["mode"] == "eager" and res["layout"] == "expanded"
            # the runtime's plan is recorded (the simulator's: no PDL, no early receiver)
            assert res["plan"]["receiver"] == "wait" and res["plan"]["transport"] == "stores", res["plan"]
            assert res["plan"]["layouts"] == ["expanded"] and res["plan"]["summary"].startswith("wait receiver")
    assert data["args"]["mode"] == ["eager"]


def test_prequantized_fp8_input_is_timed_and_counted_on_the_simulator(tmp_path):
    """Both FP8 formats timed next to bf16, each with bf16 tokens (quantized in dispatch_async)
    and with their codes and scales (--fp8-input prequantized: token_scales=); the sender's reads
    follow the input, and the logical bytes count the codes and scales sent. ``--backward``
    times one layer's backward (bf16 only: a backward sends bf16 gradients) both ways, with the
    NVLink bytes of each: the slot values add 4 bytes a row where 2 + 2 add a dispatch and a
    combine."""
    path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ep_runtime.tools.bench", "--backend", "sim", "--ranks", "2", "--tokens", "4",
         "--hidden", "256", "--experts", "4", "--top-k", "2", "--samples", "2", "--warmup", "1",
         "--token-dtype", "bfloat16", "fp8_e4m3", "fp8_e4m3_ue8m0", "--fp8-input", "bf16", "prequantized",
         "--layout", "expanded", "compact", "--backward", "--json", str(path)], capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backward of one layer (median us" in proc.stdout
    assert len([ln for ln in proc.stdout.splitlines() if ln.endswith(" MB") and " | " in ln]) == 4  # 2 ranks x 2 layouts
    assert " ue8m0+pq eager expanded     wait |" in proc.stdout and "    ue8m0 eager  compact     wait |" in proc.stdout
    assert "  e4m3 eager expanded     wait |" in proc.stdout and "  bf16 eager expanded     wait |" in proc.stdout
    assert "+pq: pre-quantized input" in proc.stdout
    for rank in json.loads(path.read_text())["results"]:
        runs = {(res["config"]["token_dtype"], res["token_input"], res["layout"]): res for res in rank}
        # bf16 takes bf16 tokens only; the FP8 format both inputs, each layout
        assert set(runs) == {("bfloat16", "bf16", "expanded"), ("bfloat16", "bf16", "compact")} | {
            (f, g, lay) for f in ("fp8_e4m3", "fp8_e4m3_ue8m0") for g in ("bf16", "prequantized")
            for lay in ("expanded", "compact")}
        # 4 tokens, each received by this rank or not: logical bytes count the bytes sent (256 codes and
        # two 4-byte scales; the message's padding is never sent) against 512-byte bf16 rows
        for key, res in runs.items():
            assert ("backward" in res["times_us"]) == (key[0] == "bfloat16"), key
        for lay in ("expanded", "compact"):
            res = runs["bfloat16", "bf16", lay]
            assert res["times_us"]["backward"]["n"] == 2 and res["times_us"]["backward_2d2c"]["median"] > 0
            tr, nvl = res["traffic"], res["backward_nvlink_bytes"]
            assert 0 < tr["slot_nvlink_bytes"] <= 4 * 4 * 2 and tr["slot_nvlink_bytes"] % 4 == 0  # 4 tokens, top-2
            assert nvl["backward_routing"] == (tr["dispatch_nvlink_bytes"] + tr["slot_nvlink_bytes"]
                                               + tr["combine_nvlink_bytes"])
            # the kept routing's dispatch sends the token rows alone: 8 bytes a slot less to each peer
            assert nvl["backward"] == (tr["kept_dispatch_nvlink_bytes"] + tr["slot_nvlink_bytes"]
                                       + tr["combine_nvlink_bytes"]) < nvl["backward_routing"]
            assert res["times_us"]["backward_routing"]["n"] == 2
            assert nvl["backward_2d2c"] == 2 * (tr["dispatch_nvlink_bytes"] + tr["combine_nvlink_bytes"])
        bf16 = runs["bfloat16", "bf16", "expanded"]["traffic"]["logical_bytes"]
        assert runs["fp8_e4m3", "bf16", "expanded"]["traffic"]["logical_bytes"] * 512 == bf16 * 264
        for lay in ("expanded", "compact"):
            q, b = runs["fp8_e4m3_ue8m0", "bf16", lay], runs["fp8_e4m3_ue8m0", "prequantized", lay]
            assert all(b["times_us"][span]["median"] > 0 for span in ("dispatch", "combine"))
            tq, tb = q["traffic"], b["traffic"]
            # 256 codes + 2 one-byte scales per message against 512-byte bf16 rows, read once per token
            # that goes anywhere; nothing else differs
            sent_any = 4  # every token of the random routing has experts
            assert tq["dispatch_hbm_bytes"] - tb["dispatch_hbm_bytes"] == sent_any * (512 - 258)
            assert tq["compact_dispatch_hbm_bytes"] - tb["compact_dispatch_hbm_bytes"] == sent_any * (512 - 258)
            assert tq["dispatch_nvlink_bytes"] == tb["dispatch_nvlink_bytes"]
            assert tq["combine_hbm_bytes"] == tb["combine_hbm_bytes"]


def test_nvfp4_is_timed_from_bf16_and_prequantized_input_on_the_simulator(tmp_path):
    """NVFP4 through the bench, both inputs: bf16 tokens (the rule's global scale and the codes made
    inside dispatch_async) and pre-quantized codes, E4M3 block scales and the global scale
    (``token_global_scale=``); the logical bytes count the message sent (128 code bytes, 16 block
    scales and the 4-byte global scale of a 256-element row) and the pre-quantized input's reads
    are those bytes instead of the 512-byte bf16 row."""
    path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ep_runtime.tools.bench", "--backend", "sim", "--ranks", "2", "--tokens", "4",
         "--hidden", "256", "--experts", "4", "--top-k", "2", "--samples", "2", "--warmup", "1",
         "--token-dtype", "bfloat16", "nvfp4", "--fp8-input", "bf16", "prequantized", "--json", str(path)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " nvfp4+pq eager expanded     wait |" in proc.stdout and "    nvfp4 eager expanded     wait |" in proc.stdout
    for rank in json.loads(path.read_text())["results"]:
        runs = {(res["config"]["token_dtype"], res["token_input"]): res for res in rank}
        assert set(runs) == {("bfloat16", "bf16"), ("nvfp4", "bf16"), ("nvfp4", "prequantized")}
        bf16 = runs["bfloat16", "bf16"]["traffic"]
        q, pq = runs["nvfp4", "bf16"]["traffic"], runs["nvfp4", "prequantized"]["traffic"]
        assert q["logical_bytes"] * 512 == bf16["logical_bytes"] * (128 + 16 + 4)
        assert q["dispatch_hbm_bytes"] - pq["dispatch_hbm_bytes"] == 4 * (512 - (128 + 16 + 4))
        assert all(runs[k]["times_us"][span]["median"] > 0 for k in runs for span in ("dispatch", "combine"))


def test_compact_layout_and_float32_partials_are_timed_and_counted_on_the_simulator(tmp_path):
    path = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ep_runtime.tools.bench", "--backend", "sim", "--ranks", "2", "--tokens", "5",
         "--hidden", "16", "--experts", "4", "--top-k", "2", "--samples", "2", "--warmup", "1",
         "--layout", "expanded", "compact", "--combine-dtype", "bfloat16", "float32", "--json", str(path)],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert " bf16/f32 eager  compact     wait |" in proc.stdout and "  bf16 eager expanded     wait |" in proc.stdout
    assert " bf16 eager  compact     wait |" in proc.stdout  # the compact layout timed next to the expanded one
    for rank in json.loads(path.read_text())["results"]:
        assert [res["layout"] for res in rank] == ["expanded", "compact"] * 2
        assert all(res["times_us"][span]["median"] > 0 for res in rank for span in ("dispatch", "combine"))
        runs = {(res["config"]["combine_dtype"], res["layout"]): res for res in rank}
        assert set(runs) == {(c, lay) for c in ("bfloat16", "float32") for lay in ("expanded", "compact")}
        bf16, f32 = runs["bfloat16", "compact"]["traffic"], runs["float32", "compact"]["traffic"]
        assert f32["combine_nvlink_bytes"] == 2 * bf16["combine_nvlink_bytes"]  # partials: 4 H bytes
        assert f32["logical_bytes"] == bf16["logical_bytes"] and f32["dispatch_hbm_bytes"] == bf16["dispatch_hbm_bytes"]


def test_plan_overrides_and_served_layouts_reach_the_runtimes(tmp_path):
    """``--plan`` sets every runtime's plan fields; ``--serve each`` times each layout on a runtime
    serving only it, ``both`` every layout on one runtime serving both."""
    for serve in ("each", "both"):
        path = tmp_path / f"bench_{serve}.json"
        proc = subprocess.run(
            [sys.executable, "-m", "ep_runtime.tools.bench", "--backend", "sim", "--ranks", "2", "--tokens", "4",
             "--hidden", "16", "--experts", "4", "--top-k", "2", "--samples", "2", "--warmup", "1",
             "--layout", "expanded", "compact", "--serve", serve, "--plan", "receiver=land", "--json", str(path)],
            capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "    land |" in proc.stdout, proc.stdout
        for rank in json.loads(path.read_text())["results"]:
            assert {res["layout"] for res in rank} == {"expanded", "compact"}
            for res in rank:
                assert res["plan"]["receiver"] == "land"
                want = ["expanded", "compact"] if serve == "both" else [res["layout"]]
                assert res["plan"]["layouts"] == want, (serve, res["layout"], res["plan"]["layouts"])


# -- the bench as a newcomer meets it on the simulator --------------------------------------------
def test_help_shows_the_defaults_of_both_backends():
    out = subprocess.run([sys.executable, "-m", "ep_runtime.tools.bench", "--help"], capture_output=True, text=True,
                         check=True).stdout
    text = " ".join(out.split())  # argparse wraps to the terminal's width
    for words in ("(default: 4096 on GPUs, 8 on the simulator)", "(default: 7168 on GPUs, 64 on the simulator)",
                  "(default: 8 on GPUs, 2 on the simulator)", "(default: 256 on GPUs, 4 per rank on the simulator)",
                  "(default: 50 on GPUs, 5 on the simulator)", "(default: 5 on GPUs, 1 on the simulator)",
                  "(default: 2)", "(default: eager)", "(default: expanded)", "(default: bfloat16)",
                  "(default: 600.0)", "(default: 256)"):
        assert words in text, words


def test_size_defaults_follow_the_backend():
    """GPU runs keep the GPU layer (their JSON args unchanged); the simulator gets a tiny one;
    sizes given on the command line are kept on either."""
    from ep_runtime.tools.bench.__main__ import _parser, apply_size_defaults

    gpu = _parser().parse_args([])
    apply_size_defaults(gpu, "nvshmem", 2)
    assert (gpu.tokens, gpu.hidden, gpu.top_k, gpu.experts, gpu.samples, gpu.warmup) == (
        [4096], [7168], [8], [256], 50, 5)
    sim = _parser().parse_args(["--hidden", "32"])
    apply_size_defaults(sim, "sim", 3)
    assert (sim.tokens, sim.hidden, sim.top_k, sim.experts, sim.samples, sim.warmup) == ([8], [32], [2], [12], 5, 1)


def test_gpu_sizes_are_refused_on_the_simulator_before_anything_runs(monkeypatch, capsys):
    import ep_runtime.shmem.launch as launch
    from ep_runtime.tools import sim_cost
    from ep_runtime.tools.bench.__main__ import main

    def must_not_run(*a, **k):
        raise AssertionError("run_job called: a sweep the simulator cannot finish must be refused first")

    monkeypatch.setattr(launch, "run_job", must_not_run)
    monkeypatch.setattr(sim_cost, "usable_cores", lambda: 2)
    with pytest.raises(SystemExit) as exc:
        main(["--backend", "sim", "--tokens", "4096", "--hidden", "7168", "--top-k", "8", "--experts", "256"])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    for words in ("the simulator cannot finish this sweep within --timeout 600 s; estimate: about",
                  "--tokens 8 --hidden 64 --top-k 2 --experts 8", "mpirun -np 2 python -m ep_runtime.tools.bench"):
        assert words in err, err


def _sim_and_gpu_results():
    """Results of one configuration in both layouts at T = 3 and 6, as the simulator (no
    ceilings) and as a GPU (finite ceilings) report them."""
    from ep_runtime.tools.bench.measure import SPANS
    from ep_runtime.tools.bench.run import _result

    out = {}
    for name, ceil in (("sim", {"nvlink_gbps": float("nan"), "hbm_gbps": float("nan")}),
                       ("gpu", {"nvlink_gbps": 100.0, "hbm_gbps": 1000.0})):
        res = []
        for T in (6, 3):  # out of order: the plot must sort
            cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=8, max_tokens_per_rank=T)
            _, ids, _ = make_inputs(cfg, "random", 1, n_tokens=[T, T])
            tr = rank_traffic(ids, 0, cfg.n_local_experts, cfg.hidden)
            spans = {k: [1e5 * T, 2e5 * T, 3e5 * T] for k in SPANS}
            res += [_result(cfg, tr, spans, {}, ceil, "eager", None, layout) for layout in ("expanded", "compact")]
        out[name] = res
    return out


def test_table_says_n_a_where_a_figure_has_no_meaning():
    from ep_runtime.tools.bench.run import SIMULATOR_NOTE, table

    runs = _sim_and_gpu_results()
    sim = table([runs["sim"]], simulated=True)
    assert "nan" not in sim and " 0.0 " not in sim
    rows = [line for line in sim.splitlines() if line.startswith("   0 ")]
    assert len(rows) == 4
    for line in rows:
        dispatch, combine, baselines = line.split("|")[1:]
        # GB/s log, NVL, floor, %floor; GB/s log, floor, %floor; no baselines ran
        assert dispatch.split()[-4:] == ["n/a"] * 4 and combine.split()[-3:] == ["n/a"] * 3, line
        assert baselines.strip() == "n/a"
    assert "ceilings measured in this run: n/a on the simulator" in sim and SIMULATOR_NOTE in sim
    gpu = table([runs["gpu"]])
    assert "n/a" not in gpu and "nan" not in gpu and SIMULATOR_NOTE not in gpu
    assert "ceilings measured in this run: NVLink 100.0 GB/s per direction, HBM 1000.0 GB/s read+write" in gpu
    # a GPU run without an NVLink ceiling (one rank): n/a, not nan
    for res in runs["sim"]:
        res["ceilings"] = {"nvlink_gbps": float("nan"), "hbm_gbps": 1000.0}
    assert "nan" not in table([runs["sim"]]) and "NVLink n/a GB/s" in table([runs["sim"]])


def test_plot_draws_one_line_per_layout_and_names_only_what_it_draws(tmp_path):
    from ep_runtime.tools.bench.run import plot, plot_series

    runs = _sim_and_gpu_results()
    for name, floors in (("sim", False), ("gpu", True)):
        series = plot_series(runs[name])
        assert sorted((s["phase"], s["label"]) for s in series) == [
            ("combine", "eager compact"), ("combine", "eager expanded"),
            ("dispatch", "eager compact"), ("dispatch", "eager expanded")]
        for s in series:
            assert s["T"] == [3, 6]  # one layout per line, in increasing T: no zig-zag
            assert (s["floor_us"] is not None) == floors
        fig = plot([runs[name]], str(tmp_path / f"{name}.png"), simulated=name == "sim")
        assert (tmp_path / f"{name}.png").stat().st_size > 0
        for ax in fig.axes:
            drawn = [line.get_label() for line in ax.get_lines()]
            assert [t.get_text() for t in ax.get_legend().get_texts()] == drawn  # named = drawn
            assert len(drawn) == (4 if floors else 2)
            assert sum(label.startswith("floor") for label in drawn) == (2 if floors else 0)
            for line in ax.get_lines():
                assert list(line.get_xdata()) == [3, 6]


def test_report_renders_the_readme_table_and_the_plot_with_the_baselines_of_the_run(tmp_path):
    from ep_runtime.tools.bench.measure import SPANS
    from ep_runtime.tools.bench.report import baseline_series, main, markdown_table
    from ep_runtime.tools.bench.run import _result

    results = []
    for T in (6, 3):
        cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=128, max_tokens_per_rank=T)
        _, ids, _ = make_inputs(cfg, "random", 1, n_tokens=[T, T])
        tr = rank_traffic(ids, 0, cfg.n_local_experts, cfg.hidden)
        base = {"all_to_all": [T + 1.0] * 3, "all_to_all+permute": [T + 2.0] * 3,
                "deepep_32sms_dispatch": [T + 3.0] * 3, "deepep_32sms_dispatch_cached": [T + 4.0] * 3,
                "deepep_32sms_combine": [T + 5.0] * 3, "layer_dispatch": [T + 6.0] * 3,
                "layer_dispatch_cached": [T + 7.0] * 3, "layer_combine_unweighted": [T + 8.0] * 3,
                "layer_combine": [T + 9.0] * 3}
        for layout, scale in (("expanded", 2.0), ("compact", 1.0)):
            spans = {k: [scale * T + 0.25] * 3 for k in SPANS}
            results.append(_result(cfg, tr, spans, base, {"nvlink_gbps": 100.0, "hbm_gbps": 1000.0}, "graph",
                                   None, layout))
    table = markdown_table(results).splitlines()
    assert len(table) == 4 and table[1].count("---") == table[0].count("|") - 1
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert [r[:2] for r in rows] == [["3", "bf16"], ["6", "bf16"]]  # sorted by T
    for row, T, res in zip(rows, (3, 6), (results[3], results[1])):
        t = res["times_us"]
        assert row[2] == f"{t['dispatch']['median']:.1f} / {t['combine']['median']:.1f}"  # compact first
        assert row[6] == f"{T + 1.0:.1f} / {T + 2.0:.1f}"
        assert row[7] == f"{T + 3.0:.1f} / {T + 4.0:.1f} / {T + 5.0:.1f}"
        assert row[8] == f"{T + 6.0:.1f} / {T + 7.0:.1f} / {T + 8.0:.1f} / {T + 9.0:.1f}"
    series = {(s["phase"], s["label"]): s for s in baseline_series(results)}
    assert sorted(series) == [("combine", "DeepEP V1 32 SMs, combine (bf16)"),
                              ("dispatch", "DeepEP V1 32 SMs, cached dispatch (bf16)"),
                              ("dispatch", "DeepEP V1 32 SMs, layout + dispatch (bf16)"),
                              ("dispatch", "NCCL all_to_all (bf16)"), ("dispatch", "NCCL all_to_all + permute (bf16)")]
    assert series["dispatch", "NCCL all_to_all (bf16)"]["T"] == [3, 6]
    assert series["dispatch", "NCCL all_to_all (bf16)"]["us"] == [4.0, 7.0]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"meta": {"ranks": 2, "device": "NVIDIA H200", "git_sha": "abc1234"},
                                "results": [results, results]}))
    assert main([str(path), "--plot", str(tmp_path / "run.png")]) == 0
    assert (tmp_path / "run.png").stat().st_size > 0


def _layer_times_pe(session, cfg: EPConfig) -> dict:
    """The bench's timing of ep_runtime's DeepEP layer on this PE (tiny sizes: the calls, not the times)."""
    from ep_runtime.tools.bench.deep_ep_api import deep_ep_layer

    xs, ids, ws = make_inputs(cfg, "random", 3, n_tokens=[cfg.max_tokens_per_rank] * cfg.n_ranks)
    r = session.rank
    fp8 = cfg.token_format.quantize(xs[r].view(np.uint16)) if cfg.token_format.quantized else None
    times = deep_ep_layer(session, xs[r], ids[r], ws[r], cfg.n_experts, samples=2, warmup=1, fp8=fp8)
    return {k: (len(v), all(t > 0 for t in v)) for k, v in times.items()}


@pytest.mark.parametrize("token_dtype", ["bfloat16", "fp8_e4m3"])
def test_the_layer_of_deep_ep_s_api_is_timed_on_the_bench_s_session(token_dtype):
    """bench's ``layer_*`` figures (what ep_runtime.deep_ep adds to the runtime's calls): the layer
    runs on the session the bench opened (one per process), every call timed ``samples`` times."""
    pytest.importorskip("torch")
    from ep_runtime.shmem.launch import run_pes

    cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=128, max_tokens_per_rank=4, token_dtype=token_dtype)
    for got in run_pes(_layer_times_pe, 2, args=(cfg,), timeout_s=240):
        assert got == {f"layer_{k}": (2, True) for k in ("dispatch", "dispatch_cached", "combine", "dispatch_worst",
                                                          "combine_unweighted")}
