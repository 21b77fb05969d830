"""One polling helper for tests that wait on another process: a condition checked until it holds or a deadline
passes (the deadline is generous and only bounds a failure; nothing waits a fixed time)."""

from __future__ import annotations

import time


def wait_for(condition, timeout_s: float, what, interval_s: float = 0.1, alive=None):
    """condition() until it returns something truthy (returned); AssertionError naming `what` (a string, or a
    callable giving one when it fails: a log's tail) after timeout_s, or at once when alive() (optional: a process
    still running?) turns false."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = condition()
        if got:
            return got
        if alive is not None and not alive():
            raise AssertionError(f"{_text(what)}: the process exited first")
        if time.monotonic() > deadline:
            raise AssertionError(f"{_text(what)}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def _text(what) -> str:
    return what() if callable(what) else what
