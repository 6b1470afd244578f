"""The demo as a newcomer meets it (``python -m ep_runtime demo``): its help shows every default,
its summary explains each column, states the tolerance and a verdict per rank, says that the
simulator's times are not performance, prints progress while the ranks run, and a size the
simulator cannot finish within --timeout is refused before anything starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ep_runtime import EPConfig
from ep_runtime.__main__ import main, simulator_estimate
from ep_runtime.tools.demo import COLUMNS, SIMULATOR_TIMES_NOTE, print_summary


def _demo(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "ep_runtime", "demo", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    for option, default in (("--backend", "auto"), ("--ranks", "4"), ("--experts", "16"), ("--top-k", "4"),
                            ("--hidden", "64"), ("--tokens", "24"), ("--scenario", "random"), ("--seed", "0"),
                            ("--timeout", "300.0")):
        tail = text.split(f"{option} ")[-1]  # the option's own help: after its last mention
        assert f"(default: {default})" in tail.split(" --")[0], f"{option}: no default in its help: {tail[:200]}"
    assert "the runtime's choice" in text  # --n-sms: no default value, said in words


def test_default_demo_explains_itself_and_passes():
    proc = _demo()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    assert out[-1] == "PASS"
    legend = out[out.index("columns:") + 1:]
    for name, _ in COLUMNS["kernels"]:
        assert any(line.startswith(f"  {name}:") for line in legend), f"column {name!r} is not explained"
    head = next(line for line in out if line.startswith("rank "))
    assert head.split() == ["rank", "tokens", "rows", "batch", "max", "err", "tol", "check", "dispatch", "ms",
                            "combine", "ms"]
    ranks = [line.split() for line in out[out.index(head) + 1:] if line[:4].strip().isdigit()]
    assert [r[0] for r in ranks] == ["0", "1", "2", "3"]
    for r in ranks:
        assert r[3] == "exact" and float(r[4]) == 0.0 and float(r[5]) > 0 and r[6] == "PASS", r
    assert SIMULATOR_TIMES_NOTE in out
    # progress on stderr, a line at a time: the estimate, then rank 0's phases
    err = proc.stderr
    assert "\r" not in err and "Warning" not in err, err
    assert "ep_runtime demo: running 4 simulated ranks" in err and "idle CPU core" in err
    for phase in ("all 4 ranks started, runtime built", "dispatched", "combined"):
        assert f"ep_runtime demo: rank 0: {phase} (" in err, err


def test_odd_hidden_prints_no_runtime_warnings():
    """hidden 7 moves rows as 7 uint16 words: combine's single-word loops (their lanes past a
    row's end once summed unset local memory; tests/test_combine_padding_sim.py pins that)."""
    proc = _demo("--hidden", "7", "--ranks", "2", "--experts", "4", "--top-k", "2", "--tokens", "8")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RuntimeWarning" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "PASS"


def _no_job(*args, **kwargs):
    raise AssertionError("run_job called: the size must be refused before anything runs")


@pytest.mark.parametrize("argv, raise_timeout", [
    (["--ranks", "64", "--experts", "64"], True),                   # startup of 64 processes on a few cores
    (["--ranks", "2", "--experts", "256", "--top-k", "8", "--hidden", "7168", "--tokens", "4096"], False),  # GPU size
])
def test_sizes_the_simulator_cannot_finish_are_refused_up_front(monkeypatch, capsys, argv, raise_timeout):
    import ep_runtime.shmem.launch as launch
    from ep_runtime.tools import sim_cost

    monkeypatch.setattr(launch, "run_job", _no_job)
    monkeypatch.setattr(sim_cost, "usable_cores", lambda: 2)  # the estimate of a 2-core machine
    assert main(["demo", "--backend", "sim", *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    for words in ("the simulator cannot finish this size within --timeout 300 s; estimate: about",
                  "lower --ranks, --tokens or --hidden",
                  "mpirun -np", "--backend nvshmem"):
        assert words in err, err
    # a larger --timeout is offered only where the run would end within the hour
    assert ("raise --timeout to" in err) == raise_timeout, err


def test_a_size_within_the_timeout_runs_with_progress(monkeypatch, capsys):
    """Accepted sizes run with the estimate printed first, rank 0 reporting its phases, and
    device-side waits bounded by --timeout (the simulator's peers are slow, not stuck)."""
    import ep_runtime.shmem.launch as launch

    calls = []

    def fake_job(target, n_ranks, args, **kw):
        calls.append((args, kw))
        cfg_fields, scenario, seed, since = args
        return [{"rank": r, "tokens": 3, "rows": 6, "dispatch_exact": True, "combine_max_err": 0.0,
                 "combine_ok": r != 1, "combine_tol": 0.25, "dispatch_s": 0.5, "combine_s": 0.5,
                 "plan": "wait receiver, stores"} for r in range(n_ranks)]

    monkeypatch.setattr(launch, "run_job", fake_job)
    assert main(["demo", "--backend", "sim", "--ranks", "2", "--experts", "4", "--timeout", "123"]) == 1
    (cfg_fields, _, _, since), kw = calls[0]
    assert cfg_fields["wait_timeout_s"] == 123 and kw["timeout_s"] == 123 and since > 0
    captured = capsys.readouterr()
    assert "ep_runtime demo: running 2 simulated ranks" in captured.err
    lines = captured.out.splitlines()
    assert lines[-1] == "FAIL: rank(s) 1 (see the check column)"
    assert [line.split()[6] for line in lines if line[:4].strip().isdigit()] == ["PASS", "FAIL"]


def test_reference_backend_says_what_it_checks(capsys):
    assert main(["demo", "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "no kernels ran" in out and "4 bf16 ulps" in out
    rows = [line.split() for line in out.splitlines() if line[:4].strip().isdigit()]
    assert len(rows) == 4 and all(r[6] == "PASS" and r[7:] == ["-", "-"] for r in rows)
    assert SIMULATOR_TIMES_NOTE not in out


def test_summary_of_a_rank_with_no_tokens(capsys):
    cfg = EPConfig(n_ranks=2, n_experts=4, top_k=2, hidden=8, max_tokens_per_rank=4)
    rows = [{"rank": 0, "tokens": 0, "rows": 2, "dispatch_exact": True, "combine_max_err": 0.0, "combine_ok": True,
             "combine_tol": None, "dispatch_s": 0.1, "combine_s": 0.1},
            {"rank": 1, "tokens": 4, "rows": 0, "dispatch_exact": False, "combine_max_err": 2.0,
             "combine_ok": False, "combine_tol": 0.5, "dispatch_s": 0.1, "combine_s": 0.1}]
    assert not print_summary(cfg, "sim", "zero_rank", rows, simulated=True)
    lines = capsys.readouterr().out.splitlines()
    r0, r1 = (line.split() for line in lines if line[:4].strip().isdigit())
    assert r0[5] == "-" and r0[6] == "PASS"  # no tokens: no tolerance to show
    assert r1[3] == "WRONG" and r1[6] == "FAIL"
    assert lines[-1].startswith("FAIL: rank(s) 1")


def test_estimate_grows_with_the_size_and_matches_the_reported_cases(monkeypatch):
    from ep_runtime.tools import sim_cost

    monkeypatch.setattr(sim_cost, "usable_cores", lambda: 2)

    def seconds(**kw):
        fields = dict(n_ranks=4, n_experts=16, top_k=4, hidden=64, max_tokens_per_rank=24) | kw
        return simulator_estimate(EPConfig(**fields), "random").seconds

    default = seconds()
    assert 2 < default < 30  # the default demo takes seconds
    assert seconds(max_tokens_per_rank=96) > default and seconds(hidden=1024) > default
    assert seconds(n_ranks=16, n_experts=16) > default
    # 64 ranks on 2 cores take minutes (start-up and polling, mostly): past the default --timeout
    assert 150 < seconds(n_ranks=64, n_experts=64) < 700

