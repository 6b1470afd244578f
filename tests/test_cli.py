"""The command-line tools' shared pieces: help that shows defaults, progress lines, and the
simulator's cost estimate (ep_runtime.tools.cli, ep_runtime.tools.sim_cost)."""

from __future__ import annotations

import argparse
import io
import time

import pytest

from ep_runtime.tools import sim_cost
from ep_runtime.tools.cli import HelpFormatter, Heartbeat


def test_help_ends_each_option_with_its_default():
    p = argparse.ArgumentParser(prog="tool", formatter_class=HelpFormatter, description="line one\nline two")
    p.add_argument("--n", type=int, default=4, help="how many")
    p.add_argument("--modes", nargs="+", default=["eager", "graph"], help="modes")
    p.add_argument("--share", type=float, default=0.5, help="a share, in %%")
    p.add_argument("--size", type=int, help="a size (default: 8 here, 16 there)")
    p.add_argument("--flag", action="store_true", help="a flag")
    p.add_argument("--path", help="a path")
    text = p.format_help()
    assert "line one\nline two" in text  # the description's line breaks are kept
    flat = " ".join(text.split())
    for words in ("how many (default: 4)", "modes (default: eager graph)", "a share, in % (default: 0.5)",
                  "a size (default: 8 here, 16 there) ", "a flag ", "a path"):
        assert words in flat + " ", words
    assert "(default: None)" not in flat and "(default: False)" not in flat


def test_heartbeat_prints_whole_lines_while_a_call_runs():
    out = io.StringIO()
    with Heartbeat("tool", every_s=0.05, estimate_s=100, stream=out):
        time.sleep(0.3)
    lines = out.getvalue().splitlines(keepends=True)
    assert len(lines) >= 2, lines
    assert all(line.startswith("tool: still running, ") and line.endswith(" elapsed (estimate: 100 s)\n")
               for line in lines), lines
    quiet = io.StringIO()
    with Heartbeat("tool", every_s=10, stream=quiet):
        pass
    assert quiet.getvalue() == ""  # a short call prints nothing


def test_estimate_adds_up_the_measured_costs():
    est = sim_cost.estimate(2, [(3, 10.0, 64)], cores=2)  # hidden 64: 16 uint64 words a row
    cpu = 2 * sim_cost.RANK_START_CPU_S + 3 * (2 * sim_cost.CALL_CPU_S + 10 * (sim_cost.MESSAGE_CPU_S
                                                                          + 16 * sim_cost.WORD_CPU_S))
    assert est.cpu_s == pytest.approx(cpu)
    assert est.seconds == pytest.approx(cpu / (2 * sim_cost.PARALLEL_EFFICIENCY))
    # more ranks than cores: the waiting ranks' polling takes cores from the working ones
    many = sim_cost.estimate(64, [(1, 10.0, 64)], cores=2)
    assert many.seconds == pytest.approx(many.cpu_s / (2 - 62 * sim_cost.POLL_CORE_FRACTION))
    assert sim_cost.estimate(64, [(1, 10.0, 64)], cores=64).seconds < many.seconds / 10


def test_ranks_per_token():
    assert sim_cost.ranks_per_token(2, 8, 8) == pytest.approx(2.0)  # every expert: both ranks
    assert sim_cost.ranks_per_token(4, 4, 1) == pytest.approx(1.0)
    # 2 ranks of 4 experts, top-2 of 8: a token misses a rank with probability C(4,2)/C(8,2) = 6/28
    assert sim_cost.ranks_per_token(2, 8, 2) == pytest.approx(2 * (1 - 6 / 28))
    assert sim_cost.ranks_per_token(4, 16, 4, "one_expert") == 1.0  # experts 0-3, all on rank 0


def test_durations_and_the_timeout_hint():
    assert [sim_cost.format_duration(s) for s in (40, 305, 1800, 5 * 3600, 9 * 86400)] == [
        "40 s", "305 s", "30 min", "5.0 h", "9 days"]
    assert sim_cost.timeout_hint(304.5) == ", or raise --timeout to 610 to run it anyway"
    assert sim_cost.timeout_hint(2 * 3600) == ""  # hours: not offered
