"""Helpers the command-line tools share (``python -m ep_runtime demo``, ``python -m ep_runtime.tools.bench``):
help that shows each option's default, and progress lines during long runs."""

from __future__ import annotations

import argparse
import sys
import threading
import time

from ep_runtime.tools.sim_cost import format_duration


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's line breaks and ends each option's help with its default,
    ``(default: X)``, a list as its items separated by spaces. Nothing is appended where the
    default is None or a flag's False (such options say in their help what happens without
    them) or where the help already names its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if default is None or default is argparse.SUPPRESS or isinstance(default, bool) or "default" in text:
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"  # argparse %-formats help strings


class Heartbeat:
    """While a long call runs, prints ``"{label}: still running, 30 s elapsed (estimate: ...)"``
    on a line of its own to ``stream`` (default stderr) every ``every_s`` seconds, from a daemon
    thread, so a long simulator job is never silent. A context manager; nothing is printed
    by a call shorter than ``every_s``.

    Parameters
    ----------
    label : str
        What runs (the tool's name).
    every_s : float
        Seconds between lines.
    estimate_s : float, optional
        The expected duration, printed next to the elapsed time.
    """

    def __init__(self, label: str, every_s: float = 15.0, estimate_s: float | None = None, stream=None):
        self.label, self.every_s, self.estimate_s = label, every_s, estimate_s
        self.stream = stream
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="ep_runtime-heartbeat", daemon=True)
        self._start = 0.0

    def __enter__(self) -> Heartbeat:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._done.wait(self.every_s):
            elapsed = time.monotonic() - self._start
            about = f" (estimate: {format_duration(self.estimate_s)})" if self.estimate_s is not None else ""
            print(f"{self.label}: still running, {format_duration(elapsed)} elapsed{about}",
                  file=self.stream or sys.stderr, flush=True)
