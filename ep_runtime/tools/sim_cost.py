"""How long a job takes on the simulator: an estimate from measured costs, so the command-line
tools can refuse, before starting anything, a size the simulator cannot finish in reasonable time.

On the simulator every simulated GPU thread is a Python thread and the ranks are processes
sharing the machine's cores. A job's CPU time is, to within about a factor of two of the measured
one (demo and bench jobs of 1 to 64 ranks, hidden 8 to 7168)::

    cpu = ranks * RANK_START_CPU_S
          + round_trips * (ranks * CALL_CPU_S + messages * (MESSAGE_CPU_S + words * WORD_CPU_S))

where a *message* is one (token, destination rank) pair of one round trip (a dispatched row on
the wire and the combine partial that comes back) and ``words`` the words of one row (the
kernels' token word, :func:`~ep_runtime.core.layout.token_word`). The wall time is that CPU time
over the cores the ranks keep busy: at most one core each, and only :data:`PARALLEL_EFFICIENCY`
of them on average (the ranks wait for each other's signals), or, with more ranks than cores,
the cores less what the waiting ranks take (a waiting rank polls the simulated heap:
:data:`POLL_CORE_FRACTION` of a core), whichever is less. The estimate assumes the cores are
otherwise idle; where they are not, the description says so.

Re-measure the constants with ``python tools/sim_cost.py`` (it prints the measured CPU and wall
time of a set of jobs next to this model, and the CPU constants refitted on them).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ep_runtime.core.layout import token_word

#: CPU seconds to start one simulated rank: interpreter, NumPy and Numba imports, the simulated
#: heap, the runtime and its simulated kernels.
RANK_START_CPU_S = 0.92
#: CPU seconds per rank of one round trip (dispatch + combine) besides its rows: the launches of
#: the simulated blocks (a Python thread per simulated GPU thread), barriers, host bookkeeping.
CALL_CPU_S = 0.16
#: CPU seconds per message of one round trip besides its words: routing, placement, the row's
#: warp items in dispatch, the expansion copy and combine.
MESSAGE_CPU_S = 0.0157
#: CPU seconds per word of a message of one round trip (each word is copied and summed by a
#: simulated lane, element by element).
WORD_CPU_S = 0.000345
#: Fraction of a core a rank takes while it waits for its peers (it polls the simulated heap,
#: waking at least every 2 ms): it matters when there are more ranks than cores.
POLL_CORE_FRACTION = 0.025
#: Average fraction of the ranks' cores doing work (the rest of the time a rank waits for a
#: peer's signal or barrier).
PARALLEL_EFFICIENCY = 0.6
#: Lower bound of the cores the ranks are modelled to get, as a fraction of the machine's.
MIN_CORE_FRACTION = 0.1


def usable_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def ranks_per_token(n_ranks: int, n_experts: int, top_k: int, scenario: str = "random") -> float:
    """Expected destination ranks of one token: with ``top_k`` distinct experts drawn uniformly
    (:func:`~ep_runtime.testing.make_routing`), ``R (1 - C(E - L, K) / C(E, K))``; with
    ``"one_expert"`` (experts 0 .. K - 1) the ranks that hold them."""
    local = n_experts // n_ranks
    if scenario == "one_expert":
        return float(math.ceil(top_k / local))
    miss = math.comb(n_experts - local, top_k) / math.comb(n_experts, top_k)
    return n_ranks * (1.0 - miss)


@dataclass(frozen=True)
class SimEstimate:
    """A job's estimated cost on the simulator (module docstring)."""

    n_ranks: int
    messages: float      # per round trip, all ranks
    round_trips: int
    cpu_s: float
    cores: int
    seconds: float       # wall time on ``cores`` otherwise idle cores
    load: float | None = None  # the machine's load average when estimated (None: unknown)

    def describe(self) -> str:
        """One line: the estimate, what it is made of, and whether other work shares the cores."""
        busy = (f"; the machine is busy (load average {self.load:.1f} on {self.cores} cores): expect longer"
                if self.load is not None and self.load >= self.cores else "")
        return (f"about {format_duration(self.seconds)} on {self.cores} idle CPU core(s): {self.n_ranks} rank "
                f"processes, {self.round_trips} round trip(s) of up to {self.messages:,.0f} token messages, "
                f"{self.cpu_s:,.0f} CPU s in all{busy}")


def estimate(n_ranks: int, jobs, cores: int | None = None) -> SimEstimate:
    """The cost of a simulated job of ``n_ranks`` ranks.

    Parameters
    ----------
    n_ranks : int
        Simulated ranks (one process each).
    jobs : iterable of (round_trips, messages, hidden)
        Per configuration of the job: its round trips, its messages per round trip (all ranks;
        :func:`ranks_per_token` times the tokens sent) and its hidden size.
    cores : int, optional
        Cores to spread the ranks over (default: :func:`usable_cores`).
    """
    cores = cores or usable_cores()
    cpu, round_trips, messages = n_ranks * RANK_START_CPU_S, 0, 0.0
    for n, msgs, hidden in jobs:
        words = hidden * 2 // token_word(hidden).itemsize
        cpu += n * (n_ranks * CALL_CPU_S + msgs * (MESSAGE_CPU_S + words * WORD_CPU_S))
        round_trips, messages = round_trips + n, max(messages, msgs)
    busy = min(n_ranks, cores)
    effective = max(min(busy * PARALLEL_EFFICIENCY, busy - max(n_ranks - cores, 0) * POLL_CORE_FRACTION),
                    busy * MIN_CORE_FRACTION)
    return SimEstimate(n_ranks, messages, round_trips, cpu, cores, cpu / effective, load_average())


def load_average() -> float | None:
    """The machine's load average over the last minute, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


#: The longest run the refusal messages offer to start anyway with a larger --timeout.
LONGEST_SUGGESTED_S = 3600.0


def timeout_hint(seconds: float) -> str:
    """``", or raise --timeout to N to run it anyway"`` (twice the estimate, rounded up to
    10 s) for a run estimated at ``seconds``, or nothing past :data:`LONGEST_SUGGESTED_S`."""
    if seconds > LONGEST_SUGGESTED_S:
        return ""
    return f", or raise --timeout to {10 * math.ceil(seconds * 2 / 10)} to run it anyway"


def format_duration(seconds: float) -> str:
    """``"40 s"``, ``"305 s"``, ``"12 min"``, ``"3.5 h"`` or ``"9 days"``."""
    if seconds < 600:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.0f} days"
